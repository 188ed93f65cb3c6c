"""The piece-view dataclasses: a cache part as unsigned integer pieces (``PieceView``), one
layer's cache on a worker (``LayerView``), a group's views or the reason it has none
(``GroupViews``), and a cache before its heads are numbered (``LocalCache``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from ..core.arrays import Array
from ..core.dtypes import DType
from ..core.scheme import ReplicaKey, slice_number
from ..description import GroupDescription

LayerTensor: TypeAlias = "Array | tuple[Array, Array]"
"""A layer's cache: one tensor in its layout, or K and V tensors for layouts without ``K``
(torch tensors, or numpy arrays of the elements' bytes as integers: ``kvaudit.core.arrays``)."""


@dataclass(frozen=True)
class PieceView:
    """One stored part of a cache (a whole cell, or its K or V row) as unsigned pieces
    ``[blocks, kernel_blocks, heads, tokens, pieces]``, any strides.

    ``piece_offset`` is the index of the part's first piece within the cell, and
    ``cell_pieces`` the number of pieces of the whole cell. ``k_pieces``: where the part
    holds whole cells of a K row then a V row (a ``C`` layout), the K row's pieces, by
    which layer sums split it into K and V; 0 otherwise.
    """

    pieces: Array
    piece_offset: int
    cell_pieces: int
    k_pieces: int = 0


@dataclass(frozen=True)
class LayerView:
    """One cache of one layer on this worker: ``heads`` consecutive global heads from
    ``first_head``, held by this rank as replica ``replica_key[1]`` of ``replica_key[0]``."""

    name: str
    number: int
    first_head: int
    heads: int
    replica_key: ReplicaKey
    parts: tuple[PieceView, ...]
    dtype: DType

    @property
    def first_slice(self) -> int:
        """``L * H + h`` of this rank's first head."""
        return slice_number(self.number, self.first_head)


@dataclass
class GroupViews:
    """A group's views on one worker, or the reason it is not covered."""

    group: GroupDescription
    fingerprint: int
    views: list[LayerView] = field(default_factory=list)
    reason: str | None = None

    @property
    def covered(self) -> bool:
        return self.reason is None


@dataclass
class LocalCache:
    """A distinct cache (or state segment) before its heads are numbered across the layer
    module: ``heads`` per rank, rank ``r`` holding shard ``r // replicas``, and
    ``first_head`` relative to the cache's place in its module."""

    heads: int
    replicas: int
    parts: tuple[PieceView, ...]
    dtype: DType
    first_head: int = 0
    global_heads: int = 0
