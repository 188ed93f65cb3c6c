"""The torchrun runtime's reading of the checksums that spread dumps carry, for ``verify
--received`` and ``--stored``: the received wire bytes every process learned of each dump,
the stored checksums checked by the process that holds each dump and gathered.

A step of its own: ``verify_sources`` reads these from a ``DumpSet`` in this process,
while here each process holds only its share of the dumps."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..compare import (
    DiffReport,
    StoredCheck,
    carried_wires,
    stored_checks,
    stored_report,
    verify_wire,
)
from ..compare.options import CompareOptions
from ..records.wire import WireChecksums
from ..sources import Runtime
from ..workers import Progress
from .spread_source import SpreadSource


def received_wires(
    source: SpreadSource, request_ids: Sequence[str] | None
) -> dict[str, WireChecksums]:
    """Per request, the producer's wire checksums the spread dumps carry, decoded
    (``carried_wires``)."""
    return carried_wires(((item.name, item.received) for item in source.held), request_ids)


def spread_stored(
    source: SpreadSource,
    request_ids: Sequence[str] | None,
    runtime: Runtime,
    progress: Progress | None,
) -> DiffReport:
    """Each process checks the stored checksums of its own dumps; the checks, gathered,
    make the report one process makes."""
    ids = source.request_ids if request_ids is None else list(request_ids)

    def own() -> dict[str, list[dict]]:
        return {
            dump.path: [dataclasses.asdict(c) for c in stored_checks(dump, ids, runtime, progress)]
            for dump in source.local.values()
        }

    checked: dict[str, list[dict]] = {}
    for part in source.comm.outcomes(own):
        checked.update(part)
    checks = [StoredCheck(**data) for item in source.held for data in checked[item.name]]
    return stored_report(checks, positions="request")


def verify_carried(source: SpreadSource, options: CompareOptions, *, stored: bool) -> DiffReport:
    """``verify --received`` (``stored`` False) or ``--stored`` of a source spread among
    processes, every process calling it: what ``kvaudit.compare.verify_sources`` reads of
    the dumps (the received wire bytes, the stored checksums against the blocks) is read
    where the dumps are, and what it computes from them as in one process.

    Raises:
        KvauditError: On every process, a requested id the source does not hold, or bad
            carried checksums on any process.

    """
    runtime, progress = options.device(), options.progress
    ids = None if options.request_ids is None else list(dict.fromkeys(options.request_ids))
    if ids is not None:
        source.check_request_ids(ids)
    if stored:
        report = spread_stored(source, ids, runtime, progress)
    else:
        wires = received_wires(source, ids)
        report = verify_wire(
            source, wires, ids, runtime, progress, seed_lane_only=options.seed_lane_only
        )
        report.untraced = "no trace possible: the producer sent only its checksums"
    options.judge(report)
    return report
