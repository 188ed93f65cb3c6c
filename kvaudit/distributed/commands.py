"""What the commands do differently under torchrun: join the process group, open
SOURCEs spread over the processes, locate and trace across them, and stamp the JSON with the
number of processes. Only rank 0 writes; the others' stdout and stderr go to /dev/null
(every process's errors reach rank 0, which reports them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from ..compare import DiffReport
from ..compare.checksum_trace import partial_note
from ..description import CacheDescription
from ..diffing import shared_tokens
from ..errors import KvauditError
from ..sources import Source, resolve_device
from .comm import join, leave
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


def open_spread_source(
    names: Sequence[str], config: CacheDescription | None, device: str | None
) -> Source:
    """SOURCE arguments opened by this process's share (joining the process group on
    first use, on this process's GPU when the command computes on CUDA)."""
    comm = join(resolve_device(device or "auto").device == "cuda")
    if comm.place.rank != 0:
        _silence()
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


def finish() -> None:
    """Leave the process group, if this process joined it."""
    leave()
