"""The dump-level driver of ``kvaudit diff`` and ``kvaudit verify``: sources in, a
``DiffReport`` out.

``diff_sources`` checksums a producer and a consumer (dump sets, records or live
workers) request by request over the tokens both hold, compares the checksums
(``kvaudit.compare``) and, where both sides hold the raw KV, narrows every differing block
down to layers, heads, tokens and bytes (``kvaudit.locate``). ``verify_sources`` checks one
source against a saved record, against the producer checksums its dumps received, or
against the stored checksums of its offloaded blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .compare import (
    DiffReport,
    StoredCheck,
    compare_records,
    stored_report,
    verify_against_record,
    verify_received,
    verify_stored_blocks,
)
from .compare.numeric import NumericReport
from .compare.received import decode_received, received_numbering
from .dumps import Dump, DumpSet
from .errors import KvauditError
from .locate import locate_differences
from .numeric import numeric_diff
from .pairing import group_windows, side_warnings
from .records import Record
from .sources import Progress, Runtime, Source, checksum_dump_set, resolve_device
from .sources.raw import RawWorker, fetched, fetches
from .trace import trace_report

NO_STORED = "a dump of the set holds no stored checksums"


def _ids(request_ids: Sequence[str] | None) -> list[str] | None:
    """The requested ids, each once (None: all)."""
    return None if request_ids is None else list(dict.fromkeys(request_ids))


def _held(source: Source, request_ids: Sequence[str] | None) -> list[str] | None:
    """The requested ids the source holds (None: all of them)."""
    if request_ids is None:
        return None
    known = set(source.request_ids)
    return [rid for rid in request_ids if rid in known]


def _check_wanted(
    producer: Source,
    consumer: Source,
    request_ids: Sequence[str],
    labels: tuple[str, str] = ("the producer", "the consumer"),
) -> None:
    """Reject a requested id that neither side holds."""
    known = set(producer.request_ids) | set(consumer.request_ids)
    absent = [rid for rid in request_ids if rid not in known]
    if absent:
        raise KvauditError(
            f"request {', '.join(absent)} is on neither {labels[0]} "
            f"({', '.join(producer.names)}) nor {labels[1]} ({', '.join(consumer.names)})"
        )


def _numbering(*sources: Source) -> str:
    """The position numbering to checksum with: one a source is fixed to (a record's),
    else ``request``."""
    fixed = [source.positions for source in sources if source.positions is not None]
    return fixed[0] if fixed else "request"


def shared_tokens(
    producer: Source, consumer: Source, request_ids: Sequence[str] | None = None
) -> dict[str, int]:
    """Per request both sides hold, the tokens both hold: the smaller token count."""
    left, right = producer.token_counts(), consumer.token_counts()
    ids = left if request_ids is None else request_ids
    return {rid: min(left[rid], right[rid]) for rid in ids if rid in left and rid in right}


def _trim(source: Source, num_tokens: Mapping[str, int]) -> Source:
    """The source cut to ``num_tokens`` where it can be checksummed again."""
    counts = source.token_counts()
    if all(counts.get(rid, n) <= n for rid, n in num_tokens.items()):
        return source
    return source.trimmed(num_tokens) or source


def _checksum(
    source: Source,
    request_ids: Sequence[str] | None,
    positions: str,
    runtime: Runtime,
    progress: Progress | None,
) -> Record:
    """The source's record of those requested ids it holds (all when None)."""
    return source.checksum(_held(source, request_ids), positions, runtime, progress)


def diff_work(producer: Source, consumer: Source, request_ids: Sequence[str] | None = None) -> int:
    """The bytes ``diff_sources`` checksums (0 where a side holds only checksums): the
    total of its ``progress`` calls."""
    ids = _ids(request_ids)
    return sum(source.work(_held(source, ids)) for source in (producer, consumer))


def verify_work(
    source: Source, *, against: Source | None = None, request_ids: Sequence[str] | None = None
) -> int:
    """The bytes ``verify_sources`` checksums (0 where it reads only checksums): the
    total of its ``progress`` calls.

    Raises:
        KvauditError: Without ``against``, a requested id the source does not hold.

    """
    ids = _ids(request_ids)
    if against is not None:
        return diff_work(against, source, ids)
    if ids is not None:
        source.check_request_ids(ids)
    return source.work(ids)


def diff_sources(
    producer: Source,
    consumer: Source,
    *,
    request_ids: Sequence[str] | None = None,
    locate: bool | None = None,
    runtime: Runtime | None = None,
    progress: Progress | None = None,
    allow_missing: bool = False,
    allow_empty: bool = False,
) -> DiffReport:
    """The producer compared with the consumer, request by request (docs/cli.md, diff).

    A side that can be checksummed again (dumps, live workers) is checksummed over the
    tokens both sides hold (the smaller token count), so a consumer that decoded further
    is compared up to the last shared token; a record is compared as it is. Positions the
    producer holds that the consumer lacks are missing (accepted with
    ``allow_missing``); a report in which nothing was compared fails unless
    ``allow_empty``. ``locate``: None locates differences when both sides hold the raw
    KV, True requires it, False never locates. Located entries fill each group's
    ``located``; only the differing blocks are read again. The report warns when the
    sides' roles are swapped or both sides are the same files.

    Raises:
        KvauditError: A requested id on neither side, ``locate=True`` with a side that
            holds only checksums, records of different position numberings, or any bad
            input met while checksumming.

    """
    runtime = runtime or resolve_device("auto")
    ids = _ids(request_ids)
    if ids is not None:
        _check_wanted(producer, consumer, ids)
    warnings = side_warnings(producer, consumer)
    counts = (producer.token_counts(), consumer.token_counts())
    windows = group_windows(producer, consumer)
    shared = shared_tokens(producer, consumer, ids)
    untrimmed = producer.raw_kv() if locate is not False else None
    producer = _trim(producer, shared)
    consumer = _trim(consumer, shared)
    raw = _raw_kv(producer, consumer, locate)
    positions = _numbering(producer, consumer)
    left = _checksum(producer, ids, positions, runtime, progress)
    right = _checksum(consumer, ids, positions, runtime, progress)
    report = compare_records(left, right, request_ids=ids, token_counts=counts, windows=windows)
    report.allow_missing, report.allow_empty = allow_missing, allow_empty
    report.warnings = warnings
    if raw is not None:
        locate_report(report, *raw, shared)
        remote = [side for side, workers in zip((producer, consumer), raw) if fetches(workers)]
        if remote:
            report.untraced = (
                f"not traced: {', '.join(remote[0].names)} is a running engine, whose blocks "
                "are fetched only at the differing positions"
            )
        else:
            trace_report(report, untrimmed or raw[0], raw[1], shared)
    else:
        report.untraced = _untraced(producer, consumer, locate)
    return report


def _untraced(producer: Source, consumer: Source, locate: bool | None) -> str:
    """Why differing blocks are not traced to the producer blocks they hold."""
    if locate is False:
        return "not traced (--no-locate)"
    side = producer if producer.raw_kv() is None else consumer
    return (
        f"no trace possible: {', '.join(side.names)} is a {side.kind} that holds only "
        "checksums, not the KV"
    )


def _raw_kv(
    producer: Source, consumer: Source, locate: bool | None
) -> tuple[list[RawWorker], list[RawWorker]] | None:
    """Both sides' raw KV where differences are to be located (``locate``: None when
    both hold it, True always, False never), else None.

    Raises:
        KvauditError: ``locate=True`` with a side that holds only checksums.

    """
    if locate is False:
        return None
    left, right = producer.raw_kv(), consumer.raw_kv()
    if left is not None and right is not None:
        return left, right
    if locate:
        side = producer if left is None else consumer
        raise KvauditError(
            f"--locate needs the raw KV on both sides; {', '.join(side.names)} is a "
            f"{side.kind} that holds only checksums"
        )
    return None


def locate_report(
    report: DiffReport,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
) -> None:
    """Fill each differing group's ``located`` with the layers, heads, tokens and bytes
    that differ at its mismatched positions and replica-differing positions."""
    for request_id, gid, group in report.groups():
        positions = {*group.mismatched_positions, *(p for p, _, _ in group.replica_mismatches)}
        if not positions or request_id not in num_tokens:
            continue
        wanted = (request_id, gid, sorted(positions), group.block_size, num_tokens[request_id])
        group.located = locate_differences(
            fetched(producer, *wanted), fetched(consumer, *wanted), *wanted
        )


def verify_sources(
    source: Source,
    *,
    against: Source | None = None,
    received: bool = False,
    stored: bool = False,
    request_ids: Sequence[str] | None = None,
    runtime: Runtime | None = None,
    progress: Progress | None = None,
    allow_missing: bool = False,
    allow_empty: bool = False,
) -> DiffReport:
    """One source checked one way (docs/cli.md, verify): ``against`` a saved record (it
    plays the producer; every replica key must match when the layouts agree), the
    producer checksums its dumps ``received`` (over the producer's tokens, under its
    numbering), or the ``stored`` checksums of its offloaded blocks. Exactly one of the
    three is given. ``allow_missing`` and ``allow_empty`` as for ``diff_sources``.

    Raises:
        KvauditError: None or several ways given, a requested id the source does not
            hold, ``received``/``stored`` on a source that is not dumps, dumps whose
            workers carry different received checksums for one request, malformed wire
            bytes, or any bad input met while checksumming.

    """
    chosen = [against is not None, received, stored]
    if sum(chosen) != 1:
        raise KvauditError("verify needs exactly one of --against RECORD, --received, --stored")
    runtime = runtime or resolve_device("auto")
    ids = _ids(request_ids)
    report = _verify_one_way(source, against, received, ids, runtime, progress)
    report.allow_missing, report.allow_empty = allow_missing, allow_empty
    if against is not None:
        report.untraced = "no trace possible: verify --against compares checksums only"
    elif received:
        report.untraced = "no trace possible: the producer sent only its checksums"
    return report


def _verify_one_way(
    source: Source,
    against: Source | None,
    received: bool,
    ids: list[str] | None,
    runtime: Runtime,
    progress: Progress | None,
) -> DiffReport:
    """``verify_sources`` without its policy: the report of the chosen way."""
    if against is not None:
        return _verify_against(source, against, ids, runtime, progress)
    if ids is not None:
        source.check_request_ids(ids)
    dump_set = source.carried_checksums()
    if dump_set is None:
        what = "--received" if received else "--stored"
        raise KvauditError(
            f"{what} reads what dumps carry; {', '.join(source.names)} is a {source.kind}"
        )
    if received:
        return verify_wire(source, received_bytes(dump_set, ids), ids, runtime, progress)
    return verify_stored(dump_set, request_ids=ids, runtime=runtime, progress=progress)


def _verify_against(
    source: Source,
    saved: Source,
    ids: list[str] | None,
    runtime: Runtime,
    progress: Progress | None,
) -> DiffReport:
    if ids is not None:
        _check_wanted(saved, source, ids, ("the saved record", "the source"))
    counts = source.token_counts()
    windows = group_windows(source)
    current = _trim(source, shared_tokens(saved, source, ids))
    positions = _numbering(saved, current)
    saved_record = _checksum(saved, ids, positions, runtime, progress)
    current_record = _checksum(current, ids, positions, runtime, progress)
    return verify_against_record(
        current_record, saved_record, request_ids=ids, token_counts=counts, windows=windows
    )


def received_bytes(dump_set: DumpSet, request_ids: Sequence[str] | None = None) -> dict[str, bytes]:
    """Per request, the producer's wire checksums the set's dumps carry.

    Raises:
        KvauditError: Two workers carry different bytes for one request.

    """
    found: dict[str, tuple[bytes, Dump]] = {}
    for dump in dump_set.dumps:
        for request_id, request in dump.requests.items():
            if request.received is None:
                continue
            if request_ids is not None and request_id not in request_ids:
                continue
            seen = found.get(request_id)
            if seen is None:
                found[request_id] = (request.received, dump)
            elif seen[0] != request.received:
                raise KvauditError(
                    f"request {request_id!r}: the received checksums differ from those "
                    f"{seen[1].path} carries; the workers of one consumer receive the same",
                    dump.path,
                )
    return {request_id: data for request_id, (data, _) in found.items()}


def verify_wire(
    source: Source,
    wire_bytes: Mapping[str, bytes],
    ids: list[str] | None,
    runtime: Runtime,
    progress: Progress | None,
) -> DiffReport:
    """The source checked against the producer checksums its dumps carry (``wire_bytes``
    per request, as ``received_bytes`` reads them)."""
    name = ", ".join(source.names)
    wires = decode_received(wire_bytes, name)
    numbering = received_numbering(wires, name)
    counts = source.token_counts()
    # The consumer's checksums cover only the producer's tokens, as a diff's do.
    sent = {
        rid: min(int(wire.num_tokens), counts[rid]) for rid, wire in wires.items() if rid in counts
    }
    record = _trim(source, sent).checksum(ids, numbering, runtime, progress)
    return verify_received(
        record,
        wires,
        source=name,
        request_ids=ids,
        consumer_tokens=counts,
        windows=group_windows(source),
    )


def verify_stored(
    dump_set: DumpSet,
    *,
    request_ids: Sequence[str] | None = None,
    runtime: Runtime | None = None,
    progress: Progress | None = None,
) -> DiffReport:
    """Each dump's stored checksums against its blocks recomputed (checksum.md, "Stored
    checksums of offloaded blocks"): per worker, every listed block with a block hash.

    A dump without stored checksums leaves its requests' groups unverified; a group no
    block of which has a hash is unverified too. Groups a worker cannot checksum are left
    out, as a diff leaves them out.
    """
    runtime = runtime or resolve_device("auto")
    ids = dump_set.request_ids if request_ids is None else request_ids
    checks = [
        check for dump in dump_set.dumps for check in stored_checks(dump, ids, runtime, progress)
    ]
    return stored_report(checks, positions="request")


def stored_checks(
    dump: Dump, request_ids: Sequence[str], runtime: Runtime, progress: Progress | None = None
) -> list[StoredCheck]:
    """One dump's stored-checksum checks of those requests it holds, group by group."""
    held = [rid for rid in request_ids if rid in dump.requests]
    if not held:
        return []
    record = checksum_dump_set(
        DumpSet([dump], True),
        request_ids=held,
        positions="request",
        backend=runtime.backend,
        device=runtime.device,
        progress=progress,
    )
    summary = record.workers[0]
    checks: list[StoredCheck] = []
    for rid in held:
        request = dump.requests[rid]
        for gid in sorted(request.groups):
            if gid in summary.not_covered:
                continue
            checks.append(_stored_check(dump, record, summary.fingerprints[gid], rid, gid))
    return checks


def _stored_check(dump: Dump, record: Record, fingerprint: int, rid: str, gid: int) -> StoredCheck:
    """One worker's check of one request's group."""
    request = dump.requests[rid]
    start, block_ids = request.groups[gid]
    block_size = dump.description.group(gid).block_size
    if dump.stored_checksums is None:
        return StoredCheck(rid, gid, block_size, unverified=NO_STORED)
    hashes = request.block_hashes.get(gid, [])
    count = len(hashes)
    positions = list(range(start, start + count))
    group = record.requests[rid].groups[gid]
    recomputed = group.values[start - group.start : start - group.start + count]
    stored = dump.stored_checksums[[dump.row_of(block_id) for block_id in block_ids[:count]]]
    failed = verify_stored_blocks(rid, gid, positions, recomputed, stored, hashes, fingerprint)
    return StoredCheck(rid, gid, block_size, checked=positions, failed=failed)


def numeric_sources(
    producer: Source,
    consumer: Source,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    request_ids: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> NumericReport:
    """The producer compared with the consumer by value over the tokens both hold
    (docs/numeric.md).

    Raises:
        KvauditError: A requested id on neither side, or a side that holds only checksums.

    """
    ids = _ids(request_ids)
    if ids is not None:
        _check_wanted(producer, consumer, ids)
    shared = shared_tokens(producer, consumer, ids)
    raw = []
    for side in (producer, consumer):
        workers = side.raw_kv()
        if workers is None:
            raise KvauditError(
                f"--numeric needs the raw KV on both sides; {', '.join(side.names)} is a "
                f"{side.kind} that holds only checksums"
            )
        raw.append(workers)
    left, right = raw
    return numeric_diff(
        left, right, shared, atol=atol, rtol=rtol, request_ids=ids, progress=progress
    )


__all__ = [
    "diff_sources",
    "diff_work",
    "locate_report",
    "numeric_sources",
    "received_bytes",
    "shared_tokens",
    "stored_checks",
    "verify_sources",
    "verify_stored",
    "verify_wire",
    "verify_work",
]
