"""A record compared with a record: a producer with a consumer (``diff``), or a dump set's
checksums with a saved record (``verify --against``).

Per request present on both sides and per group either side holds:

- Both records must number positions the same way (``request`` or ``block``), else
  ``KvauditError``.
- A group is unverified when a worker of either side is missing or only one side holds
  it; otherwise it is compared by the rules of ``kvaudit.compare.groups``. A group that
  neither side checksums is unverified in every request when a worker leaves it out for a
  reason other than its description's (``transfer: false``, ``host_resident: true``):
  KV that moves went unchecked. A group the consumer's workers checksum but hold no
  block of for a request has every expected position missing.
- A request only the producer has is a failure (the consumer never got it); a request
  only the consumer has is informational (it may have been computed locally).
- A layer whose K or V scale (a quantized cache's) differs between the sides' layer
  facts is a mismatch of the whole report (``scale_differences``), whatever the
  checksums say: they are over the stored bytes, which equal scales do not change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..core.errors import KvauditError
from ..description import LEFT_OUT_BY_DESCRIPTION
from ..records import GroupChecksums, Record
from ..records.layers import fingerprint_difference, scale_differences
from .groups import (
    SideChecksums,
    Window,
    compare_sides,
    held_positions,
    layer_differences,
    missing_and_expected,
)
from .model import DiffReport, GroupComparison, seed_lane_notes

TokenCounts = Mapping[str, int]
"""Request id to the token count a side holds (where its checksums cover fewer)."""


def _missing_reason(label: str, record: Record) -> str | None:
    """Why a side's checksums are partial, or None when all its workers are present."""
    if record.complete:
        return None
    if not record.missing_workers:
        return f"a worker is missing on the {label}"
    ranks = "; ".join(f"pp {pp}, tp {tp}" for pp, tp in record.missing_workers)
    if len(record.missing_workers) == 1:
        return f"a worker is missing on the {label} ({ranks})"
    return f"workers are missing on the {label} ({ranks})"


def _not_covered_reason(record: Record, gid: int) -> str | None:
    """The reasons the record's workers give for not covering a group, if any."""
    reasons = dict.fromkeys(
        summary.not_covered[gid] for summary in record.workers if gid in summary.not_covered
    )
    return "; ".join(reasons) if reasons else None


def _unchecked_groups(producer: Record, consumer: Record) -> dict[int, str]:
    """The groups neither side checksums although they should be, with why: a worker of
    either side leaves the group out for a reason other than its description's, and no
    worker leaves it out by its description."""
    given: dict[int, set[str]] = {}
    for record in (producer, consumer):
        for summary in record.workers:
            for gid, reason in summary.not_covered.items():
                given.setdefault(gid, set()).add(reason)
    result: dict[int, str] = {}
    for gid in sorted(given):
        covered = any(
            gid in summary.fingerprints and gid not in summary.not_covered
            for record in (producer, consumer)
            for summary in record.workers
        )
        if covered or given[gid] & LEFT_OUT_BY_DESCRIPTION:
            continue
        said = "; ".join(
            f"{label}: {reason}"
            for label, record in (("producer", producer), ("consumer", consumer))
            if (reason := _not_covered_reason(record, gid)) is not None
        )
        result[gid] = f"not covered on either side ({said})"
    return result


def _covered_on_one_side(lacking: str, record: Record, gid: int, absence: str | None) -> str:
    """Why a group the ``lacking`` side (``record``) does not hold is unverified: its
    workers' reason for not covering the group, else ``absence`` (by default, that it
    holds no block of it)."""
    holder = "producer" if lacking == "consumer" else "consumer"
    known = _not_covered_reason(record, gid)
    if known is not None:
        reason = f"{lacking}: {known}"
    elif absence is not None:
        reason = absence
    else:
        reason = f"the {lacking} holds no block of it for this request"
    return f"covered on the {holder} only ({reason})"


def _first_source(record: Record) -> str:
    """`` (source)`` of the record's first worker that names one, for a message."""
    sources = [summary.worker.source for summary in record.workers if summary.worker.source]
    return f" ({sources[0]})" if sources else ""


def _check_numbering(producer: Record, consumer: Record) -> None:
    """Raise ``KvauditError`` unless both records number positions the same way."""
    if producer.positions != consumer.positions:
        raise KvauditError(
            f"positions are numbered by {producer.positions} on the producer"
            f"{_first_source(producer)} and by {consumer.positions} on the consumer"
            f"{_first_source(consumer)}: records of different numberings are never compared"
        )


def _select(
    producer: Record, consumer: Record, request_ids: Sequence[str] | None
) -> tuple[list[str], list[str], list[str]]:
    """The requests on both sides, on the producer only and on the consumer only."""
    if request_ids is None:
        wanted = list(dict.fromkeys([*producer.requests, *consumer.requests]))
    else:
        wanted = list(dict.fromkeys(request_ids))
        absent = [
            rid for rid in wanted if rid not in producer.requests and rid not in consumer.requests
        ]
        if absent:
            raise KvauditError(
                f"request {', '.join(absent)} is on neither the producer nor the consumer"
            )
    both = [rid for rid in wanted if rid in producer.requests and rid in consumer.requests]
    only_producer = [rid for rid in wanted if rid not in consumer.requests]
    only_consumer = [rid for rid in wanted if rid not in producer.requests]
    return both, only_producer, only_consumer


def _checksums_group(record: Record, gid: int) -> bool:
    """Whether the record's workers checksum the group (give it a fingerprint)."""
    return any(gid in summary.fingerprints for summary in record.workers)


def _none_held(
    producer: SideChecksums, consumer_tokens: int, window: Window | None
) -> GroupComparison:
    """A group the consumer checksums but holds no block of: every expected position of
    the producer is missing."""
    empty = GroupChecksums(producer.block_size, 0, [(1, 0)], np.zeros((0, 1), np.uint64), 0)
    consumer = SideChecksums.of(empty, min(consumer_tokens, producer.num_tokens), consumer_tokens)
    missing, _ = missing_and_expected(producer, consumer, producer.block_size, window)
    return GroupComparison(
        block_size=producer.block_size,
        missing_positions=missing,
        held=(len(held_positions(producer, producer.block_size)), 0),
    )


def _compare_request(
    producer: Record,
    consumer: Record,
    request_id: str,
    *,
    missing: str | None,
    per_key: bool,
    producer_absence: str | None,
    tokens: tuple[int, int],
    windows: Mapping[int, Window],
    unchecked: Mapping[int, str],
    seed_lane_only: bool = False,
) -> dict[int, GroupComparison]:
    """Each group of one request present on both sides; ``missing`` says which side's
    workers are missing, if any; ``tokens`` the request's token count on each side;
    ``unchecked`` the groups neither side checksums although they should be."""
    produced = producer.requests[request_id]
    consumed = consumer.requests[request_id]
    result: dict[int, GroupComparison] = {}
    for gid in sorted({*produced.groups, *consumed.groups, *unchecked}):
        if gid in unchecked and gid not in produced.groups and gid not in consumed.groups:
            result[gid] = GroupComparison(unverified=unchecked[gid])
            continue
        left, right = produced.groups.get(gid), consumed.groups.get(gid)
        partial = "; ".join(
            f"the {label}'s checksums are partial sums ({group.partial})"
            for label, group in (("producer", left), ("consumer", right))
            if group is not None and group.partial is not None
        )
        whole = missing is None and not partial  # every worker's part is in both sums
        if whole and left is not None and right is not None:
            compared = compare_sides(
                SideChecksums.of(left, produced.num_tokens, tokens[0]),
                SideChecksums.of(right, consumed.num_tokens, tokens[1]),
                consumer.positions,
                per_key=per_key,
                window=windows.get(gid),
                differing=(
                    fingerprint_difference(producer, consumer, gid)
                    if left.fingerprint != right.fingerprint
                    else None
                ),
                seed_lane_only=seed_lane_only,
            )
            compared.layer_differences = layer_differences(
                left,
                right,
                (produced.num_tokens, consumed.num_tokens),
                compared.mismatched_positions,
            )
            result[gid] = compared
            continue
        consumer_holds_none = (
            right is None
            and _checksums_group(consumer, gid)
            and _not_covered_reason(consumer, gid) is None
        )
        if whole and left is not None and consumer_holds_none:
            side = SideChecksums.of(left, produced.num_tokens, tokens[0])
            result[gid] = _none_held(side, tokens[1], windows.get(gid))
            continue
        if missing is not None:
            reason = missing
        elif partial:
            reason = partial
        elif left is None:
            reason = _covered_on_one_side("producer", producer, gid, producer_absence)
        else:
            reason = _covered_on_one_side("consumer", consumer, gid, None)
        block_size = max(group.block_size for group in (left, right) if group is not None)
        result[gid] = GroupComparison(unverified=reason, block_size=block_size)
    return result


def compare(
    producer: Record,
    consumer: Record,
    request_ids: Sequence[str] | None,
    *,
    per_key: bool,
    producer_absence: str | None = None,
    token_counts: tuple[TokenCounts, TokenCounts] | None = None,
    windows: Mapping[int, Window] | None = None,
    seed_lane_only: bool = False,
) -> DiffReport:
    """Two records compared by the module's rules; ``per_key`` compares every column
    where the replica keys agree, and ``producer_absence`` replaces the reason given for
    a group only the consumer holds when the producer's workers give none.
    ``token_counts`` are the token counts each side holds where its record covers fewer
    (default: the records' own), ``windows`` each windowed group's window (an
    ``AttentionWindow``, or a sliding window's size in tokens); ``seed_lane_only``
    compares the seed lane alone. The report's ``warnings`` say where groups were
    compared by the seed lane alone, and why."""
    _check_numbering(producer, consumer)
    both, only_producer, only_consumer = _select(producer, consumer, request_ids)
    reasons = [
        reason
        for reason in (_missing_reason("producer", producer), _missing_reason("consumer", consumer))
        if reason is not None
    ]
    missing = "; ".join(reasons) if reasons else None
    counts = _token_counts(producer, consumer, token_counts)
    unchecked = _unchecked_groups(producer, consumer)
    requests = {
        rid: _compare_request(
            producer,
            consumer,
            rid,
            missing=missing,
            per_key=per_key,
            producer_absence=producer_absence,
            tokens=(counts[rid][0] or 0, counts[rid][1] or 0),
            windows=windows or {},
            unchecked=unchecked,
            seed_lane_only=seed_lane_only,
        )
        for rid in both
    }
    wanted = [*both, *only_producer, *only_consumer]
    report = DiffReport(
        consumer.positions,
        requests,
        only_producer,
        only_consumer,
        num_tokens={rid: counts[rid] for rid in wanted},
        scale_differences=scale_differences(producer, consumer),
    )
    report.warnings = seed_lane_notes(report)
    return report


def _token_counts(
    producer: Record, consumer: Record, given: tuple[TokenCounts, TokenCounts] | None
) -> dict[str, tuple[int | None, int | None]]:
    """Each request's token count on each side (None where the side lacks it): the
    given counts where there are, else the record's own."""
    result: dict[str, tuple[int | None, int | None]] = {}
    for rid in dict.fromkeys([*producer.requests, *consumer.requests]):
        pair: list[int | None] = []
        for k, record in enumerate((producer, consumer)):
            count = None if given is None else given[k].get(rid)
            if count is None and rid in record.requests:
                count = record.requests[rid].num_tokens
            pair.append(count)
        result[rid] = (pair[0], pair[1])
    return result


def compare_records(
    producer: Record,
    consumer: Record,
    *,
    request_ids: Sequence[str] | None = None,
    token_counts: tuple[TokenCounts, TokenCounts] | None = None,
    windows: Mapping[int, Window] | None = None,
    seed_lane_only: bool = False,
) -> DiffReport:
    """The producer's totals compared with the consumer's totals and replicas.

    With ``request_ids``, only those requests (in that order); others in record order.
    ``token_counts``: the tokens each side holds where its record was checksummed over
    fewer (a diff compares over the tokens both hold); ``windows``: the window of each
    windowed group (``AttentionWindow``: sliding-window or chunked local attention; an
    int is a sliding window's size in tokens).

    Args:
        producer: The producer's record.
        consumer: The consumer's record.
        request_ids: The requests compared; None for every request either side holds.
        token_counts: Per side (producer, consumer), the tokens it holds per request
            where that is more than its record covers.
        windows: Per windowed group id, its window.
        seed_lane_only: Compare the seed lane alone (records of the seed engine), not
            both lanes where both sides carry the strong lane (docs/checksum.md).

    Returns:
        The report: per request and group, what was compared and what differs (a
        position differs when either lane does); its ``warnings`` say where groups
        were compared by the seed lane alone.

    Raises:
        KvauditError: The records number positions differently, or a requested id is on
            neither side.

    """
    return compare(
        producer,
        consumer,
        request_ids,
        per_key=False,
        token_counts=token_counts,
        windows=windows,
        seed_lane_only=seed_lane_only,
    )


def verify_against_record(
    current: Record,
    saved: Record,
    *,
    request_ids: Sequence[str] | None = None,
    token_counts: TokenCounts | None = None,
    windows: Mapping[int, Window] | None = None,
    seed_lane_only: bool = False,
) -> DiffReport:
    """A regression check: ``saved`` plays the producer, ``current`` the consumer.

    Besides the totals and the current replicas, when both sides have the same replica
    keys (the same engine layout) every column must equal the saved one: a differing
    replica-0 column marks the position mismatched, another column lists it under
    ``replicas_differing``. ``token_counts``: the tokens ``current`` holds where it was
    checksummed over fewer.

    Args:
        current: The record checked (it plays the consumer).
        saved: The saved record (it plays the producer).
        request_ids: The requests compared; None for every request either side holds.
        token_counts: Per request, the tokens ``current`` holds where that is more than
            its record covers.
        windows: Per windowed group id, its window, as for ``compare_records``.
        seed_lane_only: Compare the seed lane alone, as for ``compare_records``.

    Returns:
        The report, with ``saved`` as the producer.

    Raises:
        KvauditError: The records number positions differently, or a requested id is on
            neither side.

    """
    counts = None if token_counts is None else ({}, token_counts)
    return compare(
        saved,
        current,
        request_ids,
        per_key=True,
        token_counts=counts,
        windows=windows,
        seed_lane_only=seed_lane_only,
    )
