"""Narrowing a differing block down: which layers, heads, tokens and bytes differ.

Given a producer's and a consumer's raw KV (``kvaudit.sources.raw.RawWorker``: dumps or
live tensors, one per worker) and a block position at which their checksums differ,
``locate_differences`` reads only that position's block rows on both sides and
compares the cells of each (layer, global head) slice byte by byte: the tokens whose cells
differ, the first differing byte and the largest errors of the differing elements read in
their dtype. A consumer replica is also compared with replica 0 of the same heads.

The helpers that map a block row of a ``LayerView`` to its cells (``read_block``) and to
the memory addresses of the cells' bytes (``cell_addresses``) are shared with
``kvaudit.corrupt``, so that a planted fault and its location agree on the layout.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .compare.model import LocatedDifference
from .description import CacheDescription, LayerSpec
from .dtypes import dtype_size, torch_dtype
from .errors import KvauditError
from .scheme import valid_tokens
from .sources.raw import RawWorker
from .views import GroupViews, LayerView

if TYPE_CHECKING:
    import torch

# Cells of a block row.


@dataclass(frozen=True)
class CellSegment:
    """Bytes ``start .. end - 1`` of a cell, read as elements of ``dtype``."""

    start: int
    end: int
    dtype: torch.dtype


def piece_bytes(view: LayerView) -> int:
    """The size of one piece of the view's cells: 8, or 2 or 4 for TP-split state rows."""
    return view.parts[0].pieces.element_size()


def cell_bytes(view: LayerView) -> int:
    """The bytes of one cell of the view."""
    return view.parts[0].cell_pieces * piece_bytes(view)


def block_tokens(view: LayerView) -> int:
    """The cells per head in one block row: kernel blocks times their tokens (1 for states)."""
    shape = view.parts[0].pieces.shape
    return shape[1] * shape[3]


def read_block(view: LayerView, row: int) -> np.ndarray:
    """A copy of one block row's cells, uint8 ``[heads, tokens, cell bytes]``; token ``u``
    is the manager block's token ``k * T + t`` of kernel block ``k``, and each cell is its
    parts (K row then V row) in piece order."""
    size = piece_bytes(view)
    out = np.empty((view.heads, block_tokens(view), cell_bytes(view)), dtype=np.uint8)
    for part in view.parts:
        pieces = part.pieces[row].permute(1, 0, 2, 3)  # [heads, kernel blocks, tokens, pieces]
        count = pieces.shape[-1]
        values = pieces.reshape(view.heads, -1, count).contiguous().cpu().numpy()
        start = part.piece_offset * size
        out[:, :, start : start + count * size] = values.view(np.uint8).reshape(
            view.heads, -1, count * size
        )
    return out


def cell_addresses(view: LayerView, row: int) -> np.ndarray:
    """The memory address of every byte of one block row's cells, int64 ``[heads, tokens,
    cell bytes]`` in the order ``read_block`` returns them (little-endian pieces)."""
    size = piece_bytes(view)
    out = np.empty((view.heads, block_tokens(view), cell_bytes(view)), dtype=np.int64)
    for part in view.parts:
        pieces = part.pieces
        _, kernel_blocks, heads, tokens, count = pieces.shape
        strides = pieces.stride()
        base = pieces.data_ptr() + row * strides[0] * size
        k, h, t, p = np.ix_(
            np.arange(kernel_blocks), np.arange(heads), np.arange(tokens), np.arange(count)
        )
        elements = base + size * (k * strides[1] + h * strides[2] + t * strides[3] + p * strides[4])
        addresses = elements.transpose(1, 0, 2, 3)[..., None] + np.arange(size)
        start = part.piece_offset * size
        out[:, :, start : start + count * size] = addresses.reshape(heads, -1, count * size)
    return out


def layer_specs(description: CacheDescription, group_id: int) -> dict[str, LayerSpec]:
    """Each layer of a group with the spec of the cache it holds (a sharing layer: the
    spec of the layer it shares)."""
    by_name = {entry.name: entry for group in description.groups for entry in group.layers}
    return {
        entry.name: by_name[entry.shares].spec if entry.shares in by_name else entry.spec
        for entry in description.group(group_id).layers
    }


def cell_segments(spec: LayerSpec, view: LayerView) -> tuple[CellSegment, ...]:
    """How a view's cell reads as values: the layer's dtype, or for unsplit states each
    checksummed state in its own dtype."""
    size = cell_bytes(view)
    if spec.is_state and spec.state_splits is None:
        segments = []
        offset = 0
        for shape, dtype in zip(
            spec.shapes[: spec.covered_states], spec.dtypes[: spec.covered_states]
        ):
            nbytes = math.prod(shape) * dtype_size(dtype)
            segments.append(CellSegment(offset, offset + nbytes, dtype))
            offset += nbytes
        if offset == size:
            return tuple(segments)
    return (CellSegment(0, size, view.dtype),)


def counted_slots(position: int, block_size: int, is_state: bool, num_tokens: int) -> int:
    """How many leading slots (block indices ``u``) of the block at ``position`` count:
    its valid tokens, or for a state block its one state when it holds a valid token."""
    valid = int(valid_tokens(num_tokens, block_size, position))
    return min(valid, 1) if is_state else valid


def group_views(dump: RawWorker, group_id: int) -> GroupViews:
    """A worker's views of one group, as its checksummer builds them.

    Raises:
        KvauditError: The group is not a group of the dump, or it is not covered.

    """
    groups = dump.group_views
    views = groups.get(group_id)
    if views is None:
        known = ", ".join(str(gid) for gid in sorted(groups)) or "none"
        raise KvauditError(
            f"no group {group_id} in this dump (its groups: {known})", source=dump.name
        )
    if not views.covered:
        raise KvauditError(f"group {group_id} is not covered: {views.reason}", source=dump.name)
    return views


def block_row(
    dump: RawWorker, request_id: str, group_id: int, position: int
) -> tuple[int, int, int]:
    """The row, first request position and engine block id of a request's block at
    ``position`` (in the worker's block size of the group).

    Raises:
        KvauditError: The request, its group or the position is not in the dump.

    """
    request = dump.requests.get(request_id)
    if request is None:
        raise KvauditError(f"no request {request_id!r} in this dump", source=dump.name)
    listed = request.groups.get(group_id)
    if listed is None:
        raise KvauditError(
            f"request {request_id!r} has no blocks of group {group_id} in this dump",
            source=dump.name,
        )
    start, block_ids = listed
    if not start <= position < start + len(block_ids):
        held = f"{start}..{start + len(block_ids) - 1}" if block_ids else "none"
        raise KvauditError(
            f"request {request_id!r} group {group_id}: position {position} is not in this "
            f"dump (positions held: {held})",
            source=dump.name,
        )
    block_id = block_ids[position - start]
    block_size = dump.description.group(group_id).block_size
    return dump.row_of(block_id), position * block_size, block_id


# Gathering one side's cells.


@dataclass(frozen=True)
class SliceCells:
    """One (layer, global head, replica) of one side: its cells ``[tokens, cell bytes]`` at
    some request positions ``tokens`` (sorted, each once), with the layer number and how
    a cell reads as values."""

    number: int
    segments: tuple[CellSegment, ...]
    tokens: np.ndarray
    cells: np.ndarray
    worker: tuple[int, int] = (0, 0)
    file: str = ""


SliceId = tuple[str, int, int]
"""``(layer name, global head, replica index)``."""


@dataclass
class SliceReader:
    """One side's workers that hold a request's group, with their views of the group
    (covered ones only) and its layers' specs."""

    workers: list[tuple[RawWorker, GroupViews, dict[str, LayerSpec]]]

    @classmethod
    def open(cls, raw: Sequence[RawWorker], request_id: str, group_id: int) -> SliceReader:
        """The workers of ``raw`` that list blocks of the request's group and cover it."""
        workers = []
        for dump in raw:
            request = dump.requests.get(request_id)
            if request is None or group_id not in request.groups:
                continue
            views = dump.group_views.get(group_id)
            if views is None or not views.covered:
                continue
            workers.append((dump, views, layer_specs(dump.description, group_id)))
        return cls(workers)

    def gather(
        self,
        request_id: str,
        group_id: int,
        lo: int,
        hi: int,
        layers: Collection[str] | None = None,
    ) -> dict[SliceId, SliceCells]:
        """The cells of request positions ``lo .. hi - 1`` (a state block: its first
        position) from every worker that holds them; only ``layers`` where given."""
        kinds: dict[SliceId, tuple[int, tuple[CellSegment, ...], RawWorker]] = {}
        tokens: dict[SliceId, list[np.ndarray]] = defaultdict(list)
        cells: dict[SliceId, list[np.ndarray]] = defaultdict(list)
        for dump, views, specs in self.workers:
            start, block_ids = dump.requests[request_id].groups[group_id]
            block_size = views.group.block_size
            for view in views.views:
                if layers is not None and view.name not in layers:
                    continue
                spec = specs[view.name]
                for position in _positions(lo, hi, block_size, spec.is_state):
                    if not start <= position < start + len(block_ids):
                        continue
                    first = position * block_size
                    if spec.is_state:
                        used = np.array([0])
                    else:
                        used = np.arange(max(lo, first), min(hi, first + block_size)) - first
                    block = read_block(view, dump.row_of(block_ids[position - start]))[:, used]
                    for h in range(view.heads):
                        key = (view.name, view.first_head + h, view.replica_key[1])
                        if key not in kinds:
                            kinds[key] = (view.number, cell_segments(spec, view), dump)
                        tokens[key].append(first + used)
                        cells[key].append(block[h])
        result = {}
        for key, (number, segments, dump) in kinds.items():
            held, index = np.unique(np.concatenate(tokens[key]), return_index=True)
            worker = (dump.worker.tp_rank, dump.worker.pp_rank)
            cells_held = np.concatenate(cells[key])[index]
            result[key] = SliceCells(number, segments, held, cells_held, worker, dump.name)
        return result


def _positions(lo: int, hi: int, block_size: int, is_state: bool) -> range:
    """A side's block positions that hold request positions ``lo .. hi - 1`` (state blocks:
    whose first position lies there)."""
    if hi <= lo:
        return range(0)
    if is_state:
        return range(-(-lo // block_size), -(-hi // block_size))
    return range(lo // block_size, (hi - 1) // block_size + 1)


# Comparing cells.


def element_errors(
    reference: np.ndarray, other: np.ndarray, segments: Sequence[CellSegment]
) -> tuple[float, float]:
    """The largest absolute and relative error over the elements whose bytes differ, in
    uint8 cells ``[tokens, cell bytes]`` read as the segments' dtypes.

    The relative error is relative to the reference value (infinite where the reference
    is 0 and the other is not); a NaN on one side only counts as an infinite error, NaN on
    both sides as none.
    """
    max_abs = 0.0
    max_rel = 0.0
    for segment in segments:
        size = dtype_size(segment.dtype)
        a = np.ascontiguousarray(reference[:, segment.start : segment.end]).reshape(-1, size)
        b = np.ascontiguousarray(other[:, segment.start : segment.end]).reshape(-1, size)
        differ = (a != b).any(axis=1)
        if not differ.any():
            continue
        abs_errors, rel_errors = _errors(a[differ], b[differ], segment.dtype)
        max_abs = max(max_abs, float(abs_errors.max()))
        max_rel = max(max_rel, float(rel_errors.max()))
    return max_abs, max_rel


def _errors(a: np.ndarray, b: np.ndarray, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Absolute and relative errors of elements given as their bytes ``[n, size]``."""
    if dtype.is_floating_point:
        x = _elements(a, dtype)
        y = _elements(b, dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            abs_errors = np.abs(x - y)
        one_nan = np.isnan(x) != np.isnan(y)
        both_nan = np.isnan(x) & np.isnan(y)
        abs_errors[one_nan] = np.inf
        abs_errors[both_nan] = 0.0
        reference = np.abs(x)
    else:
        # Python integers: exact differences, even of 64-bit values beyond float precision.
        xs = _elements(a, dtype).tolist()
        ys = _elements(b, dtype).tolist()
        abs_errors = np.array([float(abs(x - y)) for x, y in zip(xs, ys)])
        reference = np.array([float(abs(x)) for x in xs])
    rel_errors = np.zeros_like(abs_errors)
    nonzero = abs_errors != 0
    infinite = nonzero & (np.isinf(abs_errors) | (reference == 0) | ~np.isfinite(reference))
    rel_errors[infinite] = np.inf
    finite = nonzero & ~infinite
    rel_errors[finite] = abs_errors[finite] / reference[finite]
    return abs_errors, rel_errors


def _elements(raw: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Elements given as their bytes ``[n, size]``: float64 values of a floating dtype,
    else the integers (a bool element as its byte)."""
    import torch

    values = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1))
    if dtype.is_floating_point:
        return values.view(torch_dtype(dtype)).to(torch.float64).numpy()
    return values.view(torch.uint8 if dtype == torch.bool else torch_dtype(dtype)).numpy()


def _located_entry(
    position: int, name: str, head: int, reference: SliceCells, other: SliceCells, replica: int
) -> LocatedDifference | None:
    """The located entry of one slice pair at the tokens both hold, or None when their
    cells agree there; ``replica`` (when not 0) is the consumer replica compared."""
    tokens, index_a, index_b = np.intersect1d(reference.tokens, other.tokens, return_indices=True)
    a, b = reference.cells[index_a], other.cells[index_b]
    if a.shape[1] != b.shape[1]:
        return None
    differ = a != b
    rows = np.flatnonzero(differ.any(axis=1))
    if not len(rows):
        return None
    max_abs, max_rel = element_errors(a[rows], b[rows], reference.segments)
    return LocatedDifference(
        position=position,
        layer=name,
        head=head,
        tokens=[int(t) for t in tokens[rows]],
        first_byte=int(np.argmax(differ[rows[0]])),
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        replica=replica,
        consumer_worker=other.worker,
        file=other.file,
    )


# Locating.


def locate_differences(
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    request_id: str,
    group_id: int,
    positions: Iterable[int],
    block_size: int,
    num_tokens: int,
) -> list[LocatedDifference]:
    """The (layer, global head) slices that differ at each of ``positions`` (numbered in
    blocks of ``block_size`` tokens, which may be coarser than either side's), with their
    differing request positions, first differing byte and largest errors.

    Position ``p`` covers request positions ``p * block_size .. p * block_size +
    block_size - 1`` below ``num_tokens``. Producer replica 0 is compared with consumer
    replica 0; each consumer replica ``r > 0`` with consumer replica 0 (its entries have
    ``replica == r``). Only the blocks of those positions are read. Entries are sorted by
    position, replica, layer number, layer name and head.

    Raises:
        KvauditError: ``block_size`` is not positive.

    """
    if block_size < 1:
        raise KvauditError(f"block size must be positive, got {block_size}")
    sides = [SliceReader.open(raw, request_id, group_id) for raw in (producer, consumer)]
    entries: list[LocatedDifference] = []
    for position in sorted(set(positions)):
        lo = position * block_size
        hi = lo + int(valid_tokens(num_tokens, block_size, position))
        if hi <= lo:
            continue
        produced, consumed = (side.gather(request_id, group_id, lo, hi) for side in sides)
        found = []
        for (name, head, replica), item in consumed.items():
            # Replica 0 is checked against the producer, another replica against replica 0.
            reference = (consumed if replica else produced).get((name, head, 0))
            if reference is None:
                continue
            entry = _located_entry(position, name, head, reference, item, replica)
            if entry is not None:
                found.append(((replica, item.number, name, head), entry))
        found.sort(key=lambda pair: pair[0])
        entries.extend(entry for _, entry in found)
    return entries
