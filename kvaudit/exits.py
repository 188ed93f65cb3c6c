"""How the ``kvaudit`` command ends when something goes wrong: SIGTERM and SIGHUP unwound
like Ctrl-C (status 130), an escaping exception reported as one line naming it a bug and
where (status 3, the traceback with ``--debug``), and streams that print what they cannot
encode as escapes instead of raising half-way through a table."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import NoReturn

import click

from .errors import Interrupted, one_line

EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130


def tolerant_streams() -> None:
    """Make stdout and stderr write text they cannot encode (a lone surrogate) as
    backslash escapes instead of raising half-way through a table."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                continue


_INTERRUPTING = tuple(
    number
    for number in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None))
    if number is not None
)
"""Ctrl-C, SIGTERM and SIGHUP, where the platform has them."""

_received: list[str] = []
"""The interrupting signals received by the command running (cleared when one starts)."""


def interrupt_received() -> bool:
    """Whether an interrupting signal (Ctrl-C, SIGTERM, SIGHUP) reached the command: an
    error raised after one is its consequence (a library that turned the interruption of
    its import into an ImportError), not a bug."""
    return bool(_received)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    _received.append(signal.Signals(signum).name)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signal.Signals(signum).name)


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
    for number in _INTERRUPTING:
        if number == signal.SIGINT and signal.getsignal(number) is not signal.default_int_handler:
            continue
        previous[number] = signal.signal(number, _raise_interrupted)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _raising_frame(trace: TracebackType | None) -> str:
    """Where an exception was raised, as ``module:line``, with kvaudit's innermost frame
    when the raising one is another package's."""
    frames = [(tb.tb_frame, tb.tb_lineno) for tb in _tracebacks(trace)]
    if not frames:
        return "an unknown place"
    where = [f"{frame.f_globals.get('__name__', '?')}:{line}" for frame, line in frames]
    ours = [
        text
        for text, (frame, _) in zip(where, frames)
        if str(frame.f_globals.get("__name__", "")).startswith("kvaudit")
    ]
    if ours and ours[-1] != where[-1]:
        return f"{where[-1]} (from {ours[-1]})"
    return where[-1]


def _tracebacks(trace: TracebackType | None) -> Iterator[TracebackType]:
    while trace is not None:
        yield trace
        trace = trace.tb_next


def internal_error(error: Exception, debug: bool) -> int:
    """Report an exception that escaped (a bug): the traceback only with ``--debug``,
    then one line saying it is a bug, what and where; the internal-error status."""
    if debug:
        import traceback  # only on a bug, with --debug: every start-up would pay for it

        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    where = _raising_frame(error.__traceback__)
    hint = "" if debug else "; run with --debug for the traceback"
    message = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    click.echo(
        one_line(f"kvaudit: internal error (a bug in kvaudit) at {where}: {message}{hint}"),
        err=True,
    )
    return EXIT_INTERNAL


def end_process(status: int) -> NoReturn:
    """End the command's process with ``status``: flush stdout and stderr, run the exit
    handlers, then leave without the interpreter tearing its modules down (numpy's teardown
    alone is about a tenth of a small command's run). An interruption meanwhile ends it
    with the interrupted status at once, never by the signal itself. Where a thread that
    is not a daemon still runs, exit as usual instead, which waits for it."""
    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    others = [
        thread
        for thread in threading.enumerate()
        if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()
    ]
    if run_handlers is None or others:
        sys.exit(status)
    if threading.current_thread() is threading.main_thread():
        for number in _INTERRUPTING:
            if signal.getsignal(number) is not signal.SIG_IGN:
                signal.signal(number, _exit_interrupted)
    _flush_streams()
    run_handlers()
    _flush_streams()
    os._exit(status)


def _exit_interrupted(signum: int, frame: FrameType | None) -> None:
    os._exit(EXIT_INTERRUPTED)


def _flush_streams() -> None:
    """Flush stdout and stderr; one whose reader went away (`kvaudit ... | head`) is
    pointed at /dev/null instead, and the status stays the command's."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except (OSError, ValueError):
                continue
