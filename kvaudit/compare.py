"""Comparing checksums: a producer with a consumer, a dump set with a saved record or
with the producer totals it received, and offloaded blocks with their stored checksums.

All comparisons produce a ``DiffReport`` (``diff --format json``, docs/cli.md): per request
and group, the block positions compared, those whose totals differ, the replicas that
disagree, and the reason a group could not be compared at all.

Rules, per request present on both sides and per group either side holds:

- Both records must number positions the same way (``request`` or ``block``), else
  ``KvauditError``.
- A group is unverified when a worker of either side is missing, when only one side holds
  it, when the fingerprints differ, or when the block sizes cannot be brought to one size.
- Different block sizes are compared at the coarser one: the finer side's totals are summed
  (mod 2**64) into coarse blocks. A coarse block is formed only when every fine position of
  it that has valid tokens is held; fine positions past ``num_tokens`` contribute nothing by
  definition and may be absent. With ``block`` numbering checksums do not add up across
  block sizes, so differing sizes leave the group unverified.
- A position is compared only when both sides hold it and both give it the same, non-zero,
  number of valid tokens (each side with its own ``num_tokens``). No such position leaves
  the group unverified ("no common block ...").
- The producer contributes its totals (the sums of its replica index 0 columns); a compared
  position whose consumer total differs is listed in ``mismatched_positions``.
- In a group that is compared, each consumer replica column ``(R, r)`` must equal its
  ``(R, 0)`` column (0 where the consumer has none) at every position the consumer holds.
  That check runs at the consumer's own block size; each difference adds ``(position, R,
  r)`` to ``replica_mismatches``, the position in the compared (coarser) numbering, and
  ``replicas_differing`` lists the keys ``(R, r)`` that differ.
- ``verify_against_record`` also compares column by column when both sides have the same
  replica keys: a differing replica-0 column lists the position as mismatched, another
  column adds it to ``replica_mismatches``.
- A request only the producer has is a failure (the consumer never got it); a request only
  the consumer has is informational (it may have been computed locally), except for
  ``verify_received``, which leaves each of its groups unverified.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import KvauditError
from .fingerprint import block_checksum_tags
from .junit import diff_junit
from .records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerSummary,
    replica_zero_totals,
)
from .scheme import ReplicaKey, to_hex, valid_tokens
from .wire import decode_wire

DIFF_FORMAT = "kvaudit.diff/1"
NO_RECEIVED = "no producer checksums received"


@dataclass
class GroupComparison:
    """The comparison of one request's group.

    ``compared`` counts the positions compared, ``mismatched_positions`` lists those whose
    totals differ and ``replica_mismatches`` each ``(position, R, r)`` where consumer
    replica ``(R, r)`` differs; positions are numbered at ``block_size``, the coarser of
    the two sides'. ``unverified`` is why the group could not be compared (None when it
    was). ``located`` is filled by the locate step and reported as given.
    """

    compared: int = 0
    mismatched_positions: list[int] = field(default_factory=list)
    replica_mismatches: list[tuple[int, int, int]] = field(default_factory=list)
    unverified: str | None = None
    located: list[dict] = field(default_factory=list)
    block_size: int = 0

    @property
    def replicas_differing(self) -> list[ReplicaKey]:
        """The replica keys ``(R, r)`` that differ somewhere, sorted."""
        return sorted({(replicas, index) for _, replicas, index in self.replica_mismatches})

    @property
    def differs(self) -> bool:
        """Whether a compared block or a consumer replica differs."""
        return bool(self.mismatched_positions or self.replica_mismatches)

    @property
    def ok(self) -> bool:
        """Whether every compared block matched, no replica differed and it was compared."""
        return not self.differs and self.unverified is None

    def to_json(self) -> dict:
        """The group's entry of a diff report."""
        return {
            "compared": int(self.compared),
            "mismatched_positions": [int(position) for position in self.mismatched_positions],
            "replicas_differing": [
                [int(replicas), int(index)] for replicas, index in self.replicas_differing
            ],
            "unverified": self.unverified,
            "located": [
                {key: _finite(value) for key, value in item.items()} for item in self.located
            ],
        }


def _finite(value: object) -> object:
    """A located entry's value for strict JSON: an infinite or NaN error becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass
class DiffReport:
    """What a ``diff`` or ``verify`` found: per request and group, a ``GroupComparison``.

    ``only_in_producer`` lists requests the consumer lacks (a failure);
    ``only_in_consumer`` lists requests the producer lacks (informational).
    """

    positions: str
    requests: dict[str, dict[int, GroupComparison]] = field(default_factory=dict)
    only_in_producer: list[str] = field(default_factory=list)
    only_in_consumer: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True exactly when the exit status is 0: every compared block matched, nothing
        was left unverified and the consumer has every producer request."""
        return not self.only_in_producer and all(group.ok for _, _, group in self.groups())

    def groups(self) -> Iterator[tuple[str, int, GroupComparison]]:
        """Each ``(request id, group id, comparison)``, groups in id order."""
        for request_id, groups in self.requests.items():
            for gid in sorted(groups):
                yield request_id, gid, groups[gid]

    def to_json(self) -> dict:
        """The report as ``diff --format json`` writes it (docs/cli.md)."""
        return {
            "format": DIFF_FORMAT,
            "ok": self.ok,
            "positions": self.positions,
            "requests": {
                request_id: {"groups": {str(gid): groups[gid].to_json() for gid in sorted(groups)}}
                for request_id, groups in self.requests.items()
            },
            "only_in_producer": list(self.only_in_producer),
            "only_in_consumer": list(self.only_in_consumer),
        }

    def to_junit(self, suite_name: str = "kvaudit.diff") -> str:
        """The report as JUnit XML: one test case per request and group (docs/cli.md)."""
        return diff_junit(self, suite_name)


# One side of one group, as the comparison sees it.


@dataclass
class _Side:
    """One side's checksums of one request's group: ``columns[i, k]`` is position
    ``start + i`` under ``keys[k]``."""

    block_size: int
    start: int
    num_tokens: int
    fingerprint: int
    columns: np.ndarray
    keys: list[ReplicaKey]

    @classmethod
    def of(cls, group: GroupChecksums, num_tokens: int) -> _Side:
        """A record's group, for a request of ``num_tokens`` tokens."""
        keys = [(int(r), int(i)) for r, i in group.replica_keys]
        columns = np.asarray(group.values, dtype=np.uint64).reshape(group.count, len(keys))
        return cls(group.block_size, group.start, num_tokens, group.fingerprint, columns, keys)

    @functools.cached_property
    def column_of(self) -> dict[ReplicaKey, int]:
        """The column of each replica key."""
        return {key: k for k, key in enumerate(self.keys)}


def _coarsen(side: _Side, coarse: int) -> tuple[np.ndarray, np.ndarray]:
    """The coarse positions the side can form and their columns summed mod 2**64.

    A coarse block is formed when each of its fine positions is held or has no valid token
    (a position past ``num_tokens`` contributes nothing, whether held or not).
    """
    ratio = coarse // side.block_size
    count, width = side.columns.shape
    if count == 0:
        return np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.uint64)
    if ratio == 1:
        return np.arange(side.start, side.start + count, dtype=np.int64), side.columns
    first = side.start // ratio
    last = (side.start + count - 1) // ratio
    blocks = last - first + 1
    offset = side.start - first * ratio
    padded = np.zeros((blocks * ratio, width), dtype=np.uint64)
    padded[offset : offset + count] = side.columns
    held = np.zeros(blocks * ratio, dtype=bool)
    held[offset : offset + count] = True
    fine = np.arange(first * ratio, (last + 1) * ratio, dtype=np.int64)
    empty = valid_tokens(side.num_tokens, side.block_size, fine) == 0
    formed = (held | empty).reshape(blocks, ratio).all(axis=1)
    # uint64 addition wraps modulo 2**64, as block-size additivity requires.
    sums = padded.reshape(blocks, ratio, width).sum(axis=1, dtype=np.uint64)
    positions = np.arange(first, last + 1, dtype=np.int64)
    return positions[formed], sums[formed]


def _replica_differences(side: _Side, coarse: int) -> set[tuple[int, int, int]]:
    """``(coarse position, R, r)`` wherever a column ``(R, r)``, ``r > 0``, differs from
    ``(R, 0)`` (from 0 where the side has no such column), checked at the side's own
    block size."""
    found: set[tuple[int, int, int]] = set()
    for k, (replicas, index) in enumerate(side.keys):
        if index == 0:
            continue
        base = side.column_of.get((replicas, 0))
        reference = side.columns[:, base] if base is not None else np.uint64(0)
        for row in np.flatnonzero(side.columns[:, k] != reference).tolist():
            found.add(((side.start + row) * side.block_size // coarse, replicas, index))
    return found


def _span(positions: np.ndarray) -> str:
    """Positions as ``first-last`` (or ``none``) for a message."""
    if positions.size == 0:
        return "none"
    first, last = int(positions.min()), int(positions.max())
    return str(first) if first == last else f"{first}-{last}"


def _incomparable(producer: _Side, consumer: _Side, numbering: str) -> str | None:
    """Why the two sides cannot be compared position by position (their fingerprints or
    block sizes), or None."""
    if producer.fingerprint != consumer.fingerprint:
        return (
            f"fingerprints differ (producer {to_hex(producer.fingerprint)}, consumer "
            f"{to_hex(consumer.fingerprint)}): the layers, specs or dtypes differ"
        )
    fine, coarse = sorted((producer.block_size, consumer.block_size))
    if fine == coarse:
        return None
    sizes = f"producer {producer.block_size}, consumer {consumer.block_size}"
    if fine <= 0 or coarse % fine:
        return f"block sizes differ and neither divides the other ({sizes})"
    if numbering == "block":
        return (
            f"block sizes differ ({sizes}) and positions are numbered per block: "
            "the checksums do not add up across block sizes"
        )
    return None


def _compare_sides(
    producer: _Side, consumer: _Side, numbering: str, *, per_key: bool
) -> GroupComparison:
    """One group compared once both sides are known to hold it and to be complete."""
    coarse = max(producer.block_size, consumer.block_size)
    reason = _incomparable(producer, consumer, numbering)
    if reason is not None:
        return GroupComparison(unverified=reason, block_size=coarse)

    producer_positions, producer_columns = _coarsen(producer, coarse)
    consumer_positions, consumer_columns = _coarsen(consumer, coarse)
    common, in_producer, in_consumer = np.intersect1d(
        producer_positions, consumer_positions, assume_unique=True, return_indices=True
    )
    producer_valid = valid_tokens(producer.num_tokens, coarse, common)
    consumer_valid = valid_tokens(consumer.num_tokens, coarse, common)
    usable = (producer_valid == consumer_valid) & (producer_valid > 0)
    positions = common[usable]
    left = producer_columns[in_producer[usable]]
    right = consumer_columns[in_consumer[usable]]

    totals_differ = replica_zero_totals(left, producer.keys) != replica_zero_totals(
        right, consumer.keys
    )
    mismatched = set(positions[totals_differ].tolist())
    replicas = _replica_differences(consumer, coarse)
    if per_key and set(producer.keys) == set(consumer.keys):
        # Same engine layout: every column must match the saved one, not only the totals.
        for k, key in enumerate(producer.keys):
            differing = positions[left[:, k] != right[:, consumer.column_of[key]]].tolist()
            if key[1] == 0:
                mismatched.update(differing)
            else:
                replicas.update((position, *key) for position in differing)

    unverified = None
    if positions.size == 0 and common.size == 0:
        unverified = (
            f"no common block (producer holds {_span(producer_positions)}, consumer "
            f"{_span(consumer_positions)} at block size {coarse})"
        )
    elif positions.size == 0:
        unverified = (
            f"no common block with the same valid tokens (producer {producer.num_tokens} "
            f"tokens, consumer {consumer.num_tokens}, block size {coarse})"
        )
    return GroupComparison(
        compared=int(positions.size),
        mismatched_positions=sorted(mismatched),
        replica_mismatches=sorted(replicas),
        unverified=unverified,
        block_size=coarse,
    )


# Records against records.


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


def _compare_request(
    producer: Record,
    consumer: Record,
    request_id: str,
    *,
    missing: str | None,
    per_key: bool,
    producer_absence: str | None,
) -> dict[int, GroupComparison]:
    """Each group of one request present on both sides; ``missing`` says which side's
    workers are missing, if any."""
    produced = producer.requests[request_id]
    consumed = consumer.requests[request_id]
    result: dict[int, GroupComparison] = {}
    for gid in sorted({*produced.groups, *consumed.groups}):
        left, right = produced.groups.get(gid), consumed.groups.get(gid)
        if missing is None and left is not None and right is not None:
            result[gid] = _compare_sides(
                _Side.of(left, produced.num_tokens),
                _Side.of(right, consumed.num_tokens),
                consumer.positions,
                per_key=per_key,
            )
            continue
        if missing is not None:
            reason = missing
        elif left is None:
            reason = _covered_on_one_side("producer", producer, gid, producer_absence)
        else:
            reason = _covered_on_one_side("consumer", consumer, gid, None)
        block_size = max(group.block_size for group in (left, right) if group is not None)
        result[gid] = GroupComparison(unverified=reason, block_size=block_size)
    return result


def _compare(
    producer: Record,
    consumer: Record,
    request_ids: Sequence[str] | None,
    *,
    per_key: bool,
    producer_absence: str | None = None,
) -> DiffReport:
    """Two records compared by the module's rules; ``per_key`` compares every column
    where the replica keys agree, and ``producer_absence`` replaces the reason given for
    a group only the consumer holds when the producer's workers give none."""
    _check_numbering(producer, consumer)
    both, only_producer, only_consumer = _select(producer, consumer, request_ids)
    reasons = [
        reason
        for reason in (_missing_reason("producer", producer), _missing_reason("consumer", consumer))
        if reason is not None
    ]
    missing = "; ".join(reasons) if reasons else None
    requests = {
        rid: _compare_request(
            producer,
            consumer,
            rid,
            missing=missing,
            per_key=per_key,
            producer_absence=producer_absence,
        )
        for rid in both
    }
    return DiffReport(consumer.positions, requests, only_producer, only_consumer)


def compare_records(
    producer: Record, consumer: Record, *, request_ids: Sequence[str] | None = None
) -> DiffReport:
    """The producer's totals compared with the consumer's totals and replicas.

    With ``request_ids``, only those requests (in that order); others in record order.

    Raises:
        KvauditError: The records number positions differently, or a requested id is on
            neither side.

    """
    return _compare(producer, consumer, request_ids, per_key=False)


def verify_against_record(
    current: Record, saved: Record, *, request_ids: Sequence[str] | None = None
) -> DiffReport:
    """A regression check: ``saved`` plays the producer, ``current`` the consumer.

    Besides the totals and the current replicas, when both sides have the same replica
    keys (the same engine layout) every column must equal the saved one: a differing
    replica-0 column marks the position mismatched, another column lists it under
    ``replicas_differing``.

    Raises:
        KvauditError: The records number positions differently, or a requested id is on
            neither side.

    """
    return _compare(saved, current, request_ids, per_key=True)


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
    report = _compare(
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


# Stored checksums of offloaded blocks.


def _uint64(values: np.ndarray | Sequence[int], what: str) -> np.ndarray:
    """An integer array as uint64 with the same bits (int64 wrap-around included)."""
    array = np.asarray(values)
    if array.dtype == np.int64:
        return array.view(np.uint64)
    if array.size == 0:
        return array.astype(np.uint64)
    if array.dtype.kind not in "iu":
        raise KvauditError(f"{what}: expected 64-bit integers, got {array.dtype}")
    return array.astype(np.uint64)


def verify_stored_blocks(
    request_id: str,
    group_id: int,
    positions: Sequence[int],
    recomputed: np.ndarray,
    stored: np.ndarray,
    block_hashes: Sequence[bytes],
    fingerprint: int,
) -> list[int]:
    """The positions whose stored checksum does not match one worker's recomputed sum.

    ``recomputed`` holds, per block, this worker's sum over its replica keys, or a
    ``[blocks, keys]`` array that is summed here (mod 2**64); ``stored`` the stored
    entries of the blocks' rows; ``block_hashes`` each block's hash; ``fingerprint``
    this worker's fingerprint of the group. A block passes when
    ``recomputed XOR tag(block_hash, fingerprint) == stored``.

    Raises:
        KvauditError: The arrays do not have one entry per position.

    """
    where = f"request {request_id} group {group_id}"
    sums = _uint64(recomputed, f"{where}: recomputed checksums")
    if sums.ndim == 2:
        sums = sums.sum(axis=1, dtype=np.uint64)
    entries = _uint64(stored, f"{where}: stored checksums")
    counts = {
        "recomputed checksums": sums.shape[0] if sums.ndim == 1 else -1,
        "stored checksums": entries.shape[0] if entries.ndim == 1 else -1,
        "block hashes": len(block_hashes),
    }
    for name, count in counts.items():
        if count != len(positions):
            raise KvauditError(
                f"{where}: {len(positions)} positions but "
                f"{'a malformed array of' if count < 0 else count} {name}"
            )
    if len(positions) == 0:
        return []
    tags = block_checksum_tags(block_hashes, fingerprint)
    failed = np.nonzero((sums ^ tags) != entries)[0]
    return [int(positions[i]) for i in failed.tolist()]


@dataclass
class StoredCheck:
    """One worker's stored-checksum check of one request's group: the positions checked
    and those that failed, or why it could not be checked."""

    request_id: str
    group_id: int
    block_size: int
    checked: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    unverified: str | None = None


def stored_report(checks: Iterable[StoredCheck], *, positions: str) -> DiffReport:
    """The workers' stored-checksum checks merged per request and group into a report.

    A position fails when it fails on any worker; a group is unverified when any worker
    could not check it, or when no worker checked a single block of it.
    """
    merged: dict[str, dict[int, list[StoredCheck]]] = {}
    for check in checks:
        merged.setdefault(check.request_id, {}).setdefault(check.group_id, []).append(check)
    requests: dict[str, dict[int, GroupComparison]] = {}
    for rid, groups in merged.items():
        requests[rid] = {}
        for gid in sorted(groups):
            parts = groups[gid]
            checked = {int(p) for part in parts for p in part.checked}
            failed = sorted({int(p) for part in parts for p in part.failed})
            reasons = list(dict.fromkeys(p.unverified for p in parts if p.unverified))
            if not reasons and not checked:
                reasons = ["no block of it has both a stored checksum and a block hash"]
            requests[rid][gid] = GroupComparison(
                compared=len(checked),
                mismatched_positions=failed,
                unverified="; ".join(reasons) if reasons else None,
                block_size=max(part.block_size for part in parts),
            )
    return DiffReport(positions, requests)
