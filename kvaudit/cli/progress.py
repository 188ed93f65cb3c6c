"""The progress bar of long work (checksumming dump sets), on stderr."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PROGRESS_DELAY_S = 0.5
"""Work shorter than this shows no progress bar."""


@contextmanager
def progress_bar(total: int, description: str, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A callback ``advance(n_bytes)`` (bytes done since the last call) that drives a
    transient progress bar on stderr.

    The bar appears only when ``enabled``, stderr is a terminal and the work is still
    running after ``PROGRESS_DELAY_S``: short work prints nothing.
    """
    if not enabled or total <= 0 or not _may_be_terminal():
        yield lambda done: None
        return
    # rich only for a bar that may show: `-q`, short work and a redirected stderr never
    # import it.
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda done: None
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task(description, total=total)
    lock = threading.Lock()
    shown = closed = False

    def show() -> None:
        nonlocal shown
        with lock:
            if not closed:
                progress.start()
                shown = True

    # A timer, not the first callback, so the bar shows while a long first batch runs.
    timer = threading.Timer(PROGRESS_DELAY_S, show)
    timer.daemon = True
    timer.start()
    try:
        yield lambda n_bytes: progress.advance(task, n_bytes)
    finally:
        timer.cancel()
        with lock:
            closed = True
            if shown:
                progress.stop()


def _may_be_terminal() -> bool:
    """Whether rich could take stderr for a terminal: it is one, or the environment
    forces it (``TTY_COMPATIBLE``, ``FORCE_COLOR``); rich decides the rest."""
    if "TTY_COMPATIBLE" in os.environ or "FORCE_COLOR" in os.environ:
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return isatty is not None and bool(isatty())
    except ValueError:  # a closed stream
        return False
