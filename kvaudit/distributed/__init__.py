"""kvaudit under torchrun: the dump files of a command split among processes, worker
records gathered to rank 0, differences located by asking the rank that holds the blocks
(docs/scale.md).

A command asks ``processes()`` (``processes``) how its processes run: one process
(``OneProcess``) or torchrun's (``torchrun.Torchrun``), never which one it runs under.
``spread()`` reads only the environment, so the single-process path never imports torch
(nor does catching ``Settled``); ``torchrun`` (the runtime), ``comm`` (the process group and
byte collectives), ``placement`` (SOURCE rank fields and which process reads which file),
``spread_source`` (the dump set spread over processes), ``locating`` and ``tracing`` (the
differences of a diff located and traced across processes) and ``carried`` (the checksums
dumps carry, read where they are) import it.
"""

from __future__ import annotations

import os

RANK_FIELDS = ("{rank}", "{local_rank}", "{node_rank}")
"""What a SOURCE path may contain, filled in by each process."""


def spread() -> bool:
    """Whether this process is one of several that torchrun started (``WORLD_SIZE > 1``)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def is_writer() -> bool:
    """Whether this process writes the output: rank 0, or the only process."""
    return not spread() or os.environ.get("RANK", "0") == "0"


class Settled(BaseException):
    """Another process ended its command while this one was exchanging with it: every
    process ends now with ``status``, rank 0 printing ``line`` (when not None).

    Not an ``Exception``: nothing that reports an error and carries on may catch it, for
    no further exchange may follow.
    """

    def __init__(self, status: int, line: str | None) -> None:
        super().__init__(status, line)
        self.status = status
        self.line = line


__all__ = ["RANK_FIELDS", "Settled", "is_writer", "spread"]
