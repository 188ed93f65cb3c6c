"""Tracing differing tokens to the same request's tokens a few slots away: KV written at
the wrong offset (a slot mapping off by one, a block table read from the wrong token),
inside a block or across blocks.

For each differing token (replica 0, not traced to another block, not zeros, more than a
byte changed) and each shift ``N`` of at most ``MAX_SHIFT`` slots either way, the
consumer's cells at token ``t`` are compared with the producer's at ``t - N`` in every
slice that differs at ``t``. Runs of at least ``MIN_RUN`` consecutive tokens that agree
for one shift, and for no other (content repeated along the request fits many shifts
and shows none), are a ``TokenShift``; the best shift (most tokens) is taken first, then the
next among the tokens left. One layer is read at a time, over the differing tokens and
``MAX_SHIFT`` on each side, so that what is held stays small; a group whose differing
tokens span more than ``MAX_SHIFT_TOKENS`` is not looked at (a shift that long is a
block table fault, which the block trace names).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from ..locate import SliceReader
from ..locate.model import LocatedDifference
from ..workers import RawWorker
from .model import GroupComparison, TokenShift

MAX_SHIFT = 16
"""The largest shift looked for, in slots, either way."""

MIN_RUN = 2
"""A shift explains runs of at least this many consecutive tokens: one token equal to a
neighbour's says little."""

MAX_SHIFT_TOKENS = 4096
"""Differing tokens spanning more than this are not looked at for a shift."""


def _candidates(group: GroupComparison) -> list[LocatedDifference]:
    """The entries a shift may explain: replica 0, at positions the block trace left
    without a source, holding more than zeros, more than one byte per token changed, not
    another slice's nor their own K and V exchanged."""
    return [
        item
        for item in group.located
        if item.replica == 0
        and not group.stale_sources.get(item.position)
        and not item.consumer_zeros
        and item.differing_bytes > len(item.tokens)
        and item.holds is None
        and not item.kv_exchanged
    ]


def _bad_tokens(
    items: Sequence[LocatedDifference],
    producer: SliceReader,
    consumer: SliceReader,
    request_id: str,
    group_id: int,
    window: tuple[int, int],
) -> dict[int, set[int]]:
    """Per shift, the differing tokens whose cells (in some slice differing there) are
    not the producer's ``shift`` slots earlier; one layer read at a time."""
    lo, hi = window
    shifts = [n for n in range(-MAX_SHIFT, MAX_SHIFT + 1) if n]
    bad: dict[int, set[int]] = {n: set() for n in shifts}
    by_layer: dict[str, list[LocatedDifference]] = defaultdict(list)
    for item in items:
        by_layer[item.layer].append(item)
    for layer, entries in by_layer.items():
        sides = [
            side.gather(request_id, group_id, lo, hi, {layer}) for side in (producer, consumer)
        ]
        for item in entries:
            key = (item.layer, item.head, 0)
            held = [side.get(key) for side in sides]
            tokens = np.asarray(item.tokens, dtype=np.int64)
            if any(h is None or len(h.tokens) != hi - lo for h in held):
                for n in shifts:
                    bad[n].update(item.tokens)  # cells not held whole: nothing is shown
                continue
            made, got = held[0].cells, held[1].cells  # type: ignore[union-attr]
            mine = got[tokens - lo]
            for n in shifts:
                source = tokens - n
                inside = (source >= lo) & (source < hi)
                same = np.zeros(len(tokens), dtype=bool)
                same[inside] = (mine[inside] == made[source[inside] - lo]).all(axis=1)
                bad[n].update(int(t) for t in tokens[~same])
    return bad


def _unique(bad: dict[int, set[int]], shift: int, tokens: range) -> bool:
    """Whether no other shift explains every one of the tokens too: content repeated
    along the request (a pattern, padding) fits many shifts and shows none."""
    return all(any(t in bad[n] for t in tokens) for n in bad if n != shift)


def _runs(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted tokens as runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for token in tokens:
        if runs and token == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], token)
        else:
            runs.append((token, token))
    return runs


def trace_shifts(
    group: GroupComparison,
    request_id: str,
    group_id: int,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: int,
) -> None:
    """Fill the group's ``token_shifts``: the runs of differing tokens that hold the
    producer's tokens a few slots away, in every slice that differs there.

    Args:
        group: A located group whose block trace is done.
        request_id: The request.
        group_id: The group.
        producer: The producer's raw KV.
        consumer: The consumer's raw KV.
        num_tokens: The request's tokens compared.

    """
    items = _candidates(group)
    differing = sorted({int(t) for item in items for t in item.tokens})
    if len(differing) < MIN_RUN or differing[-1] - differing[0] > MAX_SHIFT_TOKENS:
        return
    window = (max(0, differing[0] - MAX_SHIFT), min(num_tokens, differing[-1] + MAX_SHIFT + 1))
    readers = [SliceReader.open(raw, request_id, group_id) for raw in (producer, consumer)]
    bad = _bad_tokens(items, readers[0], readers[1], request_id, group_id, window)
    left = set(differing)
    shifts: list[tuple[int, int, int]] = []
    while left:
        best = max(bad, key=lambda n: (len(left - bad[n]), -abs(n), n))
        runs = [
            (first, last)
            for first, last in _runs(sorted(left - bad[best]))
            if last - first + 1 >= MIN_RUN and _unique(bad, best, range(first, last + 1))
        ]
        if not runs:
            break
        shifts += [(first, last, best) for first, last in runs]
        left -= {t for first, last in runs for t in range(first, last + 1)}
    if not shifts:
        return
    explained = {t for first, last, _ in shifts for t in range(first, last + 1)}
    size = group.block_size or 1
    for first, last, shift in sorted(shifts):
        blocks = set(range(first // size, last // size + 1))
        slices = {
            (item.layer, item.head)
            for item in items
            if any(first <= t <= last for t in item.tokens)
        }
        residue = sorted(
            {
                int(t)
                for item in items
                if item.position in blocks
                for t in item.tokens
                if t not in explained
            }
        )
        group.token_shifts.append(
            TokenShift(first, last, shift, tuple(sorted(slices)), tuple(residue))
        )
