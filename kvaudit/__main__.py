"""``python -m kvaudit`` and the ``kvaudit`` script: the command, with Ctrl-C, SIGTERM and
SIGHUP during start-up (while the command line is imported) exiting 130 without a
traceback, and the process ended without tearing the interpreter down (``end_process``)."""

from __future__ import annotations

import signal
import sys
from types import FrameType

from .core.exit_status import ExitStatus


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run() -> None:
    """Import the command line and run it, then end the process (``end_process``); an
    interruption while importing, or outside the command's own handling, exits 130."""
    for number in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if number is not None:
            signal.signal(number, _interrupted)
    try:
        from .cli import main
    except KeyboardInterrupt:
        sys.stderr.write("kvaudit: interrupted\n")
        sys.exit(ExitStatus.INTERRUPTED)
    from .cli.exits import end_process

    try:
        status = main(prog_name="kvaudit", standalone_mode=False)
    except KeyboardInterrupt:
        sys.stderr.write("kvaudit: interrupted\n")
        status = ExitStatus.INTERRUPTED
    end_process(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    run()
