"""``python -m kvaudit`` and the ``kvaudit`` script: the command, with Ctrl-C, SIGTERM and
SIGHUP during start-up (while the command line is imported) exiting 130 without a
traceback, and the process ended without tearing the interpreter down (``end_process``)."""

from __future__ import annotations

import signal
import sys
from types import FrameType

EXIT_INTERRUPTED = 130


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run() -> None:
    """Import the command line and run it; an interruption while importing exits 130."""
    hangup = getattr(signal, "SIGHUP", None)
    previous = {
        number: signal.signal(number, _interrupted)
        for number in (signal.SIGTERM, hangup)
        if number is not None
    }
    try:
        from .cli import main
    except KeyboardInterrupt:
        sys.stderr.write("kvaudit: interrupted\n")
        sys.exit(EXIT_INTERRUPTED)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    status = main(prog_name="kvaudit", standalone_mode=False)
    from .exits import end_process

    end_process(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    run()
