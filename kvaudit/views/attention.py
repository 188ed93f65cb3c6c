"""Attention caches as piece views: a layer's tensor (or K/V pair) in its layout viewed as
``[blocks, kernel_blocks, heads, tokens, pieces]`` parts, one per stored row kind.
"""

from __future__ import annotations

from ..core.arrays import (
    Array,
    element_size,
    matches_dtype,
    permute,
    reinterpret,
    strides,
    unflatten,
    unsqueeze,
)
from ..core.dtypes import dtype_name
from ..core.errors import UnsupportedGroupError
from ..description import LayerSpec
from .model import LayerTensor, PieceView


def attention_parts(spec: LayerSpec, tensor: LayerTensor, num_blocks: int) -> tuple[PieceView, ...]:
    """An attention cache as one piece view per stored row kind (cell, or K and V)."""
    layout = spec.layout
    if "N" not in layout:
        raise UnsupportedGroupError(
            f"its layout {layout} has no N (kernel blocks) axis: a token-major layout is only "
            "read from ExampleConnector folders"
        )
    kernel_blocks = spec.block_size // spec.kernel_block_size
    sizes = spec.axis_sizes(kernel_blocks=num_blocks * kernel_blocks)
    if "D" in layout and "K" not in layout:
        if not isinstance(tensor, tuple):
            raise UnsupportedGroupError(
                f"its layout {layout} stores K and V apart, but one tensor was given"
            )
        k_rows = _rows(tensor[0], layout, {**sizes, "D": spec.head_size}, spec, kernel_blocks)
        v_rows = _rows(tensor[1], layout, {**sizes, "D": spec.head_size_v}, spec, kernel_blocks)
        row_pieces = [_as_pieces(rows) for rows in (k_rows, v_rows)]
    else:
        if isinstance(tensor, tuple):
            raise UnsupportedGroupError(
                f"its layout {layout} stores K and V together, but a K/V pair was given"
            )
        if "K" in layout and spec.head_size != spec.head_size_v:
            raise UnsupportedGroupError(
                f"its layout {layout} has a K/V plane but K and V rows of different sizes"
            )
        rows = _rows(tensor, layout, sizes, spec, kernel_blocks)
        if "C" in layout and spec.head_size_v:
            _check_kv_rows(spec, element_size(rows))
        row_pieces = (
            [_as_pieces(rows[:, i]) for i in range(2)] if "K" in layout else [_as_pieces(rows)]
        )
    cell_pieces = sum(pieces.shape[-1] for pieces in row_pieces)
    k_pieces = 0
    if "C" in layout and spec.head_size_v and len(row_pieces) == 1:
        k_pieces = spec.head_size * cell_pieces // (spec.head_size + spec.head_size_v)
    parts = []
    offset = 0
    for pieces in row_pieces:
        if pieces.shape[-1]:
            blocked = unflatten(pieces, 0, (num_blocks, kernel_blocks))
            parts.append(PieceView(blocked, offset, cell_pieces, k_pieces))
        offset += pieces.shape[-1]
    return tuple(parts)


def _rows(
    tensor: Array,
    layout: str,
    sizes: dict[str, int],
    spec: LayerSpec,
    kernel_blocks: int,
) -> Array:
    """The tensor's logical axes in the order ``N, [K,] H, T, D|C`` (a view)."""
    expected = tuple(sizes[letter] for letter in layout)
    if tuple(tensor.shape) != expected:
        raise UnsupportedGroupError(
            f"its cache of shape {tuple(tensor.shape)} does not match layout {layout} "
            f"{expected} ({kernel_blocks} kernel blocks of {spec.kernel_block_size} tokens "
            f"per {spec.block_size}-token block)"
        )
    if not matches_dtype(tensor, spec.dtype):
        raise UnsupportedGroupError(
            f"its cache is {dtype_name(tensor.dtype)}, the description says "
            f"{dtype_name(spec.dtype)}"
        )
    if "H" not in layout:
        # A one-head axis just outside the row axis, so its stride is the row's length and
        # the row can still be viewed as 8-byte pieces.
        row = layout.index("C" if "C" in layout else "D")
        tensor = unsqueeze(tensor, row)
        layout = layout[:row] + "H" + layout[row:]
    row_axis = "C" if "C" in layout else "D"
    order = [letter for letter in ("N", "K", "H", "T", row_axis) if letter in layout]
    return permute(tensor, [layout.index(letter) for letter in order])


def _check_kv_rows(spec: LayerSpec, itemsize: int) -> None:
    """Refuse a cell of K then V whose K or V row is not whole 8-byte pieces: stored apart
    (layout ``D``) the same rows could not be read, and the group is covered in no layout."""
    k_bytes, v_bytes = spec.head_size * itemsize, spec.head_size_v * itemsize
    if k_bytes % 8 or v_bytes % 8:
        raise UnsupportedGroupError(
            f"its K and V rows of {k_bytes} and {v_bytes} bytes are not whole 8-byte pieces"
        )


def _as_pieces(rows: Array) -> Array:
    """Rows ``[..., elements]`` as 8-byte pieces ``[..., pieces]`` (a view)."""
    row_bytes = rows.shape[-1] * element_size(rows)
    if row_bytes % 8:
        raise UnsupportedGroupError(f"its rows of {row_bytes} bytes are not whole 8-byte pieces")
    if rows.shape[-1] > 1 and strides(rows)[-1] != 1:
        raise UnsupportedGroupError("its KV rows are not contiguous in memory")
    try:
        return reinterpret(rows, 8)
    except RuntimeError as error:
        raise UnsupportedGroupError("its KV rows are not 8-byte aligned") from error
