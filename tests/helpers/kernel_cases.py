"""The kernel contract's test cases, shared by the Triton kernel's and the numpy CPU
path's tests: seeded views in every layout the plans produce (planes, kernel blocks, state
pieces, long cells, values near the wrap-around, unaligned and strided views), and
``reference``, the contract computed directly in numpy (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

MASK64 = (1 << 64) - 1
H = 65536  # MAX_KV_HEADS_PER_LAYER, for first slices ``layer * H + first head``
_UNSIGNED = {torch.int64: np.uint64, torch.int32: np.uint32, torch.int16: np.uint16}


@dataclass
class Entry:
    """One view the kernel reads, and how it is numbered."""

    view: torch.Tensor  # [blocks, kernel_blocks, heads, tokens, pieces]
    first_slice: int
    column: int
    piece_offset: int
    cell_pieces: int


@dataclass
class Case:
    """One launch: a template, its entries (the template is one of them or not), the rows,
    the values ``out`` starts from, and the alignment promise."""

    template: torch.Tensor
    entries: list[Entry]
    block_ids: list[int]
    first_tokens: list[int]
    valid_tokens: list[int]
    out_start: list[list[int]]
    aligned: bool
    expected: list[list[int]] | None = None  # worked out by hand, where given
    keep: list[torch.Tensor] = field(default_factory=list)  # allocations the views live in


def _bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bit patterns of an integer dtype, every bit (the sign bit too) random."""
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype, generator=generator)


def bf16_values(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A bf16 cache with random bits."""
    return _bits(shape, torch.int16, generator).view(torch.bfloat16)


def random_rows(
    generator: torch.Generator,
    rows: int,
    blocks: int,
    block_tokens: int,
    columns: int,
) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Random block ids, first tokens (not multiples of the block size), valid tokens in
    ``0 .. block_tokens`` with the extremes present, and random starting sums."""
    block_ids = torch.randint(0, blocks, (rows,), generator=generator).tolist()
    first_tokens = torch.randint(0, 1 << 20, (rows,), generator=generator).tolist()
    valid = torch.randint(0, block_tokens + 1, (rows,), generator=generator).tolist()
    valid[0] = block_tokens
    if rows > 2:
        valid[1] = 0
    start = _bits((rows, columns), torch.int64, generator).tolist()
    return block_ids, first_tokens, valid, start


def on_device(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.to(device) for tensor in tensors]


def case_by_hand(device: str, big: bool) -> Case:
    """One nonzero piece, x = 3 at head 1, token 1, piece 0 of block 1 (worked out below)."""
    data = torch.zeros((2, 1, 2, 2, 2), dtype=torch.int64)
    data[1, 0, 1, 1, 0] = 3
    (data,) = on_device(device, data)
    # j = (4 + 1) * 4 + 2 + 0 = 22, factor = 2 * (2 + 1) + 1 = 7: 7 * 3 * 45 = 945.
    return Case(
        template=data,
        entries=[Entry(data, first_slice=2, column=0, piece_offset=2, cell_pieces=4)],
        block_ids=[1, 1, 0],
        first_tokens=[4, 4, 4],
        valid_tokens=[2, 1, 2],
        out_start=[[0], [5], [0]],
        aligned=True,
        expected=[[945], [5], [0]],
    )


def case_nthc_two_layers(device: str, big: bool) -> Case:
    """Token-major (NHD) K caches of two layers in separate allocations, two columns."""
    g = torch.Generator().manual_seed(1)
    blocks, tokens, heads, dim = (40, 16, 8, 128) if big else (6, 4, 3, 8)
    caches = on_device(device, *(bf16_values((blocks, tokens, heads, dim), g) for _ in range(2)))
    views = [c.view(torch.int64).permute(0, 2, 1, 3).unsqueeze(1) for c in caches]
    pieces = dim // 4
    entries = [
        Entry(views[0], first_slice=3 * H, column=0, piece_offset=0, cell_pieces=pieces),
        Entry(views[1], first_slice=4 * H + 5, column=1, piece_offset=0, cell_pieces=pieces),
    ]
    rows = random_rows(g, 24 if big else 4, blocks, tokens, 2)
    return Case(views[0], entries, *rows, aligned=True, keep=caches)


def case_nhtc_kv_apart(device: str, big: bool) -> Case:
    """Head-major (HND) K and V caches stored apart, two layers, one column; unaligned."""
    g = torch.Generator().manual_seed(2)
    blocks, heads, tokens, dim = (32, 4, 16, 64) if big else (5, 2, 3, 4)
    pieces = dim // 4
    caches = on_device(device, *(bf16_values((blocks, heads, tokens, dim), g) for _ in range(4)))
    views = [c.view(torch.int64).unsqueeze(1) for c in caches]
    entries = [
        Entry(views[2 * layer + plane], layer * H + 2, 0, plane * pieces, 2 * pieces)
        for layer in range(2)
        for plane in range(2)
    ]
    rows = random_rows(g, 16 if big else 4, blocks, tokens, 1)
    return Case(views[1], entries, *rows, aligned=False, keep=caches)


def case_planes_per_block(device: str, big: bool) -> Case:
    """vLLM-style ``[blocks, 2, tokens, heads, dim]`` caches: K and V are strided views."""
    g = torch.Generator().manual_seed(3)
    blocks, tokens, heads, dim = (24, 16, 8, 128) if big else (4, 4, 2, 8)
    pieces = dim // 4
    caches = on_device(device, *(bf16_values((blocks, 2, tokens, heads, dim), g) for _ in range(2)))
    views = [
        c.view(torch.int64)[:, plane].permute(0, 2, 1, 3).unsqueeze(1)
        for c in caches
        for plane in range(2)
    ]
    entries = [
        Entry(views[2 * layer + plane], (7 + layer) * H, 0, plane * pieces, 2 * pieces)
        for layer in range(2)
        for plane in range(2)
    ]
    rows = random_rows(g, 20 if big else 3, blocks, tokens, 1)
    return Case(views[0], entries, *rows, aligned=True, keep=caches)


def case_planes_outermost(device: str, big: bool) -> Case:
    """``[2, blocks, tokens, heads, dim]`` (KNTHD) caches: V lies a whole plane after K."""
    g = torch.Generator().manual_seed(4)
    blocks, tokens, heads, dim = (24, 16, 4, 64) if big else (4, 2, 3, 4)
    pieces = dim // 4
    caches = on_device(device, *(bf16_values((2, blocks, tokens, heads, dim), g) for _ in range(2)))
    views = [
        c.view(torch.int64)[plane].permute(0, 2, 1, 3).unsqueeze(1)
        for c in caches
        for plane in range(2)
    ]
    entries = [
        Entry(views[2 * layer + plane], layer * H + 4 * layer, layer, plane * pieces, 2 * pieces)
        for layer in range(2)
        for plane in range(2)
    ]
    rows = random_rows(g, 20 if big else 3, blocks, tokens, 2)
    # The template is the second layer's V: the others lie before it (negative offsets).
    return Case(views[3], entries, *rows, aligned=False, keep=caches)


def case_kernel_blocks(device: str, big: bool) -> Case:
    """Manager blocks of two kernel blocks; valid tokens end inside either kernel block."""
    g = torch.Generator().manual_seed(5)
    blocks, kernel_tokens, heads, dim = (16, 16, 8, 128) if big else (3, 3, 2, 8)
    pieces = dim // 4
    cache = bf16_values((2 * blocks, kernel_tokens, heads, dim), g).to(device)
    view = (
        cache.view(torch.int64).view(blocks, 2, kernel_tokens, heads, pieces).permute(0, 1, 3, 2, 4)
    )
    entries = [Entry(view, 9 * H, 0, 0, pieces)]
    rows = random_rows(g, 12 if big else 4, blocks, 2 * kernel_tokens, 1)
    rows[2][-1] = kernel_tokens - 1
    return Case(view, entries, *rows, aligned=True, keep=[cache])


def case_state_int16(device: str, big: bool) -> Case:
    """TP-split state rows of int16 elements, read zero-extended (top bits set), odd sizes."""
    g = torch.Generator().manual_seed(6)
    blocks, rows_, cols = (20, 48, 33) if big else (4, 3, 5)
    state = _bits((blocks, rows_, cols), torch.int16, g).to(device)
    state.view(-1)[0] = -1
    view = state.view(blocks, 1, rows_, 1, cols)
    entries = [Entry(view, 11 * H + 6, 0, 0, cols)]
    rows = random_rows(g, 10 if big else 4, blocks, 1, 1)
    return Case(view, entries, *rows, aligned=False, keep=[state])


def case_state_int32_two(device: str, big: bool) -> Case:
    """Two int32 states in separate allocations, head numbers following on, aligned rows."""
    g = torch.Generator().manual_seed(7)
    blocks, rows_, cols = (20, 16, 64) if big else (4, 2, 8)
    states = on_device(device, *(_bits((blocks, rows_, cols), torch.int32, g) for _ in range(2)))
    views = [s.view(blocks, 1, rows_, 1, cols) for s in states]
    entries = [
        Entry(views[0], 12 * H, 0, 0, cols),
        Entry(views[1], 12 * H + rows_, 1, 0, cols),
    ]
    rows = random_rows(g, 10 if big else 4, blocks, 1, 2)
    return Case(views[0], entries, *rows, aligned=True, keep=states)


def case_long_cell(device: str, big: bool) -> Case:
    """An unsplit state as one cell of many int16 pieces: several piece tiles and chunks."""
    g = torch.Generator().manual_seed(8)
    blocks, pieces = (6, 300_001) if big else (3, 40_003)
    state = _bits((blocks, pieces), torch.int16, g).to(device)
    view = state.view(blocks, 1, 1, 1, pieces)
    entries = [Entry(view, 13 * H, 0, 0, pieces)]
    rows = random_rows(g, 4 if big else 2, blocks, 1, 1)
    return Case(view, entries, *rows, aligned=True, keep=[state])


def case_many_cell_rows(device: str, big: bool) -> Case:
    """More cell rows than one tile holds: several row tiles per program."""
    g = torch.Generator().manual_seed(9)
    blocks, kernel_blocks, heads, tokens, pieces = (8, 4, 8, 32, 32) if big else (3, 2, 4, 64, 16)
    cache = _bits((blocks, kernel_blocks, heads, tokens, pieces), torch.int64, g).to(device)
    entries = [Entry(cache, 14 * H, 0, 0, pieces)]
    rows = random_rows(g, 6 if big else 3, blocks, kernel_blocks * tokens, 1)
    return Case(cache, entries, *rows, aligned=True, keep=[cache])


def case_near_wrap(device: str, big: bool) -> Case:
    """Pieces near +-2**63, large factors and positions: every product wraps mod 2**64."""
    g = torch.Generator().manual_seed(10)
    blocks, heads, tokens, pieces = (16, 8, 16, 32) if big else (3, 2, 3, 2)
    extremes = torch.tensor([2**63 - 1, -(2**63), -1, 2**63 - 3, -(2**63) + 5], dtype=torch.int64)
    pick = torch.randint(0, len(extremes), (blocks, 1, heads, tokens, pieces), generator=g)
    cache = extremes[pick].to(device)
    entries = [Entry(cache, 40_000 * H + 65_000, 0, 7, 9 + pieces)]
    block_ids, _, valid, start = random_rows(g, 8 if big else 3, blocks, tokens, 1)
    first_tokens = [(1 << 61) + 12345 * i for i in range(len(block_ids))]
    return Case(cache, entries, block_ids, first_tokens, valid, start, aligned=True, keep=[cache])


def case_unaligned_strided(device: str, big: bool) -> Case:
    """Views starting 8 bytes past 16-byte alignment, with strided pieces, while ``aligned``
    is (wrongly) claimed: the layout itself rules it out, so it must be ignored."""
    g = torch.Generator().manual_seed(11)
    blocks, tokens, pieces, heads = (12, 16, 16, 8) if big else (4, 3, 3, 2)
    size = blocks * tokens * pieces * heads
    storage = _bits((2 * size + 1,), torch.int64, g).to(device)
    views = [
        storage[1 + i * size : 1 + (i + 1) * size]
        .view(blocks, tokens, pieces, heads)
        .permute(0, 3, 1, 2)
        .unsqueeze(1)
        for i in range(2)
    ]
    entries = [
        Entry(views[0], 15 * H, 0, 0, 2 * pieces),
        Entry(views[1], 15 * H, 0, pieces, 2 * pieces),
    ]
    rows = random_rows(g, 8 if big else 3, blocks, tokens, 1)
    return Case(views[0], entries, *rows, aligned=True, keep=[storage])


def case_all_rows_empty(device: str, big: bool) -> Case:
    """Rows with no valid tokens add nothing: ``out`` keeps its starting values."""
    g = torch.Generator().manual_seed(12)
    cache = _bits((3, 1, 2, 4, 2), torch.int64, g).to(device)
    start = _bits((3, 2), torch.int64, g).tolist()
    return Case(
        cache,
        [Entry(cache, 0, 1, 0, 2)],
        [0, 1, 2],
        [0, 4, 8],
        [0, 0, 0],
        start,
        aligned=True,
        expected=[[v & MASK64 for v in row] for row in start],
        keep=[cache],
    )


CASES: dict[str, Callable[[str, bool], Case]] = {
    "by_hand": case_by_hand,
    "nthc_two_layers": case_nthc_two_layers,
    "nhtc_kv_apart": case_nhtc_kv_apart,
    "planes_per_block": case_planes_per_block,
    "planes_outermost": case_planes_outermost,
    "kernel_blocks": case_kernel_blocks,
    "state_int16": case_state_int16,
    "state_int32_two": case_state_int32_two,
    "long_cell": case_long_cell,
    "many_cell_rows": case_many_cell_rows,
    "near_wrap": case_near_wrap,
    "unaligned_strided": case_unaligned_strided,
    "all_rows_empty": case_all_rows_empty,
}


def reference(case: Case) -> list[list[int]]:
    """The contract computed directly, per row and entry, in numpy uint64 (wraps mod 2**64)."""
    out = [[value & MASK64 for value in row] for row in case.out_start]
    for entry in case.entries:
        values = entry.view.cpu().numpy().view(_UNSIGNED[entry.view.dtype]).astype(np.uint64)
        _, kernel_blocks, heads, tokens, pieces = values.shape
        u = np.arange(kernel_blocks)[:, None] * tokens + np.arange(tokens)[None, :]  # [k, t]
        factor = 2 * (np.uint64(entry.first_slice) + np.arange(heads, dtype=np.uint64)) + 1
        for i, block in enumerate(case.block_ids):
            position = np.uint64(case.first_tokens[i]) + u.astype(np.uint64)
            j = (
                position[:, None, :, None] * np.uint64(entry.cell_pieces)
                + np.uint64(entry.piece_offset)
                + np.arange(pieces, dtype=np.uint64)
            )
            weight = factor[None, :, None, None] * (2 * j + 1)
            live = (u < case.valid_tokens[i])[:, None, :, None]
            terms = np.where(live, values[block] * weight, np.uint64(0))
            total = int(terms.sum(dtype=np.uint64))
            out[i][entry.column] = (out[i][entry.column] + total) & MASK64
    return out
