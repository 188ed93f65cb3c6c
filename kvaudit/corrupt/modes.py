"""The faults ``corrupt`` plants: each mode's new cells for a block of a dump.

A mode gets the block (its views, dump row and valid slots), the ``layer`` and global
``head`` it is restricted to, a ``token`` where it takes one and a seeded generator, and
returns the new cells per view and its own details. What is left open it chooses from
the generator among the block's valid slots, so that the fault always changes the
block's checksum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import KvauditError
from ..dumps import Dump
from ..locate import block_row, counted_slots, group_views, layer_specs, read_block
from ..views import LayerView
from .result import CorruptMode, FlippedBit, StaleOrigin, SwappedHeads, SwappedTokens

# The modes that take no ``token``, and what they change instead.
WHOLE_BLOCK_MODES: dict[CorruptMode, str] = {
    "zero": "clears whole blocks",
    "swap-heads": "swaps whole heads",
    "shift": "moves every valid token",
}


@dataclass
class Block:
    """The block a fault goes into: its views, its dump row, its first request position
    and ``valid``, the slots of it that count (its valid tokens; 1 for a state block)."""

    dump: Dump
    request_id: str
    group_id: int
    position: int
    block_id: int
    row: int
    first: int
    valid: int
    is_state: bool
    views: list[LayerView]
    cache: dict[int, np.ndarray] = field(default_factory=dict)

    def cells(self, index: int) -> np.ndarray:
        """View ``index``'s cells of this block, read once; callers copy before changing."""
        if index not in self.cache:
            self.cache[index] = read_block(self.views[index], self.row)
        return self.cache[index]

    def fail(self, message: str) -> KvauditError:
        """The error to raise about this block: one line naming the dump, the request,
        group and position, and ``message``."""
        return KvauditError(
            f"request {self.request_id!r} group {self.group_id} position {self.position}: "
            f"{message}",
            source=self.dump.path,
        )


@dataclass
class Change:
    """New cells for one view of the block."""

    index: int
    cells: np.ndarray


@dataclass
class Fault:
    """What a mode planted: new cells per view and the mode's own details (a flipped
    bit, a swap, a stale block's origin)."""

    changes: list[Change]
    flip: FlippedBit | None = None
    swap: SwappedTokens | SwappedHeads | None = None
    origin: StaleOrigin | None = None


def open_block(dump: Dump, request_id: str, group_id: int, position: int) -> Block:
    """The request's block at ``position``, checked to hold a checksummed layer and a
    valid token."""
    row, first, block_id = block_row(dump, request_id, group_id, position)
    views = group_views(dump, group_id)
    specs = layer_specs(dump.description, group_id)
    is_state = any(specs[view.name].is_state for view in views.views)
    num_tokens = dump.requests[request_id].num_tokens
    valid = counted_slots(position, views.group.block_size, is_state, num_tokens)
    block = Block(
        dump, request_id, group_id, position, block_id, row, first, valid, is_state, views.views
    )
    if not views.views:
        raise block.fail("the group has no checksummed layer on this worker")
    if valid == 0:
        raise block.fail(
            f"the block holds no valid token (num_tokens {num_tokens}); a fault there "
            "could not be detected"
        )
    return block


# Choosing what to change.


def _rotated(items: list, rng: np.random.Generator) -> list:
    """The items from a seeded starting point on, wrapping around."""
    if not items:
        return items
    start = int(rng.integers(len(items)))
    return items[start:] + items[:start]


def _heads(block: Block, layer: str | None, head: int | None) -> list[tuple[int, int]]:
    """The ``(view index, local head)`` pairs that ``layer`` and global ``head`` allow."""
    indices = list(range(len(block.views)))
    if layer is not None:
        indices = [i for i in indices if block.views[i].name == layer]
        if not indices:
            names = sorted({view.name for view in block.views})
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise block.fail(f"no layer {layer} in the group on this worker (layers: {shown})")
    pairs = [(i, h) for i in indices for h in range(block.views[i].heads)]
    if head is not None:
        pairs = [(i, h) for i, h in pairs if block.views[i].first_head + h == head]
        if not pairs:
            held = sorted(
                {
                    block.views[i].first_head + h
                    for i in indices
                    for h in range(block.views[i].heads)
                }
            )
            where = f"layer {layer}" if layer is not None else "the group"
            raise block.fail(
                f"head {head} of {where} is not on this worker (it holds heads {_spans(held)})"
            )
    return pairs


def _spans(values: list[int]) -> str:
    """Sorted integers as ``a..b`` runs."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in runs)


def _token_index(block: Block, token: int | None, rng: np.random.Generator) -> int:
    """The block index of ``token`` (a request position), or a seeded valid one."""
    if token is None:
        return int(rng.integers(block.valid))
    if block.is_state:
        if token != block.first:
            raise block.fail(
                f"token {token} is not this state block's position (its one state is at "
                f"{block.first})"
            )
        return 0
    if not block.first <= token < block.first + block.valid:
        raise block.fail(
            f"token {token} is not a valid token of the block (valid: {block.first}.."
            f"{block.first + block.valid - 1})"
        )
    return token - block.first


def _needs_tokens(block: Block, mode: str) -> None:
    """Raise unless the block holds two valid tokens (a state block holds one state)."""
    if block.is_state:
        raise block.fail(f"{mode} needs tokens, and a state block holds one state")
    if block.valid < 2:
        raise block.fail(f"{mode} needs two valid tokens, the block holds {block.valid}")


# Modes.


def _flip(
    block: Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> Fault:
    """One bit of one valid token's cell of one head."""
    pairs = _heads(block, layer, head)
    index, h = pairs[int(rng.integers(len(pairs)))]
    u = _token_index(block, token, rng)
    cells = block.cells(index).copy()
    bit = int(rng.integers(cells.shape[2] * 8))
    cells[h, u, bit // 8] ^= np.uint8(1 << (bit % 8))
    view = block.views[index]
    flipped = FlippedBit(view.name, view.first_head + h, block.first + u, bit // 8, bit % 8)
    return Fault([Change(index, cells)], flip=flipped)


def _selected(block: Block, layer: str | None, head: int | None) -> Iterator[tuple[int, list[int]]]:
    """Each view index with its local heads that ``layer`` and ``head`` allow."""
    by_view: dict[int, list[int]] = {}
    for index, h in _heads(block, layer, head):
        by_view.setdefault(index, []).append(h)
    yield from by_view.items()


def _zero(
    block: Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> Fault:
    """Every selected head's cells of the block set to zero."""
    changes = []
    for index, heads in _selected(block, layer, head):
        cells = block.cells(index).copy()
        cells[heads] = 0
        changes.append(Change(index, cells))
    return Fault(changes)


def _swap_tokens(
    block: Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> Fault:
    """Two neighbouring valid tokens of one head swapped: the first candidate pair, in
    seeded order, whose cells differ."""
    _needs_tokens(block, "swap-tokens")
    pairs = _rotated(_heads(block, layer, head), rng)
    if token is not None:
        firsts = [_token_index(block, token, rng)]
    else:
        firsts = _rotated(list(range(block.valid - 1)), rng)
    for index, h in pairs:
        original = block.cells(index)
        for u in firsts:
            other = u + 1 if u + 1 < block.valid else u - 1
            if np.array_equal(original[h, u], original[h, other]):
                continue
            cells = original.copy()
            cells[h, [u, other]] = original[h, [other, u]]
            view = block.views[index]
            swapped = sorted([block.first + u, block.first + other])
            swap = SwappedTokens(view.name, view.first_head + h, swapped)
            return Fault([Change(index, cells)], swap=swap)
    raise block.fail("swap-tokens would change nothing: the candidate tokens hold the same KV")


def _swap_heads(
    block: Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> Fault:
    """Two neighbouring local heads of one layer swapped: the first candidate pair, in
    seeded order, whose valid slots differ."""
    pairs = [(i, h) for i, h in _heads(block, layer, head) if block.views[i].heads >= 2]
    if not pairs:
        where = f"layer {layer}" if layer is not None else "any layer of the group"
        most = max(block.views[i].heads for i, _ in _heads(block, layer, None))
        raise block.fail(f"swap-heads needs two heads of {where} on this worker; it holds {most}")
    if head is None:
        pairs = [(i, h) for i, h in pairs if h + 1 < block.views[i].heads]
    valid = slice(0, block.valid)
    for index, h in _rotated(pairs, rng):
        view = block.views[index]
        other = h + 1 if h + 1 < view.heads else h - 1
        original = block.cells(index)
        if np.array_equal(original[h, valid], original[other, valid]):
            continue
        cells = original.copy()
        cells[[h, other]] = original[[other, h]]
        swapped = sorted([view.first_head + h, view.first_head + other])
        return Fault([Change(index, cells)], swap=SwappedHeads(view.name, swapped))
    raise block.fail("swap-heads would change nothing: the candidate heads hold the same KV")


def _stale(
    block: Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> Fault:
    """The selected heads' cells replaced by another row's that differ in a valid slot:
    another request's block first, else any other row of the dump. With ``token``, only
    the block's slots up to it (a slot reused while the new request's write was still
    landing: its first tokens hold the other request's KV)."""
    selected = list(_selected(block, layer, head))
    upto = block.valid if token is None else _token_index(block, token, rng) + 1
    dump = block.dump
    others: list[StaleOrigin] = []
    seen = {block.row}
    for request_id in sorted(dump.requests):
        if request_id == block.request_id:
            continue
        listed = dump.requests[request_id].groups.get(block.group_id)
        if listed is None:
            continue
        start, block_ids = listed
        for offset, block_id in enumerate(block_ids):
            row = dump.row_of(block_id, block.group_id)
            if row not in seen:
                seen.add(row)
                others.append(StaleOrigin(request_id, start + offset, block_id, row))
    # Rows of the block's own group space: another group's rows are other tensors.
    space = dump.space(block.group_id)
    rest = [
        StaleOrigin(None, None, space.block_of(row), row)
        for row in range(space.num_rows)
        if row not in seen
    ]
    valid = slice(0, min(upto, block.valid))
    for origin in _rotated(others, rng) + _rotated(rest, rng):
        row = origin.row
        changes = []
        differs = False
        for index, heads in selected:
            cells = block.cells(index).copy()
            replacement = read_block(block.views[index], row)
            if token is None:
                cells[heads] = replacement[heads]
            else:
                cells[np.ix_(heads, range(upto))] = replacement[np.ix_(heads, range(upto))]
            differs = differs or not np.array_equal(
                cells[heads, valid], block.cells(index)[heads, valid]
            )
            changes.append(Change(index, cells))
        if differs:
            return Fault(changes, origin=origin)
    raise block.fail("stale would change nothing: no other block of the dump differs")


def _shift(
    block: Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> Fault:
    """Each valid token of the selected heads given the previous token's cell."""
    _needs_tokens(block, "shift")
    changes = []
    for index, heads in _selected(block, layer, head):
        original = block.cells(index)
        cells = original.copy()
        for h in heads:
            cells[h, 1 : block.valid] = original[h, : block.valid - 1]
        changes.append(Change(index, cells))
    return Fault(changes)


ModeFault = Callable[[Block, str | None, int | None, int | None, np.random.Generator], Fault]
"""A mode: ``(block, layer, head, token, rng) -> Fault``."""

MODE_FAULTS: dict[CorruptMode, ModeFault] = {
    "flip": _flip,
    "zero": _zero,
    "swap-tokens": _swap_tokens,
    "swap-heads": _swap_heads,
    "stale": _stale,
    "shift": _shift,
}
