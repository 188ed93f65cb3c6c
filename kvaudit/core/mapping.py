"""Dump files mapped read-only into memory without holding a file descriptor each (so
that 10,000 dumps stay under ``ulimit -n``), checked for having shrunk before each read,
and a last-resort handler that turns the SIGBUS of reading a truncated mapping into a
one-line error.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import stat
import time
import weakref

from .errors import KvauditError

CHANGED = "changed while reading"
_BUS_MESSAGE = (
    b"kvaudit: error: a dump file changed while reading (it was truncated or rewritten "
    b"in place while kvaudit read it)\n"
)
_BUS_STATUS = 2


def _libc() -> ctypes.CDLL | None:
    """The C library's mmap, munmap and madvise, where the platform has them."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    return libc


_LIBC = _libc()
_FAILED = ctypes.c_void_p(-1).value


class FileMap:
    """A whole file mapped read-only: ``buffer`` (for ``torch.frombuffer``), its
    ``address`` and ``length``. Where the C library allows, the file's descriptor is closed
    right after mapping and the pages are unmapped once neither this object nor a tensor
    over ``buffer`` is left; elsewhere an ``mmap.mmap`` holds them."""

    def __init__(self, path: str) -> None:
        self.path = path
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):
                raise KvauditError("is not a regular file, expected a dump file", path)
            self.identity = (info.st_dev, info.st_ino)
            self.length = info.st_size
            if self.length == 0:
                raise KvauditError("cannot map: the file is empty", path)
            self.buffer: object
            if _LIBC is None:
                self._mmap: mmap.mmap | None = mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
                self.buffer = self._mmap
                import numpy as np  # only where the C library's mmap is not at hand

                self.address = int(np.frombuffer(self._mmap, np.uint8, count=1).ctypes.data)
            else:
                self._mmap = None
                self.address, self.buffer = _map(descriptor, self.length, path)
        finally:
            os.close(descriptor)

    def __len__(self) -> int:
        return self.length

    def drop_pages(self) -> None:
        """Drop the pages this process holds resident (read again when next touched)."""
        if self._mmap is not None:
            self._mmap.madvise(mmap.MADV_DONTNEED)
        elif _LIBC is not None:
            _LIBC.madvise(self.address, self.length, mmap.MADV_DONTNEED)

    def check_unchanged(self) -> None:
        """Refuse to read on when the file at ``path`` is this file and now shorter than
        mapped: touching its lost pages would end the process with SIGBUS.

        Raises:
            KvauditError: ``changed while reading``, naming the file.

        """
        try:
            info = os.stat(self.path)
        except OSError:
            return
        if (info.st_dev, info.st_ino) == self.identity and info.st_size < self.length:
            raise KvauditError(
                f"{CHANGED}: it was {self.length} bytes when opened, it is {info.st_size} now",
                self.path,
            )


def _map(descriptor: int, length: int, path: str) -> tuple[int, object]:
    """Map a descriptor's file with the C library: its address and a buffer over it that
    unmaps the pages when it is collected."""
    assert _LIBC is not None
    address = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, 0)
    if address is None or address == _FAILED:
        raise KvauditError(f"cannot map: {os.strerror(ctypes.get_errno())}", path)

    class Pages(ctypes.c_ubyte * length):  # type: ignore[misc, valid-type]
        """The mapped bytes (a subclass, so that it can carry a finalizer)."""

    buffer = Pages.from_address(address)
    weakref.finalize(buffer, _LIBC.munmap, address, length)
    return address, buffer


_bus_error_seen = False


@ctypes.CFUNCTYPE(None, ctypes.c_int)
def _on_bus_error(signum: int) -> None:  # pragma: no cover - runs in a dying process
    global _bus_error_seen
    if _bus_error_seen:
        # Another thread hit the lost pages too (os.write lets it in): it waits here for
        # the first one's exit, since returning would only fault again.
        while True:
            time.sleep(1)
    _bus_error_seen = True
    os.write(2, _BUS_MESSAGE)
    os._exit(_BUS_STATUS)


def catch_bus_errors() -> None:
    """Make a SIGBUS (a mapped dump truncated under the reader between two checks) end
    the process with a one-line error and status 2 instead of a silent crash (status 135).
    For the command line: it replaces the process's handler."""
    bus = getattr(signal, "SIGBUS", None)
    if _LIBC is None or bus is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        _LIBC.signal(int(bus), ctypes.cast(_on_bus_error, ctypes.c_void_p))
