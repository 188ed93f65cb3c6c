"""What the commands do differently under torchrun: join the process group and check
that every process runs the same command, open SOURCEs spread over the processes, locate
and trace across them, stamp the JSON with the number of processes, and end every process
with the same exit status. Only rank 0 writes; the others' stdout and stderr go to
/dev/null (every process's errors reach rank 0, which reports them).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..compare import DiffReport, shared_tokens
from ..compare.trace import partial_note
from ..core.errors import KvauditError
from ..core.exit_status import ExitStatus
from ..description import CacheDescription
from ..sources import Source, resolve_device
from .comm import join, joined, leave, tried
from .spread_locate import locate_spread
from .spread_source import SpreadSource, open_spread
from .spread_trace import trace_spread


def _silence() -> None:
    """Point this process's stdout and stderr at /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.dup2(null, sys.stderr.fileno())
    os.close(null)


def begin(command: Sequence[str], debug: bool) -> None:
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


def open_spread_source(
    names: Sequence[str], config: CacheDescription | None, device: str | None
) -> Source:
    """SOURCE arguments opened by this process's share (joining the process group if this
    process has not, on this process's GPU when the command computes on CUDA)."""
    comm = join()
    comm.compute_on(resolve_device(device or "auto").device == "cuda")
    return open_spread(names, config, comm, device_given=device is not None)


def locate_across(
    report: DiffReport,
    producer: Source,
    consumer: Source,
    request_ids: Sequence[str] | None,
    locate: bool | None,
) -> None:
    """Locate the report's differences and trace them to the producer blocks they hold,
    as ``diff --locate`` does in one process, reading blocks from the processes that hold
    them (``locate``: None when both sides are dumps, True required, False never).

    Raises:
        KvauditError: ``locate=True`` with a side that holds only checksums.

    """
    if locate is False:
        return
    if not (isinstance(producer, SpreadSource) and isinstance(consumer, SpreadSource)):
        side = consumer if isinstance(producer, SpreadSource) else producer
        names = ", ".join(side.names)
        if side.raw_kv() is None:
            where = f"{names} is a {side.kind} that holds only checksums, not the KV"
            needs = "the raw KV on both sides"
        else:
            where = (
                f"{names} is a {side.kind} source, which is not spread over torchrun's "
                "processes: run the diff in one process to locate"
            )
            needs = "dumps on both sides under torchrun"
        if locate:
            raise KvauditError(f"--locate needs {needs}; {where}")
        if report.untraced is not None:  # diff_sources traced by checksums, saying why
            report.untraced = partial_note(where)
        return
    shared = shared_tokens(producer, consumer, request_ids)
    consumed = consumer.trimmed(shared)
    locate_spread(report, producer.trimmed(shared), consumed, shared)
    # The bytes decide now, as in one process: the checksums' trace is dropped.
    report.untraced = None
    for _, _, group in report.groups():
        group.stale_sources = {}
    trace_spread(report, producer, consumed, shared)


def stamped(data: dict[str, Any]) -> dict[str, Any]:
    """The JSON of a result with ``"processes"``: how many processes computed it."""
    return {**data, "processes": int(os.environ.get("WORLD_SIZE", "1"))}


def finish(
    command: Sequence[str], debug: bool, status: int, line: str | None
) -> tuple[int, str | None]:
    """End this process's part (``status``, and ``line``, the error line it printed; None:
    none): the status every process ends with, rank 0's when all end together, and what
    more to print (None: nothing). A process whose command ended before it joined joins
    now, so that the others learn how it ended; the process group is left.
    """
    extra = None
    try:
        if not tried():
            try:
                begin(command, debug)
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
