"""One request's group compared between two sides, once both are known to hold it.

- A group is unverified when the fingerprints differ or the block sizes cannot be brought
  to one size.
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
- Each consumer replica column ``(R, r)`` must equal its ``(R, 0)`` column (0 where the
  consumer has none) at every position the consumer holds. That check runs at the
  consumer's own block size; each difference adds ``(position, R, r)`` to
  ``replica_mismatches``, the position in the compared (coarser) numbering.
- With ``per_key`` and the same replica keys on both sides, every column is compared: a
  differing replica-0 column lists the position as mismatched, another column adds it to
  ``replica_mismatches``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..records import GroupChecksums, replica_zero_totals
from ..scheme import ReplicaKey, to_hex, valid_tokens
from ..validation import Positions
from .model import GroupComparison


@dataclass
class Side:
    """One side's checksums of one request's group: ``columns[i, k]`` is position
    ``start + i`` under ``keys[k]``."""

    block_size: int
    start: int
    num_tokens: int
    fingerprint: int
    columns: np.ndarray
    keys: list[ReplicaKey]

    @classmethod
    def of(cls, group: GroupChecksums, num_tokens: int) -> Side:
        """A record's group, for a request of ``num_tokens`` tokens."""
        keys = [(int(r), int(i)) for r, i in group.replica_keys]
        columns = np.asarray(group.values, dtype=np.uint64).reshape(group.count, len(keys))
        return cls(group.block_size, group.start, num_tokens, group.fingerprint, columns, keys)

    @functools.cached_property
    def column_of(self) -> dict[ReplicaKey, int]:
        """The column of each replica key."""
        return {key: k for k, key in enumerate(self.keys)}


def _coarsen(side: Side, coarse: int) -> tuple[np.ndarray, np.ndarray]:
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
    # Memory in the rows held, not in the ratio: the held rows are consecutive, so each
    # coarse block's rows are one slice and its valid fine positions one range.
    end = side.start + count
    positions = np.arange(side.start // ratio, (end - 1) // ratio + 1, dtype=np.int64)
    lo = positions * ratio
    edges = np.maximum(lo - side.start, 0)
    # uint64 addition wraps modulo 2**64, as block-size additivity requires.
    sums = np.add.reduceat(side.columns, edges, axis=0, dtype=np.uint64)
    with_tokens = -(-side.num_tokens // side.block_size)
    hi = np.minimum(lo + ratio, with_tokens)
    formed = (hi <= lo) | ((side.start <= lo) & (end >= hi))
    return positions[formed], sums[formed]


def _replica_differences(side: Side, coarse: int) -> set[tuple[int, int, int]]:
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


def _incomparable(producer: Side, consumer: Side, numbering: Positions) -> str | None:
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


def compare_sides(
    producer: Side, consumer: Side, numbering: Positions, *, per_key: bool
) -> GroupComparison:
    """One group compared by the module's rules, both sides complete and holding it."""
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
