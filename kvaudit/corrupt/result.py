"""What ``corrupt`` planted: the typed result of ``corrupt_dump``."""

from __future__ import annotations

from dataclasses import dataclass

from .mode_names import MODES as MODES  # re-exported: where kvaudit.corrupt finds it
from .mode_names import CorruptMode


@dataclass(frozen=True)
class ChangedSlice:
    """One (layer, global head) of the block whose cells changed.

    ``tokens`` are the changed request positions below ``num_tokens``,
    ``tokens_past_end`` those at or past it.
    """

    layer: str
    head: int
    tokens: list[int]
    tokens_past_end: list[int]


@dataclass(frozen=True)
class FlippedBit:
    """``flip``: the bit flipped, in the cell of a layer, global head and request position."""

    layer: str
    head: int
    token: int
    byte: int
    bit: int


@dataclass(frozen=True)
class SwappedTokens:
    """``swap-tokens``: two request positions swapped in one layer and global head."""

    layer: str
    head: int
    tokens: list[int]


@dataclass(frozen=True)
class SwappedHeads:
    """``swap-heads``: two global heads swapped in one layer."""

    layer: str
    heads: list[int]


@dataclass(frozen=True)
class StaleOrigin:
    """``stale``: the block the content came from.

    It is another request's block (its request and position), or a row no request lists
    (``request`` and ``position`` None).
    """

    request: str | None
    position: int | None
    block: int
    row: int


@dataclass
class PlantedFault:
    """What ``corrupt_dump`` wrote, and where the fault is.

    The fields give where the fault is (request, group, position, engine block, dump
    row), the layers, global heads and request positions it changed
    (``changes`` per slice), the changed bytes of the output file (``byte_ranges``,
    ``[start, end)``), and the mode's own details (``flip``, ``swap`` or ``origin``)."""

    source: str
    out: str
    mode: CorruptMode
    seed: int
    request: str
    group: int
    position: int
    block: int
    row: int
    num_tokens: int
    layers: list[str]
    heads: list[int]
    tokens: list[int]
    changes: list[ChangedSlice]
    byte_ranges: list[list[int]]
    flip: FlippedBit | None = None
    swap: SwappedTokens | SwappedHeads | None = None
    origin: StaleOrigin | None = None
