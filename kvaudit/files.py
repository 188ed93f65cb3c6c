"""Writing a file whole or not at all."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator

from .errors import KvauditError


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[str]:
    """A temporary path next to ``target`` to write the new file at.

    When the block ends, the file there is synced and renamed over ``target`` (and the
    rename synced); on any error it is removed. ``target`` is thus either left as it was or
    replaced whole. An ``OSError`` becomes a one-line ``KvauditError`` naming ``target``.
    """
    path = os.fspath(target)
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        yield temporary
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise KvauditError(f"cannot write: {error.strerror or error}", source=path) from error
        raise
    _sync_directory(directory)


def _sync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable where the platform allows it."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
