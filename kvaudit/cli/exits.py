"""How the ``kvaudit`` command ends when something goes wrong: an interruption (status 130,
``kvaudit.core.interrupts``), an escaping exception reported as one line naming it a bug and
where (status 3, the traceback with ``--debug``), and streams that print what they cannot
encode as escapes instead of raising half-way through a table."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import NoReturn

from ..core.errors import one_line
from ..core.exit_status import ExitStatus
from ..core.interrupts import INTERRUPTING

INTERRUPTED_LINE = "kvaudit: interrupted"


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


def internal_error_line(error: Exception, debug: bool) -> str:
    """The one line that reports an exception that escaped (a bug), saying what and
    where; with ``debug``, its traceback is printed on stderr first."""
    if debug:
        import traceback  # only on a bug, with --debug: every start-up would pay for it

        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    where = _raising_frame(error.__traceback__)
    hint = "" if debug else "; run with --debug for the traceback"
    message = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return one_line(f"kvaudit: internal error (a bug in kvaudit) at {where}: {message}{hint}")


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
        for number in INTERRUPTING:
            if signal.getsignal(number) is not signal.SIG_IGN:
                signal.signal(number, _exit_interrupted)
    _flush_streams()
    run_handlers()
    _flush_streams()
    os._exit(status)


def _exit_interrupted(signum: int, frame: FrameType | None) -> None:
    os._exit(ExitStatus.INTERRUPTED)


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
