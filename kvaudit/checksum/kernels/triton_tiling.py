"""The Triton kernel's tiling: every knob, and the launch configuration of one layout.

Pure arithmetic on shapes and strides (no Triton import), shared by the launches, the
compile test (tests/checksum/test_kernel_compile.py) and bench/kernel_resources.py, so that what is
compiled there is what runs. docs/gpu.md explains the choices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# Elements one program holds in registers per tile; 4096 int64 are 32 KB, 16 per thread at
# 8 warps, enough loads in flight per SM to cover memory latency at full bandwidth.
TILE_ELEMENTS = 4096
# A program reads one tile: a program that loops over tiles lets the compiler keep two
# tiles' loads live at once (Llama NTHC on sm_90: 100 registers instead of 64), which halves
# the programs an SM holds. It loops only where a cell has more tiles than one launch may
# have chunks (the grid's third dimension).
MAX_CHUNKS = 65535
# A tile's piece segment per cell row is at least this many bytes (two 32-byte sectors),
# so that splitting long rows into piece tiles keeps every memory sector fully used.
MIN_SEGMENT_BYTES = 64
# Tile elements per warp, and the most warps of one program.
ELEMENTS_PER_WARP = 512
MAX_WARPS = 8
# CUDA's limit on the grid's second dimension (table entries).
MAX_GRID_YZ = 65535

PIECE_BITS = {8: 64, 4: 32, 2: 16}
"""Bits of a piece, by its size in bytes (int64, int32, int16 views)."""

Shape = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class LaunchConfig:
    """The tiling chosen for one template shape, dtype and alignment."""

    block_rows: int
    block_pieces: int
    piece_tiles: int
    tiles_per_program: int
    chunks: int
    heads_fastest: bool
    vec: int
    num_warps: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _piece_block(pieces: int, piece_bytes: int) -> int:
    """The tile width in pieces: a power of two that pads a cell row by at most 1/8 if possible."""
    widest = min(_next_power_of_2(pieces), TILE_ELEMENTS)
    narrowest = min(widest, max(1, MIN_SEGMENT_BYTES // piece_bytes))
    best = widest
    width = widest
    while width >= narrowest:
        padded = _cdiv(pieces, width) * width
        if padded * 8 <= pieces * 9:
            return width
        if padded < _cdiv(pieces, best) * best:
            best = width
        width //= 2
    return best


def layout_is_aligned(shape: Shape, strides: Shape, piece_bytes: int, data_ptr: int) -> bool:
    """Whether a template's own layout allows 16-byte loads: aligned start, rows and pieces."""
    if data_ptr % 16 or (shape[4] > 1 and strides[4] != 1):
        return False
    return all(
        size == 1 or stride * piece_bytes % 16 == 0 for size, stride in zip(shape[:4], strides[:4])
    )


@functools.lru_cache(maxsize=256)
def launch_config(
    shape: Shape, strides: Shape, piece_bytes: int, aligned: bool, max_chunks: int | None = None
) -> LaunchConfig:
    """The tiling for a ``[blocks, kernel_blocks, heads, tokens, pieces]`` template, with at
    most ``max_chunks`` (default ``MAX_CHUNKS``) programs per row and entry.

    It depends only on the layout, never on the number of rows, so that ``warm_up``
    compiles the variant that later launches use.
    """
    _, kernel_blocks, heads, tokens, pieces = shape
    cell_rows = kernel_blocks * heads * tokens
    block_pieces = _piece_block(pieces, piece_bytes)
    block_rows = min(_next_power_of_2(cell_rows), max(1, TILE_ELEMENTS // block_pieces))
    piece_tiles = _cdiv(pieces, block_pieces)
    tiles = _cdiv(cell_rows, block_rows) * piece_tiles
    tiles_per_program = _cdiv(tiles, MAX_CHUNKS if max_chunks is None else max_chunks)
    return LaunchConfig(
        block_rows=block_rows,
        block_pieces=block_pieces,
        piece_tiles=piece_tiles,
        tiles_per_program=tiles_per_program,
        chunks=_cdiv(tiles, tiles_per_program),
        heads_fastest=heads > 1 and tokens > 1 and strides[2] < strides[3],
        vec=16 // piece_bytes if aligned else 1,
        num_warps=max(1, min(MAX_WARPS, block_rows * block_pieces // ELEMENTS_PER_WARP)),
    )


def kernel_arguments(
    shape: Shape, strides: Shape, piece_bytes: int, config: LaunchConfig
) -> tuple[list[int], dict[str, int | bool]]:
    """The kernel's stride arguments and its compile-time constants for a template.

    Aligned launches count block, kernel-block, head and token strides in 16-byte units.
    """
    _, kernel_blocks, heads, tokens, pieces = shape
    strides_args = [stride // config.vec for stride in strides[:4]] + [strides[4]]
    constants: dict[str, int | bool] = {
        "KERNEL_BLOCKS": kernel_blocks,
        "HEADS": heads,
        "TOKENS": tokens,
        "PIECES": pieces,
        "BLOCK_R": config.block_rows,
        "BLOCK_P": config.block_pieces,
        "PIECE_TILES": config.piece_tiles,
        "TILES_PER_PROGRAM": config.tiles_per_program,
        "HEADS_FASTEST": config.heads_fastest,
        "EVEN_PIECES": pieces % config.block_pieces == 0,
        "PIECE_BITS": PIECE_BITS[piece_bytes],
        "VEC": config.vec,
    }
    return strides_args, constants
