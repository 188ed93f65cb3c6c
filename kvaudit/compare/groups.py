"""One request's group compared between two sides, once both are known to hold it.

- A group is unverified when the fingerprints differ or the block sizes cannot be brought
  to one size.
- Different block sizes are compared at the coarser one: the finer side's totals are summed
  (mod 2**64) into coarse blocks. A coarse block is formed only when every fine position of
  it that has valid tokens is held; fine positions past ``num_tokens`` contribute nothing by
  definition and may be absent. With ``block`` numbering checksums do not add up across
  block sizes, so differing sizes leave the group unverified.
- A position is compared only when both sides hold it and both give it the same, non-zero,
  number of valid tokens (each side with the ``num_tokens`` its checksums cover).
- A position is expected when the producer holds it with valid tokens (its full token
  count, ``tokens``) and, for a windowed group (``AttentionWindow``: a sliding window or
  chunked local attention), each side keeps it: after ``tokens`` tokens a side keeps the
  blocks from the one holding the first token its next token attends to. A coarse
  position that the window or the producer's first block starts inside is expected over
  its tokens from there.
  An expected position is missing when the consumer's blocks do not cover the producer's
  tokens of it (its block list stops early or skips it, or its token count is smaller).
  A position is compared over the tokens both sides hold, so a position the consumer
  holds in part is compared there and listed as missing. An expected position that is
  neither missing nor compared (a record holds other valid tokens of it and cannot be
  checksummed again, or a side holds only its last fine blocks of it) leaves the group
  unverified.
- The producer contributes its totals (the sums of its replica index 0 columns); a compared
  position whose consumer total differs is listed in ``mismatched_positions``.
- Each consumer replica column ``(R, r)`` must equal its ``(R, 0)`` column (0 where the
  consumer has none) at every position the consumer holds. That check runs at the
  consumer's own block size; each difference adds ``(position, R, r)`` to
  ``replica_mismatches``, the position in the compared (coarser) numbering.
- With ``per_key`` and the same replica keys on both sides, every column is compared: a
  differing replica-0 column lists the position as mismatched, another column adds it to
  ``replica_mismatches``.
- Every rule above runs on both lanes of the checksum (docs/checksum.md): the seed lane
  (sums mod 2**64) and, where both sides carry it, the strong lane (sums mod 2**64 - 59).
  A position differs when either lane differs. Where a side carries no strong lane (a
  record of the seed engine, KVC2 wire bytes) or ``seed_lane_only`` is asked, the seed
  lane alone is compared, and ``GroupComparison.seed_lane_only`` says why.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..core.scheme import MASK64, STRONG_PRIME, ReplicaKey, to_hex, valid_tokens
from ..core.validation import Positions
from ..records import GroupChecksums, replica_zero_totals, strong_replica_zero_totals
from .model import GroupComparison


@dataclass(frozen=True)
class AttentionWindow:
    """The tokens a group's next token attends to, for a windowed group.

    They are the last ``tokens`` (a sliding window) or, ``chunked``, those of its own
    ``tokens``-token chunk (chunked local attention).
    """

    tokens: int
    chunked: bool = False

    def first_token(self, held: int) -> int:
        """The first token that the next token, at position ``held``, attends to."""
        if self.chunked:
            return held // self.tokens * self.tokens
        return max(0, held - self.tokens + 1)


Window = int | AttentionWindow
"""A group's window: an ``AttentionWindow``, or a sliding window's size in tokens."""


def as_window(window: Window | None) -> AttentionWindow | None:
    """``window`` as an ``AttentionWindow`` (an int is a sliding window's size)."""
    if window is None or isinstance(window, AttentionWindow):
        return window
    return AttentionWindow(int(window))


@dataclass
class SideChecksums:
    """One side's checksums of one request's group: ``columns[i, k]`` is position
    ``start + i`` under ``keys[k]``, checksummed over ``num_tokens`` tokens of a request
    the side holds ``tokens`` of (``num_tokens`` when not cut); ``strong`` the strong
    lane's residues of the same positions and keys, None where the side has none."""

    block_size: int
    start: int
    num_tokens: int
    fingerprint: int
    columns: np.ndarray
    keys: list[ReplicaKey]
    tokens: int = -1
    strong: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.num_tokens

    @classmethod
    def of(cls, group: GroupChecksums, num_tokens: int, tokens: int | None = None) -> SideChecksums:
        """A record's group checksummed over ``num_tokens`` tokens of a request the side
        holds ``tokens`` of (default ``num_tokens``)."""
        keys = [(int(r), int(i)) for r, i in group.replica_keys]
        columns = np.asarray(group.values, dtype=np.uint64).reshape(group.count, len(keys))
        held = num_tokens if tokens is None else tokens
        strong = None
        if group.strong is not None:
            strong = np.asarray(group.strong, dtype=np.uint64).reshape(group.count, len(keys))
        return cls(
            group.block_size,
            group.start,
            num_tokens,
            group.fingerprint,
            columns,
            keys,
            held,
            strong,
        )

    def covers(self, lo: int, hi: int) -> bool:
        """Whether the side holds tokens ``lo .. hi - 1``: its token count reaches ``hi``
        and its blocks list every position holding them."""
        if hi <= lo:
            return True
        first, last = lo // self.block_size, (hi - 1) // self.block_size
        return self.tokens >= hi and self.start <= first and last < self.start + len(self.columns)

    @functools.cached_property
    def column_of(self) -> dict[ReplicaKey, int]:
        """The column of each replica key."""
        return {key: k for k, key in enumerate(self.keys)}


def coarsen(
    side: SideChecksums, coarse: int, *, strong: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The coarse positions the side can form and their columns summed mod 2**64 (with
    ``strong``, the strong lane's columns summed mod 2**64 - 59).

    A coarse block is formed when each of its fine positions is held or has no valid token
    (a position past ``num_tokens`` contributes nothing, whether held or not).
    """
    ratio = coarse // side.block_size
    columns = side.columns
    if strong:
        assert side.strong is not None
        columns = side.strong
    count, width = columns.shape
    if count == 0:
        return np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.uint64)
    if ratio == 1:
        return np.arange(side.start, side.start + count, dtype=np.int64), columns
    # Memory in the rows held, not in the ratio: the held rows are consecutive, so each
    # coarse block's rows are one slice and its valid fine positions one range.
    end = side.start + count
    positions = np.arange(side.start // ratio, (end - 1) // ratio + 1, dtype=np.int64)
    lo = positions * ratio
    edges = np.maximum(lo - side.start, 0)
    if strong:
        # Python integers: a sum of residues mod 2**64 - 59 must not wrap at 2**64.
        exact = np.add.reduceat(columns.astype(object), edges, axis=0)
        sums = (exact % STRONG_PRIME).astype(np.uint64)
    else:
        # uint64 addition wraps modulo 2**64, as block-size additivity requires.
        sums = np.add.reduceat(columns, edges, axis=0, dtype=np.uint64)
    with_tokens = -(-side.num_tokens // side.block_size)
    hi = np.minimum(lo + ratio, with_tokens)
    formed = (hi <= lo) | ((side.start <= lo) & (end >= hi))
    return positions[formed], sums[formed]


def _replica_differences(
    side: SideChecksums, coarse: int, strong: bool
) -> set[tuple[int, int, int]]:
    """``(coarse position, R, r)`` wherever a column ``(R, r)``, ``r > 0``, differs from
    ``(R, 0)`` (from 0 where the side has no such column) in the seed lane or, with
    ``strong``, the strong lane, checked at the side's own block size."""
    found: set[tuple[int, int, int]] = set()
    lanes = [side.columns] if not strong or side.strong is None else [side.columns, side.strong]
    for k, (replicas, index) in enumerate(side.keys):
        if index == 0:
            continue
        base = side.column_of.get((replicas, 0))
        for lane in lanes:
            reference = lane[:, base] if base is not None else np.uint64(0)
            for row in np.flatnonzero(lane[:, k] != reference).tolist():
                found.add(((side.start + row) * side.block_size // coarse, replicas, index))
    return found


def seed_only_reason(
    producer: SideChecksums, consumer: SideChecksums, seed_lane_only: bool
) -> str | None:
    """Why the two sides are compared by the seed lane alone, or None (both lanes)."""
    if seed_lane_only:
        return SEED_LANE_ASKED
    lacking = [
        label
        for label, side in (("producer", producer), ("consumer", consumer))
        if side.strong is None
    ]
    if len(lacking) == 2:
        return "neither side carries the strong lane"
    if lacking:
        return f"the {lacking[0]} carries no strong lane"
    return None


SEED_LANE_ASKED = "--seed-lane-only was given"
"""Why a comparison asked for the seed lane alone is made by it."""


def _positions_text(positions: list[int]) -> str:
    """``position 2`` or ``positions 0-3``, for a message."""
    if len(positions) == 1:
        return f"position {positions[0]}"
    first, last = positions[0], positions[-1]
    if last - first + 1 == len(positions):
        return f"positions {first}-{last}"
    return "positions " + ", ".join(str(q) for q in positions)


def _incomparable(
    producer: SideChecksums,
    consumer: SideChecksums,
    numbering: Positions,
    differing: str | None = None,
) -> str | None:
    """Why the two sides cannot be compared position by position (their fingerprints or
    block sizes), or None; ``differing`` names what differs between the sides' layers
    where their descriptions are known (``dtype bfloat16 vs float8_e4m3fn``)."""
    if producer.fingerprint != consumer.fingerprint:
        what = differing or "the layers, specs or dtypes differ"
        return (
            f"fingerprints differ (producer {to_hex(producer.fingerprint)}, consumer "
            f"{to_hex(consumer.fingerprint)}): {what}"
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


def window_start(producer: SideChecksums, consumer: SideChecksums, window: Window | None) -> int:
    """The first token both sides keep: each side keeps its blocks from the one holding
    the first token its next token (at position ``tokens``) attends to, as vLLM frees the
    blocks before it; 0 without a window."""
    rule = as_window(window)
    if rule is None:
        return 0
    return max(
        rule.first_token(side.tokens) // side.block_size * side.block_size
        for side in (producer, consumer)
    )


def expected_from(producer: SideChecksums, consumer: SideChecksums, window: Window | None) -> int:
    """The first token a diff expects: from the producer's first block, in the window."""
    return max(window_start(producer, consumer, window), producer.start * producer.block_size)


def held_positions(side: SideChecksums, coarse: int) -> range:
    """The positions (at ``coarse``) with valid tokens whose tokens the side holds: one
    range, as the side's blocks are consecutive (so its length is bounded by the blocks
    held, whatever the token count)."""
    with_tokens = -(-side.tokens // coarse)
    if len(side.columns) == 0:
        return range(0)
    first = -(-side.start * side.block_size // coarse)
    listed_end = (side.start + len(side.columns)) * side.block_size
    end = with_tokens if side.tokens <= listed_end else min(with_tokens, listed_end // coarse)
    return range(first, max(first, end))


def missing_and_expected(
    producer: SideChecksums, consumer: SideChecksums, coarse: int, window: Window | None
) -> tuple[list[int], list[int]]:
    """The expected positions the consumer lacks in whole or in part, and all expected
    positions (the producer's with valid tokens, inside the window on both sides: a
    coarse position that the window or the producer's blocks start inside is expected
    over its tokens from there)."""
    first = expected_from(producer, consumer, window)
    held = held_positions(producer, coarse)
    expected = list(range(first // coarse, held.stop)) if held else []
    missing = [
        q
        for q in expected
        if not consumer.covers(max(q * coarse, first), min((q + 1) * coarse, producer.tokens))
    ]
    return missing, expected


def compare_sides(
    producer: SideChecksums,
    consumer: SideChecksums,
    numbering: Positions,
    *,
    per_key: bool,
    window: Window | None = None,
    differing: str | None = None,
    seed_lane_only: bool = False,
) -> GroupComparison:
    """One group compared by the module's rules, both sides complete and holding it;
    ``window`` is the group's attention window (None: every position), ``differing``
    what differs between the sides' layers where their fingerprints do (None: not
    known); ``seed_lane_only`` compares the seed lane alone even where both sides carry
    the strong lane."""
    coarse = max(producer.block_size, consumer.block_size)
    reason = _incomparable(producer, consumer, numbering, differing)
    if reason is not None:
        return GroupComparison(unverified=reason, block_size=coarse)

    producer_positions, producer_columns = coarsen(producer, coarse)
    consumer_positions, consumer_columns = coarsen(consumer, coarse)
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
    seed_only = seed_only_reason(producer, consumer, seed_lane_only)
    lanes = [(left, right)]
    if seed_only is None:
        # The strong lane at the same coarse positions (the sides' formed positions are
        # those of the seed lane: both are summed over the same fine rows).
        strong_left = coarsen(producer, coarse, strong=True)[1][in_producer[usable]]
        strong_right = coarsen(consumer, coarse, strong=True)[1][in_consumer[usable]]
        lanes.append((strong_left, strong_right))
        totals_differ |= strong_replica_zero_totals(
            strong_left, producer.keys
        ) != strong_replica_zero_totals(strong_right, consumer.keys)
    mismatched = set(positions[totals_differ].tolist())
    replicas = _replica_differences(consumer, coarse, strong=not seed_lane_only)
    if per_key and set(producer.keys) == set(consumer.keys):
        # Same engine layout: every column must match the saved one, not only the totals.
        for lane_left, lane_right in lanes:
            for k, key in enumerate(producer.keys):
                differing = positions[
                    lane_left[:, k] != lane_right[:, consumer.column_of[key]]
                ].tolist()
                if key[1] == 0:
                    mismatched.update(differing)
                else:
                    replicas.update((position, *key) for position in differing)

    missing, expected = missing_and_expected(producer, consumer, coarse, window)
    compared = set(positions.tolist())
    unchecked = [q for q in expected if q not in compared and q not in missing]
    formed = set(common.tolist())
    # Expected from inside a coarse block (the window's start, the producer's first
    # block): a side holds only its last fine blocks there.
    cut = [q for q in unchecked if q not in formed]
    unverified = None
    if cut:
        fine = min(producer.block_size, consumer.block_size)
        unverified = (
            f"not compared at {_positions_text(cut)}: a side holds only its last {fine}-token "
            f"blocks from token {expected_from(producer, consumer, window)}, and the "
            f"{coarse}-token block's checksum cannot be formed from them"
        )
    elif unchecked:
        unverified = (
            f"not compared at {_positions_text(unchecked)}: the sides hold different valid "
            f"tokens there (producer {producer.num_tokens} tokens, consumer "
            f"{consumer.num_tokens}, block size {coarse}) and a record cannot be "
            "checksummed again over fewer"
        )
    return GroupComparison(
        compared=int(positions.size),
        mismatched_positions=sorted(mismatched),
        replica_mismatches=sorted(replicas),
        unverified=unverified,
        block_size=coarse,
        missing_positions=missing,
        held=(len(held_positions(producer, coarse)), len(held_positions(consumer, coarse))),
        seed_lane_only=seed_only,
    )


def layer_differences(
    producer: GroupChecksums,
    consumer: GroupChecksums,
    num_tokens: tuple[int, int],
    positions: Sequence[int],
) -> dict[int, list[tuple[int, str]]]:
    """Per differing position, the ``(layer number, plane)`` whose layer sums differ.

    Both sides' layer sums are summed to the coarser block size as the totals are. A
    layer whose planes differ between the sides (K and V rows on one, whole cells on the
    other) is compared whole, as plane ``KV``.

    Args:
        producer: The producer's checksums of the group, with layer sums.
        consumer: The consumer's, with layer sums.
        num_tokens: Each side's token count checksummed (producer, consumer).
        positions: The differing positions, at the coarser block size.

    Returns:
        The positions both sides could form, each with the labels that differ (in order);
        empty where a side has no layer sums.

    """
    if producer.layer_sums is None or consumer.layer_sums is None or not positions:
        return {}
    coarse = max(producer.block_size, consumer.block_size)
    formed = []
    for group, tokens in ((producer, num_tokens[0]), (consumer, num_tokens[1])):
        sums = group.layer_sums
        assert sums is not None
        side = SideChecksums(group.block_size, group.start, tokens, 0, sums.values, [])
        at, rows = coarsen(side, coarse)
        formed.append((dict(zip(at.tolist(), range(len(at)))), rows, sums.parts))
    planes: list[dict[int, set[str]]] = [{}, {}]
    for side_planes, (_, _, parts) in zip(planes, formed):
        for number, plane in parts:
            side_planes.setdefault(number, set()).add(plane)
    labels: list[tuple[int, str]] = []
    for number in sorted(planes[0].keys() | planes[1].keys()):
        same = planes[0].get(number) == planes[1].get(number)
        labels += [(number, p) for p in sorted(planes[0][number])] if same else [(number, "KV")]
    found: dict[int, list[tuple[int, str]]] = {}
    for position in positions:
        rows = [index.get(position) for index, _, _ in formed]
        if rows[0] is None or rows[1] is None:
            continue
        values = []
        for (_, sums, parts), row in zip(formed, rows):
            by_label: dict[tuple[int, str], int] = {}
            for (number, plane), value in zip(parts, sums[row].tolist()):
                label = (number, plane) if (number, plane) in labels else (number, "KV")
                by_label[label] = (by_label.get(label, 0) + value) & MASK64
            values.append(by_label)
        differing = [label for label in labels if values[0].get(label) != values[1].get(label)]
        if differing:
            found[position] = differing
    return found
