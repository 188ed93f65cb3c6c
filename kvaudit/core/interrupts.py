"""Interruptions of a ``kvaudit`` command (Ctrl-C, SIGTERM, SIGHUP): the handlers that
turn each into a ``KeyboardInterrupt``, the record of which arrived, the sections that
must not be cut halfway (the interrupt is raised at their end), and the check an output
makes before it is committed. No import beyond the standard library: the kernels use it.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from .errors import Interrupted

INTERRUPTING = tuple(
    number
    for number in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))
    if number is not None
)
"""Ctrl-C, SIGTERM and SIGHUP, where the platform has them."""

_received: list[str] = []
"""The interrupting signals received by the command running (cleared when one starts)."""

_deferring = [0]
"""How many ``deferred_interrupts`` sections the main thread is in."""

_handling = [False]
"""Whether a command's handlers are installed (``interrupt_signals``)."""


def interrupt_received() -> bool:
    """Whether an interrupting signal (Ctrl-C, SIGTERM, SIGHUP) reached the command: an
    error raised after one is its consequence (a library that turned the interruption of
    its import into an ImportError), not a bug."""
    return bool(_received)


def _interruption(name: str) -> KeyboardInterrupt:
    return KeyboardInterrupt() if name == "SIGINT" else Interrupted(name)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    _received.append(name)
    if not _deferring[0]:
        raise _interruption(name)


def check_interrupted() -> None:
    """Raise the interruption the command received, if any: one that landed where it could
    not unwind the command (in a finalizer, which only prints it) stops it here. Outside
    a command (kvaudit as a library, or after the command) nothing is raised."""
    if _handling[0] and _received:
        raise _interruption(_received[0])


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """A section that an interruption must not cut halfway (threads handed work, waiting
    for it): one that arrives meanwhile is raised when the section ends. Only the
    command's handlers defer; Python's own Ctrl-C handler (kvaudit as a library) still
    raises at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run in the main thread only
        return
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
    if not _deferring[0]:
        check_interrupted()


def _unraisable(hook: Any) -> Any:
    """``sys.unraisablehook`` that drops an interruption raised in a finalizer (it is
    recorded, and ``check_interrupted`` raises it) and passes anything else on."""

    def handle(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            hook(unraisable)

    return handle


@contextmanager
def interrupt_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``Interrupted`` (a ``KeyboardInterrupt``) as Ctrl-C does,
    so that an interrupted write removes its temporary file, and each is recorded
    (``interrupt_received``); the handlers before are restored after. A Ctrl-C that the
    process ignores (a background job's) stays ignored. Only the main thread can set
    handlers: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = {}
    for number in INTERRUPTING:
        if number == signal.SIGINT and signal.getsignal(number) is not signal.default_int_handler:
            continue
        previous[number] = signal.signal(number, _raise_interrupted)
    hook = sys.unraisablehook
    sys.unraisablehook = _unraisable(hook)
    _handling[0] = True
    try:
        yield
    finally:
        _handling[0] = False
        sys.unraisablehook = hook
        for number, handler in previous.items():
            signal.signal(number, handler)
