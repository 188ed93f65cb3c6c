"""The CPU path: the checksum of block rows with torch, in bounded memory.

Per row, a part's weighted sum is split into a fixed dot product and a term linear in
the block's first token (docs/checksum.md):

    sum x * m_h * (2 * ((first + u) * P + off + p) + 1)
      = x . A  +  first * sum_h (2 * P * m_h) * S0_h

with ``A[k, h, t, p] = m_h * (2 * ((k*T + t) * P + off + p) + 1)`` fixed per part and
``S0_h`` the sum of head ``h``'s pieces. Integer matrix-vector products and sums run near
memory speed, and int64 wrap-around gives the uint64 bits.
"""

from __future__ import annotations

import torch

# Rows are gathered in chunks of about this many bytes into a buffer that is reused: large
# enough for fast matrix-vector products, small enough to stay in cache and bound memory.
CHUNK_BYTES = 4 << 20

_ZERO_EXTEND = {torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}


class TorchPart:
    """One piece view ``[blocks, kernel_blocks, heads, tokens, pieces]`` prepared for the
    CPU path: its axes in memory order, its weights laid out to match, and its column."""

    def __init__(
        self,
        pieces: torch.Tensor,
        first_slice: int,
        column: int,
        piece_offset: int,
        cell_pieces: int,
    ) -> None:
        _, kernel_blocks, heads, tokens, num_pieces = pieces.shape
        # Axes 1..4 ordered outermost first in memory, so gathers read forward.
        order = sorted(range(1, 5), key=lambda axis: -pieces.stride(axis))
        self.blocks = pieces.permute(0, *order)
        self.column = column
        self.zero_extend = _ZERO_EXTEND.get(pieces.dtype)
        self.tokens_per_row = kernel_blocks * tokens
        self.row_elements = kernel_blocks * heads * tokens * num_pieces
        self.row_bytes = self.row_elements * 8
        self.head_axis = order.index(2) + 1
        self.other_axes = tuple(axis for axis in range(1, 5) if axis != self.head_axis)

        head = torch.arange(heads, dtype=torch.int64)
        factors = 2 * (head + first_slice) + 1
        u = (
            torch.arange(kernel_blocks, dtype=torch.int64)[:, None] * tokens
            + torch.arange(tokens, dtype=torch.int64)[None, :]
        )  # [kernel_blocks, tokens]: the token's index in the manager block
        p = torch.arange(num_pieces, dtype=torch.int64)
        j = u[:, None, :, None] * cell_pieces + piece_offset + p  # [k, 1, t, p]
        weights = factors[None, :, None, None] * (2 * j + 1)  # [k, h, t, p]
        self.weights = weights.permute(*(axis - 1 for axis in order)).contiguous().view(-1)
        self.head_factors = (2 * cell_pieces) * factors
        # The token index of every element, in memory order, for rows cut short.
        token_index = u[:, None, :, None].expand(kernel_blocks, heads, tokens, num_pieces)
        self.token_index = token_index.permute(*(axis - 1 for axis in order)).contiguous()
        self.first_slice = first_slice
        self.chunk_rows = max(1, CHUNK_BYTES // max(self.row_bytes, 1))
        self._buffer: torch.Tensor | None = None

    def accumulate(
        self,
        block_ids: torch.Tensor,
        first_tokens: torch.Tensor,
        valid_tokens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Add this part's weighted sums of the rows into ``out[:, column]``."""
        full = valid_tokens >= self.tokens_per_row
        partial = (valid_tokens > 0) & ~full
        for rows in (full.nonzero().flatten(), partial.nonzero().flatten()):
            for start in range(0, len(rows), self.chunk_rows):
                index = rows[start : start + self.chunk_rows]
                values = self._row_sums(block_ids[index], first_tokens[index], valid_tokens[index])
                out[index, self.column] += values

    def _row_sums(
        self, block_ids: torch.Tensor, first_tokens: torch.Tensor, valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        x = self._gather(block_ids)
        if self.zero_extend is not None:
            x = x.to(torch.int64) & self.zero_extend
        if bool((valid_tokens < self.tokens_per_row).any()):
            keep = self.token_index.unsqueeze(0) < valid_tokens.view(-1, 1, 1, 1, 1)
            x = x * keep
        sums = x.reshape(len(block_ids), -1) @ self.weights
        if bool(first_tokens.any()):
            sums += first_tokens * (self._head_sums(x) @ self.head_factors)
        return sums

    def _gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The rows' blocks, contiguous, in a reused buffer (fresh allocations of this size
        cost more in page faults than the copy itself)."""
        if self.blocks.device.type != "cpu":
            return self.blocks.index_select(0, block_ids)
        if self._buffer is None:
            self._buffer = torch.empty(
                (self.chunk_rows, *self.blocks.shape[1:]), dtype=self.blocks.dtype
            )
        x = self._buffer[: len(block_ids)]
        torch.index_select(self.blocks, 0, block_ids, out=x)
        return x

    def _head_sums(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, heads]``: the sum of each head's pieces, innermost axis first."""
        if self.head_axis != 4:
            x = x.sum(dim=-1)
            return x.sum(dim=tuple(a for a in self.other_axes if a != 4))
        return x.sum(dim=self.other_axes)


def accumulate_torch(
    parts: list[TorchPart],
    block_ids: torch.Tensor,
    first_tokens: torch.Tensor,
    valid_tokens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Add every part's weighted sums of the rows into its column of ``out`` ``[rows, columns]``."""
    for part in parts:
        part.accumulate(block_ids, first_tokens, valid_tokens, out)
