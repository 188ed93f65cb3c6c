"""``verify_sources``: one source checked one way, against a saved record, the producer
checksums its dumps received, or the stored checksums of its offloaded blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.errors import KvauditError
from ..sources import Runtime, Source
from ..workers import Progress
from .diff import diff_work
from .model import DiffReport
from .options import DEFAULT_OPTIONS, CompareOptions
from .received import received_wires, verify_wire
from .records import verify_against_record
from .sides import (
    check_wanted,
    checksum_held,
    group_windows,
    shared_numbering,
    shared_tokens,
    trim_to,
    unique_ids,
)
from .stored import verify_stored
from .trace import partial_note, trace_by_checksums


def verify_work(
    source: Source, *, against: Source | None = None, request_ids: Sequence[str] | None = None
) -> int:
    """The bytes ``verify_sources`` checksums: the total of its ``progress`` calls.

    It counts 0 where it reads only checksums.

    Args:
        source: What is checked.
        against: The saved record, as for ``verify_sources``.
        request_ids: The requests checked; None for every request.

    Returns:
        The number of bytes.

    Raises:
        KvauditError: Without ``against``, a requested id the source does not hold.

    """
    ids = unique_ids(request_ids)
    if against is not None:
        return diff_work(against, source, ids)
    if ids is not None:
        source.check_request_ids(ids)
    return source.work(ids)


def verify_sources(
    source: Source,
    options: CompareOptions = DEFAULT_OPTIONS,
    *,
    against: Source | None = None,
    received: bool = False,
    stored: bool = False,
) -> DiffReport:
    """One source checked one way (docs/cli.md, verify).

    Args:
        source: What is checked.
        options: As for ``diff_sources``.
        against: A saved record (it plays the producer; every replica key must match
            when the layouts agree).
        received: Check the producer checksums the source's dumps received (over the
            producer's tokens, under its numbering).
        stored: Check the stored checksums of its offloaded blocks.

    Returns:
        The report, as ``diff_sources`` makes it.

    Raises:
        KvauditError: None or several ways given, a requested id the source does not
            hold, ``received``/``stored`` on a source that is not dumps, dumps whose
            workers carry different received checksums for one request, malformed wire
            bytes, or any bad input met while checksumming.

    """
    chosen = [against is not None, received, stored]
    if sum(chosen) != 1:
        raise KvauditError("verify needs exactly one of --against RECORD, --received, --stored")
    ids = unique_ids(options.request_ids)
    report = _verify_one_way(source, against, received, ids, options)
    options.judge(report)
    read = [*(against.warnings if against is not None else []), *source.warnings]
    report.warnings = [*read, *report.warnings]
    if received:
        report.untraced = "no trace possible: the producer sent only its checksums"
    return report


def _verify_one_way(
    source: Source,
    against: Source | None,
    received: bool,
    ids: list[str] | None,
    options: CompareOptions,
) -> DiffReport:
    """``verify_sources`` without its policy: the report of the chosen way."""
    runtime, progress = options.device(), options.progress
    if against is not None:
        return _verify_against(source, against, ids, runtime, progress, options.seed_lane_only)
    if ids is not None:
        source.check_request_ids(ids)
    dump_set = source.carried_checksums()
    if dump_set is None:
        what = "--received" if received else "--stored"
        raise KvauditError(
            f"{what} reads what dumps carry; {', '.join(source.names)} is a {source.kind}"
        )
    if received:
        wires = received_wires(dump_set, ids)
        return verify_wire(
            source, wires, ids, runtime, progress, seed_lane_only=options.seed_lane_only
        )
    return verify_stored(dump_set, request_ids=ids, runtime=runtime, progress=progress)


def _verify_against(
    source: Source,
    saved: Source,
    ids: list[str] | None,
    runtime: Runtime,
    progress: Progress | None,
    seed_lane_only: bool,
) -> DiffReport:
    """``verify --against``: the source's checksums against the saved record's."""
    if ids is not None:
        check_wanted(saved, source, ids, ("the saved record", "the source"))
    counts = source.token_counts()
    windows = group_windows(source)
    current = trim_to(source, shared_tokens(saved, source, ids))
    positions = shared_numbering(saved, current)
    saved_record = checksum_held(saved, ids, positions, runtime, progress)
    current_record = checksum_held(current, ids, positions, runtime, progress)
    report = verify_against_record(
        current_record,
        saved_record,
        request_ids=ids,
        token_counts=counts,
        windows=windows,
        seed_lane_only=seed_lane_only,
    )
    if trace_by_checksums(report, saved_record, current_record):
        report.untraced = partial_note("verify --against compares checksums only")
    return report
