"""Errors kvaudit reports to people."""

from __future__ import annotations

import re


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


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP received: unwinds like Ctrl-C (temporary files removed)."""


ECHO_LIMIT = 200
"""Characters of one echoed value (a word of a message) printed before it is cut: room
for a deep path, not for a 50 MB layer name."""
LINE_LIMIT = 2000
"""Characters of a one-line message printed before it is cut."""
# C0 controls but newline, DEL, and C1 controls: what a terminal could act on.
_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, newlines: bool = True) -> str:
    """``text`` with control characters (ESC, OSC, C0, DEL, C1) and lone surrogates written
    as ``\\xNN``/``\\uNNNN`` escapes, so that a terminal shows them rather than acts on them;
    newlines are kept only when ``newlines``."""
    text = _SURROGATE.sub(_escape_char, _CONTROL.sub(_escape_char, text))
    return text if newlines else text.replace("\n", "\\n")


def capped(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text``, or its start and end around ``...`` with its length noted when longer
    than ``limit``."""
    if len(text) <= limit:
        return text
    keep = max(limit - 3, 2)
    return f"{text[: keep - keep // 3]}...{text[-(keep // 3) :]} ({len(text)} characters)"


def one_line(message: str) -> str:
    """A message as one printable line: whitespace runs made single spaces, control
    characters escaped, each word of more than ``ECHO_LIMIT`` characters (an echoed name,
    a path) cut with its length noted, and the line cut at ``LINE_LIMIT``."""
    words = [capped(printable(word, newlines=False)) for word in message.split()]
    return capped(" ".join(words), LINE_LIMIT)
