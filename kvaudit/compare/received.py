"""``verify --received``: a consumer's checksums against the producer totals it received on
the wire, which its dumps carry.

The wire says the producer's token count and position numbering: the consumer's
checksums must cover at most the producer's tokens (its last, partly filled block over
the producer's tokens) under that numbering, and positions the producer held that the
consumer lacks are missing. A consumer request whose bytes never arrived leaves each of
its groups unverified, and a received request the consumer lacks is a failure, as in a
diff. ``verify_received`` compares a record with decoded wires; ``verify_wire`` drives it
from a source.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..core.errors import KvauditError
from ..dumps import DumpSet
from ..records import GroupChecksums, Record, RequestChecksums, WorkerInfo, WorkerSummary
from ..records.wire import WireChecksums, decode_wire
from ..sources import RecordQuery, Runtime, Source
from ..workers import Progress
from .groups import Window
from .model import NO_RECEIVED, DiffReport, GroupComparison
from .records import compare
from .sides import group_windows, trim_to


def decode_received(
    received: Mapping[str, bytes | WireChecksums], source: str
) -> dict[str, WireChecksums]:
    """Each request's received checksums, decoded where given as bytes.

    Raises:
        WireFormatError: Malformed bytes; the message names ``source`` and the request.

    """
    return {
        rid: data
        if isinstance(data, WireChecksums)
        else decode_wire(data, source=f"{source}: request {rid}")
        for rid, data in received.items()
    }


def received_numbering(wires: Mapping[str, WireChecksums], source: str) -> str:
    """The one position numbering the received checksums use (``request`` when none).

    Raises:
        KvauditError: Requests were sent under different numberings.

    """
    found: dict[str, str] = {}
    for rid, wire in wires.items():
        found.setdefault(wire.numbering, rid)
    if len(found) > 1:
        named = ", ".join(f"{rid} by {numbering}" for numbering, rid in found.items())
        raise KvauditError(
            f"the producer numbered positions differently per request ({named}); verify "
            "them apart with --request",
            source,
        )
    return next(iter(found), "request")


def verify_received(
    consumer: Record,
    received: Mapping[str, bytes | WireChecksums],
    *,
    source: str,
    request_ids: Sequence[str] | None = None,
    consumer_tokens: Mapping[str, int] | None = None,
    windows: Mapping[int, Window] | None = None,
    seed_lane_only: bool = False,
) -> DiffReport:
    """The consumer checked against the producer totals it received.

    The totals are given per request as wire bytes or as decoded checksums.
    ``consumer`` must be checksummed under the wire's numbering and over at most the
    producer's tokens of each request (``kvaudit.compare`` does so); ``consumer_tokens``
    are the tokens the consumer holds where that is more (default: the record's own).
    Each group of a consumer request without received checksums is unverified (``"no
    producer checksums received"``); received requests the consumer lacks are listed in
    ``only_in_producer``; ``windows`` as for ``compare_records``.

    Args:
        consumer: The consumer's record.
        received: Per request id, the producer checksums received.
        source: What names the received checksums in errors.
        request_ids: The requests checked; None for every request the consumer holds
            or checksums were received for.
        consumer_tokens: Per request, the tokens the consumer holds where that is more
            than its record covers.
        windows: Per windowed group id, its window.
        seed_lane_only: Compare the seed lane alone, even where the wire (KVC3) and the
            consumer both carry the strong lane.

    Returns:
        The report, with the received checksums as the producer; KVC2 bytes (the seed
        lane alone) are compared by the seed lane, which its ``warnings`` say.

    Raises:
        WireFormatError: Malformed bytes; the message names ``source`` and the request.
        KvauditError: A requested id is on neither side, the requests were sent under
            different numberings, or the consumer's numbering is another.

    """
    wanted = list(consumer.requests) if request_ids is None else list(dict.fromkeys(request_ids))
    if request_ids is None:
        wanted += [rid for rid in received if rid not in consumer.requests]
    wires = decode_received({rid: received[rid] for rid in wanted if rid in received}, source)
    numbering = received_numbering(wires, source) if wires else consumer.positions
    requests: dict[str, RequestChecksums] = {}
    for rid, wire in wires.items():
        groups = {
            group.group_id: GroupChecksums(
                block_size=group.block_size,
                start=group.start,
                replica_keys=[(1, 0)],
                values=group.totals.reshape(-1, 1),
                fingerprint=group.fingerprint,
                strong=None if group.strong is None else group.strong.reshape(-1, 1),
            )
            for group in wire.groups
        }
        requests[rid] = RequestChecksums(int(wire.num_tokens), groups)
    producer = Record(
        positions=numbering,  # type: ignore[arg-type]
        workers=[WorkerSummary(WorkerInfo(source=source))],
        complete=True,
        requests=requests,
    )
    report = compare(
        producer,
        consumer,
        wanted,
        per_key=False,
        producer_absence="the producer sent no checksums for it",
        token_counts=None if consumer_tokens is None else ({}, consumer_tokens),
        windows=windows,
        seed_lane_only=seed_lane_only,
    )
    # The producer record holds exactly the received requests, so every request on the
    # consumer only is one whose checksums never arrived.
    for rid in report.only_in_consumer:
        report.requests[rid] = {
            gid: GroupComparison(unverified=NO_RECEIVED, block_size=group.block_size)
            for gid, group in sorted(consumer.requests[rid].groups.items())
        }
    report.only_in_consumer = []
    return report


def received_wires(
    dump_set: DumpSet, request_ids: Sequence[str] | None = None
) -> dict[str, WireChecksums]:
    """Per request, the producer's wire checksums the set's dumps carry, decoded
    (``carried_wires``)."""
    carriers = [
        (dump.path, {rid: r.received for rid, r in dump.requests.items() if r.received is not None})
        for dump in dump_set.dumps
    ]
    return carried_wires(carriers, request_ids)


def carried_wires(
    carriers: Iterable[tuple[str, Mapping[str, bytes]]], request_ids: Sequence[str] | None
) -> dict[str, WireChecksums]:
    """Per request, the wire bytes that dump files carry (each file's name with its bytes
    per request), decoded; only ``request_ids`` where given.

    Raises:
        KvauditError: Two workers carry different bytes for one request.
        WireFormatError: Malformed bytes; the message names the dump file and the request.

    """
    found: dict[str, tuple[bytes, str]] = {}
    for name, carried in carriers:
        for request_id, data in carried.items():
            if request_ids is not None and request_id not in request_ids:
                continue
            seen = found.get(request_id)
            if seen is None:
                found[request_id] = (data, name)
            elif seen[0] != data:
                raise KvauditError(
                    f"request {request_id!r}: the received checksums differ from those "
                    f"{seen[1]} carries; the workers of one consumer receive the same",
                    name,
                )
    return {
        request_id: decode_wire(data, source=f"{name}: request {request_id!r}: received")
        for request_id, (data, name) in found.items()
    }


def verify_wire(
    source: Source,
    wires: Mapping[str, WireChecksums],
    ids: list[str] | None,
    runtime: Runtime,
    progress: Progress | None,
    *,
    seed_lane_only: bool = False,
) -> DiffReport:
    """The source checked against the producer checksums its dumps carry (per request, as
    ``received_wires`` reads them); ``seed_lane_only`` as for ``verify_received``."""
    name = ", ".join(source.names)
    numbering = received_numbering(wires, name)
    counts = source.token_counts()
    # The consumer's checksums cover only the producer's tokens, as a diff's do.
    sent = {
        rid: min(int(wire.num_tokens), counts[rid]) for rid, wire in wires.items() if rid in counts
    }
    record = trim_to(source, sent).checksum(RecordQuery(runtime, ids, numbering, progress))
    return verify_received(
        record,
        wires,
        source=name,
        request_ids=ids,
        consumer_tokens=counts,
        windows=group_windows(source),
        seed_lane_only=seed_lane_only,
    )
