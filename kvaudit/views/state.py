"""State caches (Mamba-like) as piece views: a page's covered states as one cell, or, for
TP-split states, each global row along a state's split axis as one slice.
"""

from __future__ import annotations

import itertools
import math

from ..core.arrays import Array, as_strided, data_ptr, movedim, reinterpret, strides, unflatten
from ..core.dtypes import UINT8, dtype_name, dtype_size
from ..core.errors import UnsupportedGroupError
from ..description import LayerSpec
from .model import LocalCache, PieceView


def state_pages(tensor: Array, num_blocks: int) -> Array:
    """A state cache as ``[blocks, page bytes]`` (a view)."""
    if len(tensor.shape) < 1 or tensor.shape[0] != num_blocks:
        raise UnsupportedGroupError(
            f"its state cache of shape {tuple(tensor.shape)} does not hold {num_blocks} blocks"
        )
    try:
        pages = tensor.reshape(num_blocks, -1) if len(tensor.shape) != 2 else tensor
        if data_ptr(pages) != data_ptr(tensor) or (pages.shape[1] > 1 and strides(pages)[1] != 1):
            raise RuntimeError
        return reinterpret(pages, 1)
    except RuntimeError as error:
        raise UnsupportedGroupError("its state pages are not contiguous in memory") from error


def state_caches(spec: LayerSpec, pages: Array, num_blocks: int, tp_size: int) -> list[LocalCache]:
    """Unsplit states: the leading covered states of each page are one cell."""
    covered = sum(
        math.prod(shape) * dtype_size(dtype)
        for shape, dtype in zip(
            spec.shapes[: spec.covered_states], spec.dtypes[: spec.covered_states]
        )
    )
    if covered == 0:
        # An empty cell would checksum to 0 whatever the states hold: no check at all.
        raise UnsupportedGroupError(
            "none of its states is checksummed (checksummed_states: 0)"
            if spec.covered_states == 0
            else "its checksummed states hold no bytes"
        )
    if covered > pages.shape[1]:
        raise UnsupportedGroupError(
            f"its pages of {pages.shape[1]} bytes are smaller than its {covered} bytes of states"
        )
    if covered % 8:
        raise UnsupportedGroupError(f"its {covered} bytes of states are not whole 8-byte pieces")
    try:
        pieces = reinterpret(pages[:, :covered], 8)
    except RuntimeError as error:
        raise UnsupportedGroupError("its state pages are not 8-byte aligned") from error
    replicas = tp_size if spec.tp_replicated else 1
    part = PieceView(pieces[:, None, None, None, :], 0, pieces.shape[1])
    dtype = spec.dtypes[0] if spec.dtypes else UINT8
    return [LocalCache(1, replicas, (part,), dtype, 0, tp_size // replicas)]


def split_state_caches(
    spec: LayerSpec, pages: Array, num_blocks: int, tp_size: int
) -> list[LocalCache]:
    """TP-split states: each global row along a state's split axis is one slice of its
    elements (2- or 4-byte, zero-extended), numbered across the states in global order."""
    assert spec.state_splits is not None
    caches: list[LocalCache] = []
    offset = 0
    global_rows = 0
    for index, (shape, dtype, split) in enumerate(zip(spec.shapes, spec.dtypes, spec.state_splits)):
        size = dtype_size(dtype)
        if size not in (2, 4):
            raise UnsupportedGroupError(
                f"its state {index} of {dtype_name(dtype)} is not of 2- or 4-byte elements"
            )
        nbytes = math.prod(shape) * size
        if offset + nbytes > pages.shape[1]:
            raise UnsupportedGroupError(
                f"its pages of {pages.shape[1]} bytes are smaller than its states"
            )
        if sum(local for local, _ in split.segments) != shape[split.axis]:
            raise UnsupportedGroupError(
                f"the segments of its state {index} do not add up to its split axis of "
                f"{shape[split.axis]} rows"
            )
        try:
            elements = reinterpret(pages[:, offset : offset + nbytes], size)
        except RuntimeError as error:
            raise UnsupportedGroupError(f"its state {index} is not aligned") from error
        offset += nbytes
        # [blocks, rows, other axes...]: the split axis first, the rest in C order.
        rows = movedim(unflatten(elements, 1, shape), split.axis + 1, 1)
        row_parts = _row_pieces(rows)
        local_first = 0
        for local, replicas in split.segments:
            if tp_size % replicas:
                raise UnsupportedGroupError(
                    f"its state {index} has {replicas} replicas, which do not divide "
                    f"TP size {tp_size}"
                )
            parts = tuple(
                PieceView(
                    part[:, None, local_first : local_first + local, None, :],
                    piece_offset,
                    cell_pieces,
                )
                for part, piece_offset, cell_pieces in row_parts
            )
            caches.append(
                LocalCache(
                    heads=local,
                    replicas=replicas,
                    parts=parts,
                    dtype=dtype,
                    first_head=global_rows,
                    global_heads=local * tp_size // replicas,
                )
            )
            local_first += local
            global_rows += local * tp_size // replicas
    return caches


def _row_pieces(rows: Array) -> list[tuple[Array, int, int]]:
    """``[blocks, rows, a, b, ...]`` as ``[blocks, rows, pieces]`` parts, each with its
    piece offset and the row's piece count: one part when the other axes merge into one
    strided axis, else one part per index of the leading other axis."""
    cell_pieces = math.prod(rows.shape[2:])
    if len(rows.shape) == 2:
        return [(rows[:, :, None], 0, 1)]

    def split(tensor: Array, offset: int) -> list[tuple[Array, int, int]]:
        merged = _merge_axes(tensor)
        if merged is not None:
            return [(merged, offset, cell_pieces)]
        inner = math.prod(tensor.shape[3:])
        return [
            part
            for i in range(tensor.shape[2])
            for part in split(tensor[:, :, i], offset + i * inner)
        ]

    return split(rows, 0)


def _merge_axes(tensor: Array) -> Array | None:
    """Axes 2.. of ``tensor`` merged into one strided axis, if their strides allow."""
    axes = [(n, s) for n, s in zip(tensor.shape[2:], strides(tensor)[2:]) if n != 1]
    for (_, outer), (size, inner) in itertools.pairwise(axes):
        if outer != inner * size:
            return None
    stride = axes[-1][1] if axes else 1
    count = math.prod(n for n, _ in axes)
    return as_strided(tensor, (*tensor.shape[:2], count), (*strides(tensor)[:2], stride))
