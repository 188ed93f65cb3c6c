"""The GPU backend: one Triton launch adds the checksums of many layer parts into their columns.

The contract is the one of docs/architecture.md ("The kernel contract"): for each row ``i``
(block id, first token, valid tokens), table entry ``e``, kernel block ``k``, local head
``h``, token ``t`` and piece ``p``, with ``u = k * T + t``::

    if u < valid_tokens[i]:
        j = (first_tokens[i] + u) * cell_pieces[e] + piece_offset[e] + p
        out[i, column[e]] += (2 * (first_slice[e] + h) + 1) * x * (2 * j + 1)   (mod 2**64)

Every entry is a view with the template's shape, strides and dtype, placed by its element
offset from the template's first element. With ``TRITON_INTERPRET=1`` set before Triton is
imported, the same code runs on CPU tensors (slowly, for tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.errors import KvauditError
from . import LaunchPart
from .triton_tiling import (
    MAX_GRID_YZ,
    kernel_arguments,
    launch_config,
    layout_is_aligned,
)

TABLE_FIELDS = 5
"""Columns of the entry table: element offset, first slice, column, piece offset, cell pieces."""

_SOURCE = "triton kernel"
_PIECE_DTYPES = (torch.int64, torch.int32, torch.int16)


@triton.jit
def load_tile(
    template_ptr,
    base,
    tile,
    valid,
    stride_kernel_block,
    stride_head,
    stride_token,
    stride_piece,
    KERNEL_BLOCKS: tl.constexpr,
    HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    PIECES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PIECE_TILES: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    EVEN_PIECES: tl.constexpr,
    PIECE_BITS: tl.constexpr,
    VEC: tl.constexpr,
):
    """One tile of ``BLOCK_R`` cell rows (kernel block, head, token) by ``BLOCK_P`` pieces,
    read unsigned as int64 (rows past ``valid`` tokens and pieces past ``PIECES`` as 0),
    with each element's piece index ``p`` and each row's head ``h`` and token ``u`` in the
    block: what both kernels (the seed lane's, the strong lane's) read."""
    r = (tile // PIECE_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
    p = (tile % PIECE_TILES) * BLOCK_P + tl.arange(0, BLOCK_P)
    if HEADS_FASTEST:
        h = r % HEADS
        t = (r // HEADS) % TOKENS
    else:
        t = r % TOKENS
        h = (r // TOKENS) % HEADS
    k = r // (HEADS * TOKENS)
    u = k * TOKENS + t
    live = (u < valid) & (r < KERNEL_BLOCKS * HEADS * TOKENS)
    start = (
        base
        + k.to(tl.int64) * stride_kernel_block
        + h.to(tl.int64) * stride_head
        + t.to(tl.int64) * stride_token
    )
    if VEC > 1:
        pointers = template_ptr + (start[:, None] * VEC + p[None, :])
    else:
        pointers = template_ptr + (start[:, None] + p.to(tl.int64)[None, :] * stride_piece)
    mask = live[:, None] if EVEN_PIECES else live[:, None] & (p < PIECES)[None, :]
    x = tl.load(pointers, mask=mask, other=0, eviction_policy="evict_first")
    if PIECE_BITS == 16:
        x = x.to(tl.uint16, bitcast=True).to(tl.int64)
    elif PIECE_BITS == 32:
        x = x.to(tl.uint32, bitcast=True).to(tl.int64)
    return x, p, h, u, live


@triton.jit
def seed_terms(x, p, h, u, first, first_slice, cell_pieces, piece_offset):
    """The seed lane's sums of a tile's rows: each element's weight
    ``m_h * (2 * j + 1)``, ``j = j0_r + p``, as ``m_h * ((2 * j0_r + 1) * S_r + 2 * Q_r)``
    with ``S_r`` the row's plain sum and ``Q_r`` its sum weighed by piece index."""
    plain = tl.sum(x, axis=1)
    ramp = tl.sum(x * p.to(tl.int64)[None, :], axis=1)
    factor = 2 * (first_slice + h) + 1
    j0 = (first + u) * cell_pieces + piece_offset
    return factor * ((2 * j0 + 1) * plain + 2 * ramp)


@triton.jit
def _accumulate_kernel(
    template_ptr,
    table_ptr,
    block_ids_ptr,
    first_tokens_ptr,
    valid_tokens_ptr,
    out_ptr,
    num_columns,
    stride_block,
    stride_kernel_block,
    stride_head,
    stride_token,
    stride_piece,
    KERNEL_BLOCKS: tl.constexpr,
    HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    PIECES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PIECE_TILES: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    EVEN_PIECES: tl.constexpr,
    PIECE_BITS: tl.constexpr,
    VEC: tl.constexpr,
    FIELDS: tl.constexpr,
):
    """One program: one row, one table entry, one chunk of that entry's (cell row, piece) tiles.

    A tile is ``BLOCK_R`` cell rows (kernel block, head, token) by ``BLOCK_P`` pieces. Each
    element's weight ``m_h * (2 * j + 1)`` with ``j = j0_r + p`` splits per cell row into
    ``m_h * ((2 * j0_r + 1) * S_r + 2 * Q_r)``, ``S_r`` the row's plain sum and ``Q_r`` its
    sum weighed by piece index: per element one add and one product by a small ``p``, the
    64-bit weights only per row. Row results add up in registers over the program's tiles
    and go into the output with one atomic.
    """
    row = tl.program_id(0)
    entry = tl.program_id(1)
    chunk = tl.program_id(2)
    valid = tl.load(valid_tokens_ptr + row)
    if valid <= 0:
        return
    first = tl.load(first_tokens_ptr + row)
    block = tl.load(block_ids_ptr + row)
    fields = table_ptr + entry.to(tl.int64) * FIELDS
    element_offset = tl.load(fields)
    first_slice = tl.load(fields + 1)
    column = tl.load(fields + 2)
    piece_offset = tl.load(fields + 3)
    cell_pieces = tl.load(fields + 4)
    if VEC > 1:
        # Offsets are counted in 16-byte units (the host divided the strides by VEC; the
        # caller vouched for the entries' offsets), so that the compiler can prove every cell
        # row starts 16 bytes aligned and emit 16-byte loads.
        base = element_offset // VEC + block * stride_block
    else:
        base = element_offset + block * stride_block

    acc = tl.zeros([BLOCK_R], dtype=tl.int64)
    for step in range(TILES_PER_PROGRAM):
        tile = chunk * TILES_PER_PROGRAM + step
        x, p, h, u, _ = load_tile(
            template_ptr, base, tile, valid, stride_kernel_block, stride_head, stride_token,
            stride_piece, KERNEL_BLOCKS, HEADS, TOKENS, PIECES, BLOCK_R, BLOCK_P, PIECE_TILES,
            HEADS_FASTEST, EVEN_PIECES, PIECE_BITS, VEC,
        )  # fmt: skip
        acc += seed_terms(x, p, h, u, first, first_slice, cell_pieces, piece_offset)
    total = tl.sum(acc, axis=0)
    tl.atomic_add(out_ptr + row.to(tl.int64) * num_columns + column, total, sem="relaxed")


_INTERPRETED = type(_accumulate_kernel).__name__ == "InterpretedFunction"


def _check_inputs(
    template: torch.Tensor,
    table: torch.Tensor,
    block_ids: torch.Tensor,
    first_tokens: torch.Tensor,
    valid_tokens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raises KvauditError on arguments that break the kernel contract (metadata only)."""
    if template.dim() != 5 or template.dtype not in _PIECE_DTYPES:
        raise KvauditError(
            "template must be a 5-d int64, int32 or int16 view "
            f"[blocks, kernel_blocks, heads, tokens, pieces], got {template.dtype} "
            f"of shape {tuple(template.shape)}",
            source=_SOURCE,
        )
    if table.dim() != 2 or table.shape[1] != TABLE_FIELDS or table.dtype != torch.int64:
        raise KvauditError(
            f"table must be int64 [entries, {TABLE_FIELDS}], got {table.dtype} "
            f"of shape {tuple(table.shape)}",
            source=_SOURCE,
        )
    rows = block_ids.shape[0] if block_ids.dim() == 1 else -1
    for name, tensor in (
        ("block_ids", block_ids),
        ("first_tokens", first_tokens),
        ("valid_tokens", valid_tokens),
    ):
        if tensor.dim() != 1 or tensor.dtype != torch.int64 or tensor.shape[0] != rows:
            raise KvauditError(
                f"{name} must be int64 [rows] like block_ids, got {tensor.dtype} "
                f"of shape {tuple(tensor.shape)}",
                source=_SOURCE,
            )
    if out.dim() != 2 or out.dtype != torch.int64 or out.shape[0] != rows:
        raise KvauditError(
            f"out must be int64 [rows={rows}, columns], got {out.dtype} "
            f"of shape {tuple(out.shape)}",
            source=_SOURCE,
        )
    if not out.is_contiguous():
        raise KvauditError("out must be contiguous", source=_SOURCE)
    device = template.device
    if device.type != "cuda" and not _INTERPRETED:
        raise KvauditError(
            f"tensors on {device} need CUDA (or TRITON_INTERPRET=1 set before importing triton)",
            source=_SOURCE,
        )
    for name, tensor in (
        ("table", table),
        ("block_ids", block_ids),
        ("first_tokens", first_tokens),
        ("valid_tokens", valid_tokens),
        ("out", out),
    ):
        if tensor.device != device:
            raise KvauditError(
                f"{name} is on {tensor.device}, the template on {device}", source=_SOURCE
            )


def accumulate_triton(
    template: torch.Tensor,
    table: torch.Tensor,
    block_ids: torch.Tensor,
    first_tokens: torch.Tensor,
    valid_tokens: torch.Tensor,
    out: torch.Tensor,
    aligned: bool = False,
) -> None:
    """Adds every table entry's checksums of the given blocks into ``out`` (mod 2**64).

    ``template`` is a ``[blocks, kernel_blocks, heads, tokens, pieces]`` view (any strides)
    of int64 pieces, or of int32/int16 pieces read zero-extended; each ``table`` row
    ``(element offset from template's first element, first slice, column, piece offset,
    cell pieces)`` names a view with the same shape, strides and dtype. ``aligned`` promises
    that every entry's first element and every cell row start on 16 bytes with contiguous
    pieces; it is ignored where the template's own layout already rules that out. Block ids
    and columns are trusted to be in range. Nothing is read back to the host.

    Raises:
        KvauditError: The arguments' shapes, dtypes or devices break the contract.

    """
    _check_inputs(template, table, block_ids, first_tokens, valid_tokens, out)
    rows = block_ids.shape[0]
    entries = table.shape[0]
    if rows == 0 or entries == 0 or out.shape[1] == 0 or any(s == 0 for s in template.shape[1:]):
        return
    if entries > MAX_GRID_YZ:
        raise KvauditError(
            f"{entries} table entries exceed one launch's {MAX_GRID_YZ}", source=_SOURCE
        )
    shape = tuple(template.shape)
    strides = tuple(template.stride())
    itemsize = template.element_size()
    aligned = aligned and layout_is_aligned(shape, strides, itemsize, template.data_ptr())
    config = launch_config(shape, strides, itemsize, aligned)
    stride_args, constants = kernel_arguments(shape, strides, itemsize, config)
    _accumulate_kernel[(rows, entries, config.chunks)](
        template,
        table.contiguous(),
        block_ids.contiguous(),
        first_tokens.contiguous(),
        valid_tokens.contiguous(),
        out,
        out.shape[1],
        *stride_args,
        **constants,
        FIELDS=TABLE_FIELDS,
        num_warps=config.num_warps,
        num_stages=1,
    )


def warm_up(template: torch.Tensor, num_columns: int, aligned: bool = False) -> None:
    """Compiles the kernel variant for this template layout now, not in a serving step.

    Launches once with one row whose ``valid_tokens`` is 0, which adds nothing.
    """
    device = template.device
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    table = torch.zeros((1, TABLE_FIELDS), dtype=torch.int64, device=device)
    out = torch.zeros((1, max(1, num_columns)), dtype=torch.int64, device=device)
    accumulate_triton(template, table, zero, zero, zero, out, aligned)


def entry_table(parts: list[LaunchPart]) -> torch.Tensor:
    """The kernel's ``[entries, TABLE_FIELDS]`` table of ``parts`` (same layout), offsets
    counted in elements from the first part, on the parts' device."""
    template = parts[0].pieces
    itemsize = template.element_size()
    base = template.data_ptr()
    rows = [
        [
            (part.pieces.data_ptr() - base) // itemsize,
            part.first_slice,
            part.column,
            part.piece_offset,
            part.cell_pieces,
        ]
        for part in parts
    ]
    return torch.tensor(rows, dtype=torch.int64, device=template.device)


class TritonLaunch:
    """Parts that share one layout, each adding into its column in one Triton launch over
    their table (the Triton backend's :class:`~kvaudit.checksum.kernels.Launch`)."""

    def __init__(self, parts: list[LaunchPart]) -> None:
        self.template = parts[0].pieces
        self.table = entry_table(parts)
        self.aligned = self.template.stride(-1) == 1 and all(
            part.pieces.data_ptr() % 16 == 0 for part in parts
        )

    def accumulate(
        self,
        block_ids: torch.Tensor,
        first_tokens: torch.Tensor,
        valid_tokens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Add every part's weighted sums of the rows into its column of ``out``."""
        accumulate_triton(
            self.template, self.table, block_ids, first_tokens, valid_tokens, out, self.aligned
        )

    def warm_up(self, num_columns: int) -> None:
        """Compile the kernel now rather than in a serving step."""
        warm_up(self.template, num_columns, self.aligned)
