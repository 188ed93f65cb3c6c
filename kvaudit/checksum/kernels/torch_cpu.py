"""The CPU path: the checksum of block rows with torch, in bounded memory.

A piece's weight ``m_h * (2 * ((first + u) * P + off + p) + 1)`` splits into a part that
depends on the token and head and a part that depends on the head and piece
(docs/checksum.md):

    row sum = sum over (u, h) of  S[u, h] * m_h * (2 * (first + u) * P + 2 * off + 1)
            + sum over (h, p) of  Y[h, p] * 2 * m_h * p

with ``S[u, h]`` the sum of a cell's pieces and ``Y[h, p]`` the sum of a piece over the
block's tokens. So the full data only goes through two plain integer sums, which run near
memory speed; the weights meet the much smaller reduced tensors. int64 wrap-around gives
the uint64 bits.
"""

from __future__ import annotations

import torch

from . import LaunchPart

# Rows are gathered in chunks of about this many bytes into a buffer that is reused: large
# enough to amortise the per-chunk overhead, small enough to stay in cache and bound memory.
CHUNK_BYTES = 8 << 20

_ZERO_EXTEND = {torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}
# Axes of a piece view after the block axis.
_KERNEL_BLOCK, _HEAD, _TOKEN, _PIECE = 1, 2, 3, 4


class TorchPart:
    """One piece view ``[blocks, kernel_blocks, heads, tokens, pieces]`` prepared for the
    CPU path: its axes in memory order, its weights laid out to match, and its column."""

    def __init__(self, part: LaunchPart) -> None:
        pieces, first_slice, piece_offset, cell_pieces = (
            part.pieces,
            part.first_slice,
            part.piece_offset,
            part.cell_pieces,
        )
        _, kernel_blocks, heads, tokens, num_pieces = pieces.shape
        # Axes 1..4 ordered outermost first in memory, so gathers read forward.
        order = sorted(range(1, 5), key=lambda axis: -pieces.stride(axis))
        self.blocks = pieces.permute(0, *order)
        self.column = part.column
        self.zero_extend = _ZERO_EXTEND.get(pieces.dtype)
        self.tokens_per_row = kernel_blocks * tokens
        self.row_bytes = kernel_blocks * heads * tokens * num_pieces * 8
        self.chunk_rows = max(1, CHUNK_BYTES // max(self.row_bytes, 1))

        # Where each canonical axis sits in the gathered [rows, ...memory order] tensor.
        position = {axis: order.index(axis) + 1 for axis in range(1, 5)}
        self.piece_axis = position[_PIECE]
        self.token_axes = (position[_KERNEL_BLOCK], position[_TOKEN])

        factors = 2 * (torch.arange(heads, dtype=torch.int64) + first_slice) + 1  # m_h
        u = torch.arange(kernel_blocks * tokens, dtype=torch.int64).view(kernel_blocks, tokens)
        # Weights of the cell sums S, [kernel_blocks, heads, tokens] in memory order.
        cell_weights = factors[None, :, None] * (
            2 * u[:, None, :] * cell_pieces + 2 * piece_offset + 1
        )
        self.cell_weights = self._laid_out(cell_weights, order, _PIECE)
        # Weights of the piece sums Y, [heads, pieces] in memory order.
        piece_weights = 2 * factors[:, None] * torch.arange(num_pieces, dtype=torch.int64)
        self.piece_weights = self._laid_out(piece_weights, order, _KERNEL_BLOCK, _TOKEN)
        # Per head, what one unit of ``first`` adds per unit of cell sum.
        self.first_weights = 2 * cell_pieces * factors
        self.head_axis_of_cells = [a for a in order if a != _PIECE].index(_HEAD) + 1
        # The token index of every cell, for rows cut short, [kernel_blocks, heads, tokens]
        # in memory order.
        token_index = u[:, None, :].expand(kernel_blocks, heads, tokens)
        self.token_index = self._laid_out(token_index, order, _PIECE, flat=False)

    @staticmethod
    def _laid_out(
        weights: torch.Tensor, order: list[int], *dropped: int, flat: bool = True
    ) -> torch.Tensor:
        """Canonical-order ``weights`` (without the ``dropped`` axes) in memory order."""
        kept = [axis for axis in range(1, 5) if axis not in dropped]
        permuted = weights.permute(*(kept.index(a) for a in order if a in kept)).contiguous()
        return permuted.view(-1) if flat else permuted

    def accumulate(
        self,
        block_ids: torch.Tensor,
        first_tokens: torch.Tensor,
        valid_tokens: torch.Tensor,
        out: torch.Tensor,
        buffer: torch.Tensor | None = None,
    ) -> None:
        """Add this part's weighted sums of the rows into ``out[:, column]``, gathering
        them into ``buffer`` (``[chunk_rows, ...]`` like ``blocks``) when one is given."""
        counted = (valid_tokens > 0).nonzero().flatten()
        for start in range(0, len(counted), self.chunk_rows):
            index = counted[start : start + self.chunk_rows]
            out[index, self.column] += self._row_sums(
                block_ids[index], first_tokens[index], valid_tokens[index], buffer
            )

    def new_buffer(self) -> torch.Tensor | None:
        """A gather buffer for this part's layout (None off the CPU)."""
        if self.blocks.device.type != "cpu":
            return None
        return torch.empty((self.chunk_rows, *self.blocks.shape[1:]), dtype=self.blocks.dtype)

    def _row_sums(
        self,
        block_ids: torch.Tensor,
        first_tokens: torch.Tensor,
        valid_tokens: torch.Tensor,
        buffer: torch.Tensor | None,
    ) -> torch.Tensor:
        first = int(block_ids[0])
        if bool((block_ids == torch.arange(first, first + len(block_ids))).all()):
            # Consecutive blocks (a dump's rows in order, a fresh block table): read in place.
            x = self.blocks[first : first + len(block_ids)]
        elif buffer is None:
            x = self.blocks.index_select(0, block_ids)
        else:
            # Reusing one buffer: fresh allocations of this size cost more in page faults
            # than the copy itself.
            x = buffer[: len(block_ids)]
            torch.index_select(self.blocks, 0, block_ids, out=x)
        if self.zero_extend is not None:
            x = x.to(torch.int64) & self.zero_extend
        rows = len(block_ids)
        cells = x.sum(dim=self.piece_axis)  # S: [rows, kernel_blocks, heads, tokens] (memory order)
        cut = valid_tokens < self.tokens_per_row
        if bool(cut.any()):
            keep = self.token_index.unsqueeze(0) < valid_tokens.view(-1, 1, 1, 1)
            cells = cells * keep
            # Slots past num_tokens must not reach the piece sums either.
            x = x * keep.unsqueeze(self.piece_axis)
        pieces = x.sum(dim=self.token_axes)  # Y: [rows, heads, pieces] (memory order)
        sums = cells.reshape(rows, -1) @ self.cell_weights
        sums += pieces.reshape(rows, -1) @ self.piece_weights
        if bool(first_tokens.any()):
            other = tuple(a for a in (1, 2, 3) if a != self.head_axis_of_cells)
            sums += first_tokens * (cells.sum(dim=other) @ self.first_weights)
        return sums


class TorchLaunch:
    """Parts that share one layout, adding into their columns with one shared gather buffer
    (the torch backend's :class:`~kvaudit.checksum.kernels.Launch`)."""

    def __init__(self, parts: list[LaunchPart]) -> None:
        self.parts = [TorchPart(part) for part in parts]
        self._buffer: torch.Tensor | None = None

    def warm_up(self, num_columns: int = 0) -> None:
        """Allocate the gather buffer now rather than in a serving step."""
        if self._buffer is None:
            self._buffer = self.parts[0].new_buffer()

    def accumulate(
        self,
        block_ids: torch.Tensor,
        first_tokens: torch.Tensor,
        valid_tokens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Add every part's weighted sums of the rows into its column of ``out``
        ``[rows, columns]``."""
        if self._buffer is None:
            self.warm_up()
        for part in self.parts:
            part.accumulate(block_ids, first_tokens, valid_tokens, out, self._buffer)
