"""Reading one side's raw KV as values for ``kvaudit.numeric``: the workers that hold a
request's group, its attention layers, and batches of request positions decoded into
``[heads, tokens, elements]`` float arrays (whole block rows copied once, decoded in
place, the mapped pages dropped after each batch)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .arrays import is_numpy
from .description import LayerSpec
from .dtypes import DType
from .elements import decode, work_dtype
from .locate import cell_bytes, layer_specs, piece_bytes
from .sources.raw import RawWorker
from .views import GroupViews, LayerView

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LayerValues:
    """One layer of a side's group: number, global heads, elements per cell, dtype and
    the scales of its K and V elements."""

    number: int
    heads: int
    elements: int
    head_size: int
    dtype: DType
    scales: tuple[float | None, float | None]


def read_rows(view: LayerView, rows: Sequence[int]) -> np.ndarray:
    """A copy of block rows' cells, uint8 ``[rows, kernel blocks, heads, kernel block
    tokens, cell bytes]`` (each cell its parts, K row then V row, in piece order)."""
    size = piece_bytes(view)
    pieces = [_picked(part.pieces, rows) for part in view.parts]
    if len(pieces) == 1:
        return pieces[0]
    out = np.empty((*pieces[0].shape[:-1], cell_bytes(view)), dtype=np.uint8)
    for part, raw in zip(view.parts, pieces):
        start = part.piece_offset * size
        out[..., start : start + raw.shape[-1]] = raw
    return out


def _picked(pieces: np.ndarray | torch.Tensor, rows: Sequence[int]) -> np.ndarray:
    """One part's pieces of the rows as bytes ``[rows, kernel blocks, heads, tokens, part
    bytes]``: whole rows copied, in one pass."""
    if is_numpy(pieces):
        picked = np.take(pieces, list(rows), axis=0)
    else:
        import torch

        index = torch.as_tensor(list(rows), dtype=torch.long, device=pieces.device)
        picked = pieces.index_select(0, index).cpu().numpy()
    return picked.view(np.uint8).reshape(*picked.shape[:-1], -1)


SideWorker = tuple[RawWorker, GroupViews, dict[str, LayerSpec]]


def side_workers(raw: Sequence[RawWorker], request_id: str, group_id: int) -> list[SideWorker]:
    """The workers that list the request's group and cover it."""
    found = []
    for worker in raw:
        request = worker.requests.get(request_id)
        views = worker.group_views.get(group_id)
        if request is None or group_id not in request.groups or views is None:
            continue
        if views.covered:
            found.append((worker, views, layer_specs(worker.description, group_id)))
    return found


def side_layers(side: list[SideWorker]) -> dict[str, LayerValues]:
    """The attention layers a side's workers hold (states are compared by checksum only)."""
    layers: dict[str, LayerValues] = {}
    for _, views, specs in side:
        for view in views.views:
            spec = specs[view.name]
            if spec.is_state:
                continue
            heads = view.first_head + view.heads
            seen = layers.get(view.name)
            if seen is not None:
                heads = max(heads, seen.heads)
            scales = (spec.k_scale, spec.v_scale)
            elements = spec.head_size + spec.head_size_v
            layers[view.name] = LayerValues(
                view.number, heads, elements, spec.head_size, view.dtype, scales
            )
    return layers


def gather(
    side: list[SideWorker],
    layers: Mapping[str, LayerValues],
    request_id: str,
    group_id: int,
    lo: int,
    hi: int,
    out_dtypes: Mapping[str, type[np.floating]],
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """Per layer, the values ``[heads, hi - lo, elements]`` of request positions ``lo ..
    hi - 1`` (zero where not held) and which ``[heads, hi - lo]`` are held; and the bytes
    read."""
    out = {
        name: (
            np.zeros((layer.heads, hi - lo, layer.elements), dtype=out_dtypes[name]),
            np.zeros((layer.heads, hi - lo), dtype=bool),
        )
        for name, layer in layers.items()
    }
    read = 0
    for worker, views, _ in side:
        start, block_ids = worker.requests[request_id].groups[group_id]
        block_size = views.group.block_size
        first = max(lo // block_size, start)
        last = min((hi - 1) // block_size, start + len(block_ids) - 1)
        if last < first:
            continue
        rows = [worker.row_of(block_ids[p - start]) for p in range(first, last + 1)]
        # Request positions first * block_size + u; those in lo .. hi - 1 are consecutive.
        skip = max(lo - first * block_size, 0)
        count = min(hi, (last + 1) * block_size) - max(lo, first * block_size)
        target = slice(first * block_size + skip - lo, first * block_size + skip - lo + count)
        for view in views.views:
            layer = layers.get(view.name)
            if layer is None or view.replica_key[1] != 0:
                continue
            block = read_rows(view, rows)
            read += block.nbytes
            heads = slice(view.first_head, view.first_head + view.heads)
            buffer, held = out[view.name]
            values = buffer[heads, target]
            cells = block.transpose(2, 0, 1, 3, 4)  # heads first, a view
            if skip == 0 and count == len(rows) * block_size:
                # Splitting the token axis of a slice of the buffer: a view, never a copy
                # (setting ``shape`` raises rather than copy).
                target_view = values.view()
                target_view.shape = (*cells.shape[:-1], values.shape[-1])
                decode(cells, view.dtype, target_view)
            else:
                whole = np.ascontiguousarray(cells).reshape(view.heads, len(rows) * block_size, -1)
                decode(whole[:, skip : skip + count], view.dtype, values)
            k_scale, v_scale = layer.scales
            if k_scale is not None:
                values[..., : layer.head_size] *= k_scale
            if v_scale is not None:
                values[..., layer.head_size :] *= v_scale
            held[heads, target] = True
    return out, read


def read_side(
    side: list[SideWorker],
    layers: Mapping[str, LayerValues],
    common: Sequence[str],
    request: tuple[str, int],
    lo: int,
    hi: int,
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], int]:
    """One side's values of the common layers at positions ``lo .. hi - 1`` (``gather``),
    its mapped pages dropped after."""
    wanted = {name: layers[name] for name in common}
    dtypes = {name: work_dtype(layer.dtype) for name, layer in wanted.items()}
    values, read = gather(side, wanted, *request, lo, hi, dtypes)
    for worker, _, _ in side:
        worker.drop_pages()
    return values, read


def batch_tokens(sides: Sequence[list[SideWorker]], batch_bytes: int) -> int:
    """Tokens per batch: a multiple of every block size of both sides, about
    ``batch_bytes`` of cells on the larger side."""
    unit = math.lcm(*(views.group.block_size for side in sides for _, views, _ in side))
    per_token = max(
        sum(view.heads * cell_bytes(view) for _, views, _ in side for view in views.views)
        for side in sides
    )
    return max(unit, batch_bytes // max(per_token, 1) // unit * unit)
