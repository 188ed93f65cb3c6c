"""The cells of a block row: where a request's block lies in a worker's raw KV, a row of a
``LayerView`` read as its cells' bytes (``read_block``) and as their memory addresses
(``cell_addresses``), and how a cell reads as values. Shared with ``kvaudit.corrupt``, so
that a planted fault and its location agree on the layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..core.arrays import data_ptr, element_size, host_array, permute, strides
from ..core.dtypes import DType, dtype_size
from ..core.errors import KvauditError
from ..core.scheme import valid_tokens
from ..description import CacheDescription, LayerSpec
from ..views import GroupViews, LayerView
from ..workers import RawWorker

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CellSegment:
    """Bytes ``start .. end - 1`` of a cell, read as elements of ``dtype``."""

    start: int
    end: int
    dtype: DType | torch.dtype


def piece_bytes(view: LayerView) -> int:
    """The size of one piece of the view's cells: 8, or 2 or 4 for TP-split state rows."""
    return element_size(view.parts[0].pieces)


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
        pieces = permute(part.pieces[row], (1, 0, 2, 3))  # [heads, kernel blocks, tokens, pieces]
        count = pieces.shape[-1]
        values = host_array(pieces).reshape(view.heads, -1, count)
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
        steps = strides(pieces)
        base = data_ptr(pieces) + row * steps[0] * size
        k, h, t, p = np.ix_(
            np.arange(kernel_blocks), np.arange(heads), np.arange(tokens), np.arange(count)
        )
        elements = base + size * (k * steps[1] + h * steps[2] + t * steps[3] + p * steps[4])
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
    groups = dump.array_views
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
    return dump.row_of(block_id, group_id), position * block_size, block_id
