"""How much the by-value comparison reads, decodes and holds at once (docs/numeric.md):
one ``NumericBudget`` passed down the comparison, never module globals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NumericBudget:
    """The sizes that bound the by-value comparison's memory and set its steps.

    The defaults suit any machine; smaller ones exercise the piecewise paths in tests.
    """

    batch_bytes: int = 8 << 20
    """About how many raw bytes each side reads per batch (memory stays bounded)."""
    piece_elements: int = 1 << 18
    """About how many elements of a side one layer decodes at once in numpy (compared in
    cache-sized chunks of heads: ``chunk_elements``)."""
    native_piece_elements: int = 1 << 20
    """The same where the C extension compares (one pass over a piece: larger pieces,
    fewer steps in Python; 2 MiB of bf16 bits a side)."""
    mapped_piece_elements: int = 1 << 22
    """The same where it reads both sides' dumps in place (nothing staged: only 16 bytes
    of location per row and side are held; a piece is then usually a whole batch)."""
    chunk_tokens: int = 256
    """Rows read in place go a block of tokens (at most this many) at a time
    (kvaudit/_native/_mapped_rows.h)."""
    mapped_bytes: int = 256 << 20
    """About how many bytes of the dumps' mapped pages the threads reading rows in place
    hold at most, together: each releases the 2 MiB regions it read once they reach its
    share (a chunk's regions more at most), and at the end of each piece."""
    chunk_elements: int = 1 << 17
    """Elements per chunk of heads that numpy compares at once (about 1 MiB of float64:
    the chunk stays in the cache between passes)."""

    def piece_elements_for(self, native: bool, mapped: bool) -> int:
        """The piece size of the path that compares.

        Args:
            native: The C extension compares (else numpy).
            mapped: The C extension reads the rows in place (else they are staged).

        Returns:
            ``piece_elements``, ``native_piece_elements`` or ``mapped_piece_elements``.

        """
        if not native:
            return self.piece_elements
        return self.mapped_piece_elements if mapped else self.native_piece_elements


DEFAULT_BUDGET = NumericBudget()
"""The budget ``diff --numeric`` runs with."""
