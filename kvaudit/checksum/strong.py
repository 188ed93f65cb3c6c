"""The strong lane: each block's KV read as one number modulo the prime ``2**64 - 59``.

docs/checksum.md ("The strong lane") defines it and argues what it detects. Per cell row
(one layer's head at one token, the row's stored pieces ``x_0 .. x_{n-1}`` from piece
``k0`` of its cell), the lane adds

    N * 2**(64 * E(s, t, k0))   mod P,   N = sum of x_p * 2**(64 p)   (the row as a number)

so the data meets only Horner steps by 59 (``2**64 = 59 mod P``) and each row's weight is
one product of a per-head and a per-token residue. The C loop (``kvaudit._native.
_strong_sums``) does that at memory speed; numpy does the same without it, with exact
32-bit limb sums per row and Python integers per cell row (slower, same bits). GPU views
run the Triton kernel of :mod:`.kernels.triton_strong`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from ..core.native import extension
from ..core.scheme import (
    MASK64,
    STRONG_PIECE_PLACES,
    STRONG_PRIME,
    STRONG_TOKEN_PLACES,
    strong_weight,
)
from .kernels import LaunchPart
from .kernels.numpy_cpu import shared_pool

NATIVE = "kvaudit._native._strong_sums"
"""The C extension with the strong lane's loop."""

CHUNK_ROWS_BYTES = 4 << 20
"""Bytes of block rows one C call or numpy step covers."""

_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@cache
def token_weights() -> np.ndarray:
    """``2**(64 * 2**20 * t')`` mod P for every token place ``t'`` (int64 bits)."""
    step = strong_weight(STRONG_PIECE_PLACES)
    values = [1]
    for _ in range(STRONG_TOKEN_PLACES - 1):
        values.append(values[-1] * step % STRONG_PRIME)
    return np.array(values, dtype=np.uint64).view(np.int64)


def head_weights(first_slice: int, heads: int, piece_offset: int) -> np.ndarray:
    """Per head of a part, ``2**(64 * E(s, 0, k0))`` mod P (int64 bits): the weight of its
    cell rows at token place 0, ``s = first_slice + h`` and ``k0 = piece_offset``."""
    per_slice = STRONG_TOKEN_PLACES * STRONG_PIECE_PLACES
    # The slice number modulo 2**64, as the seed lane takes it (any layer number fits).
    slices = [(first_slice + h) & MASK64 for h in range(heads)]
    values = [strong_weight(s * per_slice + piece_offset) for s in slices]
    return np.array(values, dtype=np.uint64).view(np.int64)


def _from_limbs(c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray) -> np.ndarray:
    """``c0 + c1 * 2**32 + c2 * 2**64 + c3 * 2**96`` mod P, each ``c`` below 2**62."""
    flat = [
        (int(a) + (int(b) << 32) + (int(c) << 64) + (int(d) << 96)) % STRONG_PRIME
        for a, b, c, d in zip(c0.ravel(), c1.ravel(), c2.ravel(), c3.ravel(), strict=True)
    ]
    return np.array(flat, dtype=np.uint64).reshape(c0.shape)


@dataclass
class StrongPart:
    """One piece view prepared for the strong lane: its blocks read unsigned, its column
    and its per-head weights."""

    blocks: np.ndarray
    column: int
    head_weights: np.ndarray
    tokens_per_row: int
    chunk_rows: int

    @classmethod
    def of(cls, part: LaunchPart, pieces: np.ndarray) -> StrongPart:
        """The strong lane's view of ``part`` whose pieces are the numpy array ``pieces``."""
        _, kernel_blocks, heads, tokens, num_pieces = pieces.shape
        blocks = pieces.view(_UNSIGNED[pieces.dtype.itemsize])
        row_bytes = kernel_blocks * heads * tokens * num_pieces * pieces.dtype.itemsize
        return cls(
            blocks,
            part.column,
            head_weights(part.first_slice, heads, part.piece_offset),
            kernel_blocks * tokens,
            max(1, CHUNK_ROWS_BYTES // max(row_bytes, 1)),
        )

    def row_sums(
        self, block_ids: np.ndarray, first_tokens: np.ndarray, valid_tokens: np.ndarray
    ) -> np.ndarray:
        """The strong sums (residues, uint64) of the block rows: C where it built."""
        counts = np.minimum(valid_tokens, self.tokens_per_row).astype(np.int64)
        native = extension(NATIVE)
        sums = np.zeros(len(block_ids), dtype=np.uint64)

        def run(start: int) -> None:
            part = slice(start, start + self.chunk_rows)
            ids = np.ascontiguousarray(block_ids[part], dtype=np.int64)
            first = np.ascontiguousarray(first_tokens[part], dtype=np.int64)
            count = np.ascontiguousarray(counts[part])
            if native is not None:
                out = np.empty(len(ids), dtype=np.int64)
                native.strong_sums(
                    self.blocks, ids, first, count, self.head_weights, token_weights(), out
                )
                sums[part] = out.view(np.uint64)
            else:
                sums[part] = self._numpy_row_sums(ids, first, count)

        starts = range(0, len(block_ids), self.chunk_rows)
        if native is not None and len(starts) > 1:
            # The C loop releases the GIL: chunks run on the numpy backend's threads.
            shared_pool().map(run, starts)
        else:
            for start in starts:
                run(start)
        return sums

    def _numpy_row_sums(
        self, block_ids: np.ndarray, first_tokens: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        """:meth:`row_sums` in numpy: each cell row's number by exact limb sums."""
        x = self.blocks[block_ids].astype(np.uint64)  # [rows, kb, heads, tokens, pieces]
        rows, kernel_blocks, heads, tokens, pieces = x.shape
        places = [strong_weight(p) for p in range(pieces)]
        v = np.array(places, dtype=np.uint64)
        mask = np.uint64(0xFFFFFFFF)
        x_low, x_high = x & mask, x >> np.uint64(32)
        v_low, v_high = v & mask, v >> np.uint64(32)
        limbs = [np.zeros(x.shape[:-1], dtype=np.uint64) for _ in range(4)]
        for a, b, shift in (
            (x_low, v_low, 0),
            (x_low, v_high, 1),
            (x_high, v_low, 1),
            (x_high, v_high, 2),
        ):
            product = a * b  # below 2**64: exact
            limbs[shift] += (product & mask).sum(axis=-1, dtype=np.uint64)
            limbs[shift + 1] += (product >> np.uint64(32)).sum(axis=-1, dtype=np.uint64)
        numbers = _from_limbs(*limbs)  # [rows, kb, heads, tokens]
        u = np.arange(kernel_blocks * tokens, dtype=np.int64).reshape(kernel_blocks, tokens)
        place = (first_tokens[:, None, None] + u[None]) % STRONG_TOKEN_PLACES  # [rows, kb, t]
        token = token_weights().view(np.uint64)[place]
        head = self.head_weights.view(np.uint64)
        live = u[None] < counts[:, None, None]
        total = [0] * rows
        for r in range(rows):
            value = 0
            for k in range(kernel_blocks):
                for t in range(tokens):
                    if not live[r, k, t]:
                        continue
                    weight = int(token[r, k, t])
                    for h in range(heads):
                        value += int(numbers[r, k, h, t]) * weight % STRONG_PRIME * int(head[h])
            total[r] = value % STRONG_PRIME
        return np.array(total, dtype=np.uint64)
