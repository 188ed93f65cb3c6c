"""Errors kvaudit reports to people."""

from __future__ import annotations


class KvauditError(Exception):
    """Bad input or usage: one line naming the file (or source) and the problem.

    The command line prints ``str(error)`` and exits with status 2.
    """

    def __init__(self, message: str, source: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.source = source

    def __str__(self) -> str:
        return f"{self.source}: {self.message}" if self.source else self.message


class DescriptionError(KvauditError):
    """An invalid cache description: the message names the key path and what is expected."""


class WireFormatError(KvauditError):
    """Producer checksums on the wire that are malformed."""


class UnsupportedGroupError(Exception):
    """A KV cache group that is valid but cannot be checksummed; the message is the reason."""
