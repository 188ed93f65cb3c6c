"""A command's processes under torchrun: every process joins the process group and checks
that all run the same command, opens its share of the SOURCEs, and ends with the status
they settle on; only rank 0 writes, and the others' stdout and stderr go to /dev/null
(every process's errors reach rank 0, which reports them).

The comparisons run ``kvaudit.compare``'s drivers on the spread sources; the steps that
need every process to take part in each exchange are this runtime's own: locating and
tracing after a diff (``locating``, ``tracing``), and reading the checksums the dumps carry
for ``verify --received`` and ``--stored`` (``carried``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..compare import CompareOptions, DiffReport, diff_sources, verify_sources
from ..core.errors import KvauditError
from ..core.exit_status import ExitStatus
from ..description import CacheDescription
from ..sources import Source, resolve_device
from . import is_writer
from .carried import verify_carried
from .comm import join, joined, leave, tried
from .locating import locate_across
from .spread_source import SpreadSource, open_spread


def _silence() -> None:
    """Point this process's stdout and stderr at /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.dup2(null, sys.stderr.fileno())
    os.close(null)


def _begin(command: Sequence[str], debug: bool) -> None:
    """Join the process group (silencing every process but rank 0) and check that every
    process was given the same ``command`` (its arguments, rank fields unfilled);
    ``debug``: whether a failed collective's line carries the backend's text.

    Raises:
        KvauditError: On every process, when joining failed or the commands differ.

    """
    comm = join(debug)
    if comm.place.rank != 0:
        _silence()
    digest = hashlib.sha256(json.dumps(list(command)).encode()).hexdigest()
    digests = comm.outcomes(lambda: digest)
    for rank, other in enumerate(digests):
        if other != digests[0]:
            raise KvauditError(
                f"rank {rank} was given another command than rank 0: every process must run "
                "the same kvaudit command"
            )


class Torchrun:
    """The ``Processes`` of a command that torchrun started in several processes
    (``WORLD_SIZE > 1``; docs/scale.md)."""

    @property
    def writes(self) -> bool:
        """Rank 0 writes; the others only compute."""
        return is_writer()

    def begin(self, command: Sequence[str], debug: bool) -> None:
        """Join the process group and check that every process runs ``command``.

        Raises:
            KvauditError: On every process, when joining failed or the commands differ.

        """
        _begin(command, debug)

    def finish(
        self, command: Sequence[str], debug: bool, status: int, line: str | None
    ) -> tuple[int, str | None]:
        """End this process's part (``status``, and ``line``, the error line it printed;
        None: none): the status every process ends with, rank 0's when all end together,
        and what more to print (None: nothing). A process whose command ended before it
        joined joins now, so that the others learn how it ended; the process group is left.
        """
        extra = None
        try:
            if not tried():
                try:
                    _begin(command, debug)
                except KvauditError as error:
                    status = ExitStatus.BAD_INPUT
                    line = extra = f"kvaudit: error: {error}"
            comm = joined()
            if comm is None:
                return status, extra
            status, more = comm.settle(status, line)
            return status, more or extra
        finally:
            leave()

    def leave(self) -> None:
        """Leave the process group, if this process joined it."""
        leave()

    def open_sources(
        self, names: Sequence[str], config: CacheDescription | None, device: str | None
    ) -> Source:
        """SOURCE arguments opened by this process's share (joining the process group if
        this process has not, on this process's GPU when the command computes on CUDA)."""
        comm = join()
        comm.compute_on(resolve_device(device or "auto").device == "cuda")
        return open_spread(names, config, comm, device_given=device is not None)

    def stamp(self, data: dict[str, Any]) -> dict[str, Any]:
        """The JSON of a result with ``"processes"``: how many processes computed it."""
        return {**data, "processes": int(os.environ.get("WORLD_SIZE", "1"))}

    def diff(
        self,
        producer: Source,
        consumer: Source,
        options: CompareOptions,
        locate: bool | None,
    ) -> DiffReport:
        """``diff_sources`` of the spread sides, whose raw KV no process holds whole: the
        blocks are then located and traced across the processes (``locate_across``), every
        process taking part in each exchange."""
        report = diff_sources(producer, consumer, options, locate=False)
        locate_across(report, producer, consumer, options.request_ids, locate)
        return report

    def verify(
        self,
        source: Source,
        options: CompareOptions,
        *,
        against: Source | None,
        received: bool,
        stored: bool,
    ) -> DiffReport:
        """``verify_sources``, except that the checksums spread dumps carry (``received``,
        ``stored``) are read where the dumps are (``verify_carried``)."""
        if against is None and isinstance(source, SpreadSource) and received != stored:
            return verify_carried(source, options, stored=stored)
        return verify_sources(source, options, against=against, received=received, stored=stored)


TORCHRUN = Torchrun()
"""The runtime of every command under torchrun (its state is the process group's)."""


__all__ = ["TORCHRUN", "Torchrun"]
