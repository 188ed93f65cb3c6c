"""Planting faults in dumps: a copy of one worker's dump with one fault in one block.

``corrupt_dump`` writes a copy of a dump whose block at one position of one request
differs from the original in one of the ways KV goes wrong in practice: a flipped bit, a
zeroed block, swapped tokens or heads, a stale block (the slot reused by another request),
or tokens shifted by one slot. What it leaves unspecified (layer, head, token) it chooses
from the seed among the block's valid tokens, so that the fault always changes the
block's checksum. The copy is written next to the output, changed in place through the
same cell layout ``kvaudit.locate`` reads, synced and renamed over the output.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .description import CacheDescription
from .dumps import Dump, open_dump
from .errors import KvauditError
from .files import atomic_path
from .locate import block_row, cell_addresses, counted_slots, group_views, layer_specs, read_block
from .views import LayerView

MODES = ("flip", "zero", "swap-tokens", "swap-heads", "stale", "shift")

# The modes that take no ``token``, and what they change instead.
_WHOLE_BLOCK_MODES = {
    "zero": "clears whole blocks",
    "swap-heads": "swaps whole heads",
    "stale": "replaces whole blocks",
    "shift": "moves every valid token",
}


@dataclass
class _Block:
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
class _Change:
    """New cells for one view of the block."""

    index: int
    cells: np.ndarray


@dataclass
class _Fault:
    """What a mode planted: new cells per view and what to tell about it."""

    changes: list[_Change]
    details: dict = field(default_factory=dict)


def corrupt_dump(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    request_id: str,
    group_id: int,
    position: int,
    layer: str | None = None,
    head: int | None = None,
    token: int | None = None,
    mode: str = "flip",
    seed: int = 0,
    config: CacheDescription | None = None,
) -> dict:
    """Write a copy of a dump with one fault in a request's block at ``position`` (in the
    dump's block size of the group), and say what changed.

    Modes: ``flip`` one bit of one valid token's cell; ``zero`` the block of ``layer``
    (default every layer of the group); ``swap-tokens`` ``token`` and the next valid token
    of one layer and head; ``swap-heads`` two local heads of one layer; ``stale`` the
    block's content replaced by another block of the dump (another request's, where there
    is one); ``shift`` each valid token gets the previous token's KV (the first keeps its
    own). ``layer`` and ``head`` (global) restrict every mode; what is left open is chosen
    from ``seed``. The result lists the changed layers, global heads and request positions
    (``changes``; ``tokens_past_end`` are changed slots at or past ``num_tokens``), the
    changed bytes of the output file (``byte_ranges``, ``[start, end)``) and the mode's
    own details. ``config`` stands in for (or overrides) the description the dump embeds.

    Raises:
        KvauditError: One line naming the file: an unknown request, group, layer or
            position, a token that is not valid, a head not on this worker, a mode that
            does not apply to the block, or a file that cannot be written.

    """
    path = os.fspath(source)
    target = os.fspath(out)
    if mode not in MODES:
        raise KvauditError(f"unknown mode {mode!r}, expected one of {', '.join(MODES)}", path)
    if os.path.isdir(path):
        raise KvauditError("is a directory; corrupt writes a copy of one dump file", path)
    dump = open_dump(path, config)
    block = _open_block(dump, request_id, group_id, position)
    if token is not None and mode in _WHOLE_BLOCK_MODES:
        raise block.fail(f"{mode} {_WHOLE_BLOCK_MODES[mode]}; it takes no token")
    rng = np.random.default_rng(seed)
    fault = _MODES[mode](block, layer, head, token, rng)

    offsets, values, changes = _changed_bytes(block, fault)
    if not any(change["tokens"] for change in changes):
        raise block.fail(f"{mode} would change no valid token of the block")
    _write_copy(path, target, offsets, values)
    result = {
        "source": path,
        "out": target,
        "mode": mode,
        "seed": seed,
        "request": request_id,
        "group": group_id,
        "position": position,
        "block": block.block_id,
        "row": block.row,
        "num_tokens": dump.requests[request_id].num_tokens,
        "layers": sorted({change["layer"] for change in changes}),
        "heads": sorted({change["head"] for change in changes}),
        "tokens": sorted({t for change in changes for t in change["tokens"]}),
        "changes": changes,
        "byte_ranges": _ranges(offsets),
    }
    result.update(fault.details)
    return result


def _open_block(dump: Dump, request_id: str, group_id: int, position: int) -> _Block:
    """The request's block at ``position``, checked to hold a checksummed layer and a
    valid token."""
    row, first, block_id = block_row(dump, request_id, group_id, position)
    views = group_views(dump, group_id)
    specs = layer_specs(dump.description, group_id)
    is_state = any(specs[view.name].is_state for view in views.views)
    num_tokens = dump.requests[request_id].num_tokens
    valid = counted_slots(position, views.group.block_size, is_state, num_tokens)
    block = _Block(
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


def _heads(block: _Block, layer: str | None, head: int | None) -> list[tuple[int, int]]:
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


def _token_index(block: _Block, token: int | None, rng: np.random.Generator) -> int:
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


def _needs_tokens(block: _Block, mode: str) -> None:
    """Raise unless the block holds two valid tokens (a state block holds one state)."""
    if block.is_state:
        raise block.fail(f"{mode} needs tokens, and a state block holds one state")
    if block.valid < 2:
        raise block.fail(f"{mode} needs two valid tokens, the block holds {block.valid}")


# Modes.


def _flip(
    block: _Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> _Fault:
    """One bit of one valid token's cell of one head."""
    pairs = _heads(block, layer, head)
    index, h = pairs[int(rng.integers(len(pairs)))]
    u = _token_index(block, token, rng)
    cells = block.cells(index).copy()
    bit = int(rng.integers(cells.shape[2] * 8))
    cells[h, u, bit // 8] ^= np.uint8(1 << (bit % 8))
    view = block.views[index]
    details = {
        "flip": {
            "layer": view.name,
            "head": view.first_head + h,
            "token": block.first + u,
            "byte": bit // 8,
            "bit": bit % 8,
        }
    }
    return _Fault([_Change(index, cells)], details)


def _selected(
    block: _Block, layer: str | None, head: int | None
) -> Iterator[tuple[int, list[int]]]:
    """Each view index with its local heads that ``layer`` and ``head`` allow."""
    by_view: dict[int, list[int]] = {}
    for index, h in _heads(block, layer, head):
        by_view.setdefault(index, []).append(h)
    yield from by_view.items()


def _zero(
    block: _Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> _Fault:
    """Every selected head's cells of the block set to zero."""
    changes = []
    for index, heads in _selected(block, layer, head):
        cells = block.cells(index).copy()
        cells[heads] = 0
        changes.append(_Change(index, cells))
    return _Fault(changes)


def _swap_tokens(
    block: _Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> _Fault:
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
            details = {"swap": {"layer": view.name, "head": view.first_head + h, "tokens": swapped}}
            return _Fault([_Change(index, cells)], details)
    raise block.fail("swap-tokens would change nothing: the candidate tokens hold the same KV")


def _swap_heads(
    block: _Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> _Fault:
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
        return _Fault([_Change(index, cells)], {"swap": {"layer": view.name, "heads": swapped}})
    raise block.fail("swap-heads would change nothing: the candidate heads hold the same KV")


def _stale(
    block: _Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> _Fault:
    """The selected heads' cells replaced by another row's that differ in a valid slot:
    another request's block first, else any other row of the dump."""
    selected = list(_selected(block, layer, head))
    dump = block.dump
    others: list[tuple[int, dict]] = []
    seen = {block.row}
    for request_id in sorted(dump.requests):
        if request_id == block.request_id:
            continue
        listed = dump.requests[request_id].groups.get(block.group_id)
        if listed is None:
            continue
        start, block_ids = listed
        for offset, block_id in enumerate(block_ids):
            row = dump.row_of(block_id)
            if row not in seen:
                seen.add(row)
                origin = {"request": request_id, "position": start + offset, "block": block_id}
                others.append((row, origin))
    rest = [
        (row, {"request": None, "position": None, "block": _block_id(dump, row)})
        for row in range(dump.num_rows)
        if row not in seen
    ]
    valid = slice(0, block.valid)
    for row, origin in _rotated(others, rng) + _rotated(rest, rng):
        changes = []
        differs = False
        for index, heads in selected:
            cells = block.cells(index).copy()
            replacement = read_block(block.views[index], row)
            cells[heads] = replacement[heads]
            differs = differs or not np.array_equal(
                cells[heads, valid], block.cells(index)[heads, valid]
            )
            changes.append(_Change(index, cells))
        if differs:
            return _Fault(changes, {"from": {**origin, "row": row}})
    raise block.fail("stale would change nothing: no other block of the dump differs")


def _block_id(dump: Dump, row: int) -> int:
    """The engine block a dump row holds."""
    return dump.block_ids[row] if dump.block_ids is not None else row


def _shift(
    block: _Block, layer: str | None, head: int | None, token: int | None, rng: np.random.Generator
) -> _Fault:
    """Each valid token of the selected heads given the previous token's cell."""
    _needs_tokens(block, "shift")
    changes = []
    for index, heads in _selected(block, layer, head):
        original = block.cells(index)
        cells = original.copy()
        for h in heads:
            cells[h, 1 : block.valid] = original[h, : block.valid - 1]
        changes.append(_Change(index, cells))
    return _Fault(changes)


_MODES: dict[
    str, Callable[[_Block, str | None, int | None, int | None, np.random.Generator], _Fault]
] = {
    "flip": _flip,
    "zero": _zero,
    "swap-tokens": _swap_tokens,
    "swap-heads": _swap_heads,
    "stale": _stale,
    "shift": _shift,
}


# Writing.


def _file_base(dump: Dump, view: LayerView) -> int:
    """The address the dump file's first byte has where the view's tensors map it."""
    pieces = view.parts[0].pieces
    return pieces.data_ptr() - dump.file_offset(pieces)


def _changed_bytes(block: _Block, fault: _Fault) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """The file offsets and new values of the bytes the fault changes, and per changed
    (layer, global head) its changed request positions."""
    length = os.path.getsize(block.dump.path)
    offsets, values, changes = [], [], []
    for change in sorted(fault.changes, key=lambda change: change.index):
        view = block.views[change.index]
        original = block.cells(change.index)
        differ = change.cells != original
        if not differ.any():
            continue
        addresses = cell_addresses(view, block.row) - _file_base(block.dump, view)
        if addresses.min() < 0 or addresses.max() >= length:
            raise block.fail(f"layer {view.name}: its cells lie outside the file's mapping")
        offsets.append(addresses[differ])
        values.append(change.cells[differ])
        cell_changed = differ.any(axis=2)
        for h in range(view.heads):
            slots = np.flatnonzero(cell_changed[h])
            if not len(slots):
                continue
            positions = [block.first + int(u) for u in slots]
            end = block.first + block.valid
            changes.append(
                {
                    "layer": view.name,
                    "head": view.first_head + h,
                    "tokens": [t for t in positions if t < end],
                    "tokens_past_end": [t for t in positions if t >= end],
                }
            )
    if not offsets:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8), []
    all_offsets = np.concatenate(offsets)
    all_values = np.concatenate(values)
    order = np.argsort(all_offsets, kind="stable")
    return all_offsets[order], all_values[order], changes


def _ranges(offsets: np.ndarray) -> list[list[int]]:
    """Sorted byte offsets as ``[start, end)`` runs."""
    if not len(offsets):
        return []
    breaks = np.flatnonzero(np.diff(offsets) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(offsets)]])
    return [[int(offsets[s]), int(offsets[e - 1]) + 1] for s, e in zip(starts, ends)]


def _write_copy(source: str, target: str, offsets: np.ndarray, values: np.ndarray) -> None:
    """A copy of ``source`` with the bytes at ``offsets`` set, written whole over ``target``."""
    with atomic_path(target) as temporary:
        shutil.copyfile(source, temporary)
        data = np.memmap(temporary, dtype=np.uint8, mode="r+")
        data[offsets] = values
        data.flush()
        del data
