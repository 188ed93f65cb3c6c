"""A consumer's checksums against the producer totals it received on the wire
(``verify --received``).

The consumer's token count and position numbering serve both sides. A consumer request
whose bytes never arrived leaves each of its groups unverified, and a received request
the consumer lacks is a failure, as in a diff.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..records import GroupChecksums, Record, RequestChecksums, WorkerInfo, WorkerSummary
from ..wire import decode_wire
from .model import NO_RECEIVED, DiffReport, GroupComparison
from .record_diff import compare


def verify_received(
    consumer: Record,
    received: Mapping[str, bytes],
    *,
    source: str,
    request_ids: Sequence[str] | None = None,
) -> DiffReport:
    """The consumer checked against the producer totals it received (wire bytes per request).

    The consumer's token count and position numbering are used for both sides (the
    wire's ``num_tokens`` and ``numbering`` are decoded, and not applied here). Each group
    of a consumer request without received bytes is unverified (``"no producer checksums
    received"``); received requests the consumer lacks are listed in ``only_in_producer``.

    Raises:
        WireFormatError: Malformed bytes; the message names ``source`` and the request.
        KvauditError: A requested id is on neither side.

    """
    wanted = list(consumer.requests) if request_ids is None else list(dict.fromkeys(request_ids))
    if request_ids is None:
        wanted += [rid for rid in received if rid not in consumer.requests]
    requests: dict[str, RequestChecksums] = {}
    for rid in wanted:
        if rid not in received:
            continue
        num_tokens = consumer.requests[rid].num_tokens if rid in consumer.requests else 0
        groups = {
            wire.group_id: GroupChecksums(
                block_size=wire.block_size,
                start=wire.start,
                replica_keys=[(1, 0)],
                values=wire.totals.reshape(-1, 1),
                fingerprint=wire.fingerprint,
            )
            for wire in decode_wire(received[rid], source=f"{source}: request {rid}").groups
        }
        requests[rid] = RequestChecksums(num_tokens, groups)
    producer = Record(
        positions=consumer.positions,
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
