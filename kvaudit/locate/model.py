"""What locating found: the (layer, head) slices that differ at a block position, and
the one element that differs where only one does.

These results travel up to every package above ``locate``: ``compare`` keeps them in its
``GroupComparison``, ``diagnosis`` explains them, ``formats`` and ``report`` write them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElementChange:
    """The one element of a located entry that differs: its place in the cell and its
    value on each side, read in its dtype.

    ``part`` is ``K`` or ``V`` where the cell is a K row then a V row (empty otherwise),
    ``index`` the element's index within that part (within the cell where ``part`` is
    empty), ``dtype`` the dtype's name; ``before`` is the producer's value (the reference
    replica's, for a replica), ``after`` the consumer's: floats for a floating dtype,
    else integers.
    """

    part: str
    index: int
    dtype: str
    before: float | int
    after: float | int


@dataclass
class LocatedDifference:
    """One (layer, global head) slice that differs at a compared block position.

    ``tokens`` are the request positions whose cells differ, ``first_byte`` the first
    differing byte of the first of them, the errors the largest over the differing
    elements read in their dtype (infinite where a value has no finite error);
    ``scaled_error`` is the largest error over the slice's largest finite producer value
    at the block's tokens, which stays finite on KV with exact zeros (where the relative
    error is infinite) and says how large the damage is against the values around it.
    ``replica`` is 0 when consumer replica 0 was compared with the producer, else the
    consumer replica index compared with the consumer's replica 0.

    What the diagnosis reads (``kvaudit.diagnosis``): ``differing_bytes`` and
    ``differing_bits`` count the bytes and bits that differ over the differing tokens'
    cells; ``consumer_zeros`` says whether the consumer's cells there are all zero;
    ``nonfinite`` counts the consumer elements that are NaN or infinite where the
    producer's are finite; ``holds`` is the other producer slice ``(layer, head)`` whose
    cells at the block's tokens the consumer slice holds byte for byte (None: none does).
    ``kv_exchanged`` says the consumer's K rows hold the producer's V rows of the same
    slice and tokens, and its V rows the producer's K rows; ``element`` describes the
    one element that differs where exactly one does (None otherwise).
    """

    position: int
    layer: str
    head: int
    tokens: list[int]
    first_byte: int
    max_abs_error: float
    max_rel_error: float
    scaled_error: float = 0.0
    replica: int = 0
    consumer_worker: tuple[int, int] | None = None
    file: str = ""
    differing_bytes: int = 0
    differing_bits: int = 0
    consumer_zeros: bool = False
    nonfinite: int = 0
    holds: tuple[str, int] | None = None
    kv_exchanged: bool = False
    element: ElementChange | None = None
