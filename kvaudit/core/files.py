"""Files in and out: every output written whole or not at all (or, for a device or a
pipe, in place), never over one of the command's inputs; every input a regular file or
a directory, never something that would block.

Temporary files are named ``.NAME.kvaudit-PID-RANDOM.tmp`` next to their target. One left
behind by a process that was killed (SIGKILL) is removed by the next write into that
directory: when its process is no longer running, or when it is older than
``STALE_AFTER_S``.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .errors import KvauditError
from .interrupts import check_interrupted

STALE_AFTER_S = 24 * 3600
"""Age after which a temporary file of kvaudit's naming is stale whatever its process."""

_TEMPORARY = re.compile(r"^\..*\.kvaudit-(\d+)-[0-9a-f]{12}\.tmp$")
# This process's own descriptors under the names a shell or a user gives them.
_DESCRIPTOR = re.compile(r"^/(?:dev/(?:fd/(\d+)|(stdout)|(stderr))|proc/self/fd/(\d+))$")
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


@dataclass(frozen=True)
class OutputPlace:
    """Where an output goes: ``path`` (a symlink's final target, else the path given),
    replaced atomically unless ``in_place`` (a device, a FIFO or a socket: opened and
    written as it is); ``descriptor`` is set for ``/dev/stdout``, ``/dev/fd/N`` and the
    like, this process's own descriptor."""

    path: str
    in_place: bool = False
    descriptor: int | None = None


def _kind(mode: int) -> str:
    """What a file that is neither regular nor a directory is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def output_place(output: str | os.PathLike[str], option: str = "the output") -> OutputPlace:
    """Where ``output`` is written (``OutputPlace``).

    Raises:
        KvauditError: An empty name, or a directory.

    """
    path = os.fspath(output)
    if not path:
        raise KvauditError(f"{option}: the file name is empty")
    named = _DESCRIPTOR.match(os.path.abspath(path))
    if named is not None:
        number, out, err, proc = named.groups()
        descriptor = 1 if out else 2 if err else int(number or proc)
        return OutputPlace(path, in_place=True, descriptor=descriptor)
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return OutputPlace(real)
    if stat.S_ISDIR(mode):
        raise KvauditError("is a directory, expected a file to write", path)
    return OutputPlace(real, in_place=not stat.S_ISREG(mode))


def _identities(name: str) -> Iterator[tuple[int, int]]:
    """``(st_dev, st_ino)`` of an input: its file, or every file under its directory."""
    path = name.removeprefix("live:")
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return
    yield info.st_dev, info.st_ino
    if stat.S_ISDIR(info.st_mode):
        for root, _, files in os.walk(path):
            for file in files:
                with contextlib.suppress(OSError):
                    inner = os.stat(os.path.join(root, file))
                    yield inner.st_dev, inner.st_ino


def check_output(
    output: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]], option: str = "-o"
) -> None:
    """Refuse an output that is empty, a directory, in a folder that does not exist or
    cannot be written, or one of the command's inputs (the same path, a hardlink or a
    symlink to it, or a file of an input directory).

    Raises:
        KvauditError: One line naming the output and the problem.

    """
    path = os.fspath(output)
    place = output_place(path, option)
    if place.descriptor is not None:
        return
    if not place.in_place:
        # Found before any work: a report that cannot be written would otherwise come
        # out after the comparison, and after the other reports are written.
        folder = os.path.dirname(place.path) or "."
        if not os.path.isdir(folder):
            raise KvauditError(f"cannot write: its folder {folder} does not exist", path)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise KvauditError(f"cannot write: its folder {folder} is not writable", path)
    try:
        info = os.stat(place.path)
    except OSError:
        return
    target = (info.st_dev, info.st_ino)
    for name in inputs:
        if target in _identities(os.fspath(name)):
            raise KvauditError(
                f"{option} is one of the command's inputs ({os.fspath(name)}); "
                "write to another file",
                path,
            )


def output_identity(output: str | os.PathLike[str], option: str = "the output") -> object:
    """What ``output`` writes to, alike for two names of one file (a hardlink, a symlink,
    another spelling) or of one open descriptor.

    Raises:
        KvauditError: An empty name, or a directory.

    """
    place = output_place(output, option)
    if place.descriptor is not None:
        return ("descriptor", place.descriptor)
    try:
        info = os.stat(place.path)
    except OSError:
        return ("path", place.path)
    return ("file", info.st_dev, info.st_ino)


def check_input(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """Refuse an input that is neither a regular file nor, where ``directory``, a
    directory: reading a FIFO, a device or a socket could block forever or never end. A
    missing path passes (the reader says so).

    Raises:
        KvauditError: One line naming the path and what it is.

    """
    name = os.fspath(path)
    try:
        mode = os.stat(name).st_mode
    except (OSError, ValueError):
        return
    if stat.S_ISREG(mode) or (directory and stat.S_ISDIR(mode)):
        return
    if stat.S_ISDIR(mode):
        raise KvauditError("is a directory, expected a file", name)
    expected = "a regular file or a directory" if directory else "a regular file"
    raise KvauditError(f"is {_kind(mode)}, expected {expected}", name)


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove the temporary files of kvaudit's naming in ``directory`` that a killed
    process left: their process is not running, or they are older than
    ``STALE_AFTER_S``. Returns the paths removed."""
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMPORARY.match(entry.name)
        if match is None:
            continue
        pid = int(match.group(1))
        with contextlib.suppress(OSError):
            old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_AFTER_S
            if pid != os.getpid() and (old or not _running(pid)):
                os.unlink(entry.path)
                removed.append(entry.path)
    return removed


def _running(pid: int) -> bool:
    """Whether a process of that id runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _temporary_name(directory: str, target: str) -> str:
    base = os.path.basename(target)[:100]
    return os.path.join(directory, f".{base}.kvaudit-{os.getpid()}-{os.urandom(6).hex()}.tmp")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[str]:
    """A temporary path to write the new file at; when the block ends it becomes
    ``target``.

    A regular file (or a new path) is replaced atomically: the temporary file, next to it,
    is synced and renamed over it (and the rename synced). A symlink's target is replaced,
    not the link. A device, FIFO or socket (``/dev/null``, ``/dev/stdout``) is opened and
    written in place from a temporary file in the system's temporary directory. On any
    error or interruption the temporary file is removed, so ``target`` is either left as it
    was or complete. An ``OSError`` becomes a one-line ``KvauditError`` naming ``target``.
    """
    path = os.fspath(target)
    place = output_place(path)
    if place.in_place:
        import tempfile  # only for special files: importing it costs every command

        directory = tempfile.gettempdir()
    else:
        directory = os.path.dirname(os.path.abspath(place.path))
    remove_stale_temporaries(directory)
    temporary = _temporary_name(directory, place.path)
    try:
        yield temporary
        check_interrupted()  # an interrupted command commits nothing
        if place.in_place:
            _copy_in_place(temporary, place)
            os.unlink(temporary)
        else:
            with open(temporary, "rb+") as file:
                os.fsync(file.fileno())
            os.replace(temporary, place.path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        if isinstance(error, OSError):
            raise KvauditError(f"cannot write: {error.strerror or error}", source=path) from error
        raise
    if not place.in_place:
        _sync_directory(directory)


def _copy_in_place(temporary: str, place: OutputPlace) -> None:
    """Write the temporary file's bytes into a special file or a descriptor as it is."""
    if place.descriptor is not None:
        descriptor = os.dup(place.descriptor)
    else:
        # No O_CREAT, no O_TRUNC: a device or FIFO is written, never made or emptied.
        descriptor = os.open(place.path, os.O_WRONLY)
    import shutil

    with open(temporary, "rb") as source, open(descriptor, "wb") as sink:
        shutil.copyfileobj(source, sink)


def _sync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable where the platform allows it."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
