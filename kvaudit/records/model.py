"""The checksums of requests and workers: a group's checksums per block position and replica
key (``GroupChecksums``), a request's groups, who a worker is, what one worker computed
(``WorkerRecord``), what a record keeps of each worker (``WorkerSummary``) and of each of
its layers (``LayerFacts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.scheme import ReplicaKey, strong_add
from ..core.validation import Positions, Role
from .wire import WireChecksums, WireGroup

RECORD_FORMAT = "kvaudit.record/1"


PLANES = ("K", "V", "KV")
"""A layer part's plane: its K rows, its V rows, or whole cells (a fused row, a latent, a
state)."""

LayerPart = tuple[int, str]
"""A layer sum's label: ``(layer number, plane)``."""


@dataclass
class LayerSums:
    """A group's per-block totals split per layer and plane (docs/checksum.md, "Layer sums").

    ``values[i, k]`` is the part of position ``i``'s total (the replica-0 columns) that
    layer ``parts[k][0]``'s plane ``parts[k][1]`` adds, uint64; summed over ``k`` it is
    the position's total. Like the totals, each adds up over TP ranks and PP stages.
    """

    parts: list[LayerPart]
    values: np.ndarray


@dataclass
class GroupChecksums:
    """One group's checksums of one request.

    ``values[i, k]`` is the checksum of position ``start + i`` under
    ``replica_keys[k]`` (uint64, the seed lane); ``strong[i, k]`` the same position's
    strong lane (a residue modulo ``2**64 - 59``, docs/checksum.md), or ``strong`` None
    where the record holds the seed lane alone. ``partial`` says why the values are
    partial sums (a worker that covers the group lacks the request or some of its
    positions), None when every worker that covers the group added its part.
    ``layer_sums``: the seed lane's totals split per layer and K or V plane (None where not
    recorded).
    """

    block_size: int
    start: int
    replica_keys: list[ReplicaKey]
    values: np.ndarray
    fingerprint: int
    partial: str | None = None
    strong: np.ndarray | None = None
    layer_sums: LayerSums | None = None

    @property
    def count(self) -> int:
        """The number of positions held."""
        return int(self.values.shape[0])

    @property
    def end(self) -> int:
        """One past the last position held."""
        return self.start + self.count

    def totals(self) -> np.ndarray:
        """Per position, the sum of the columns whose replica index is 0 (uint64)."""
        return replica_zero_totals(self.values, self.replica_keys)

    def strong_totals(self) -> np.ndarray | None:
        """Per position, the strong lane's sum of the replica-0 columns (None without it)."""
        if self.strong is None:
            return None
        return strong_replica_zero_totals(self.strong, self.replica_keys)

    def to_wire(self, group_id: int) -> WireGroup:
        """The group's totals as a producer sends them.

        Args:
            group_id: The group's id, which the group's checksums do not hold.

        Returns:
            The group's fingerprint, block size, start and per-position totals.

        """
        return WireGroup(
            group_id,
            self.fingerprint,
            self.block_size,
            self.start,
            self.totals(),
            self.strong_totals(),
        )


def replica_zero_totals(values: np.ndarray, replica_keys: Sequence[ReplicaKey]) -> np.ndarray:
    """Per row of ``values``, the sum mod 2**64 of the columns whose replica index is 0.

    Args:
        values: Checksums, one row per position and one column per replica key.
        replica_keys: The ``(R, r)`` of each column.

    Returns:
        The totals (uint64); zeros when no column is of replica 0.

    """
    columns = [k for k, (_, index) in enumerate(replica_keys) if index == 0]
    if not columns:
        return np.zeros(values.shape[0], dtype=np.uint64)
    return values[:, columns].sum(axis=1, dtype=np.uint64)


def strong_replica_zero_totals(
    strong: np.ndarray, replica_keys: Sequence[ReplicaKey]
) -> np.ndarray:
    """Per row of ``strong``, the sum modulo ``2**64 - 59`` of the replica-0 columns.

    Args:
        strong: Strong-lane residues, one row per position and one column per replica key.
        replica_keys: The ``(R, r)`` of each column.

    Returns:
        The totals (uint64 residues); zeros when no column is of replica 0.

    """
    totals = np.zeros(strong.shape[0], dtype=np.uint64)
    for k, (_, index) in enumerate(replica_keys):
        if index == 0:
            totals = strong_add(totals, strong[:, k])
    return totals


@dataclass
class RequestChecksums:
    """One request's checksums: its token count and each checksummed group."""

    num_tokens: int
    groups: dict[int, GroupChecksums] = field(default_factory=dict)

    def to_wire(self, numbering: Positions) -> WireChecksums:
        """What a producer sends for the request, for ``encode_wire`` to write.

        Args:
            numbering: The record's position numbering (``"request"`` or ``"block"``).

        Returns:
            The request's token count, ``numbering`` and the totals per group, in group
            id order.

        """
        groups = [self.groups[gid].to_wire(gid) for gid in sorted(self.groups)]
        return WireChecksums(self.num_tokens, numbering, groups)


@dataclass(frozen=True)
class WorkerInfo:
    """Which worker a record comes from."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    role: Role = "producer"
    engine: str = ""
    source: str = ""


@dataclass(frozen=True)
class LayerFacts:
    """What a record keeps of one layer of a worker's description: what its checksums
    cannot show (the scales of a quantized cache) and what names a fingerprint's
    difference (docs/cache-description.md).

    ``dtype`` is the dtype's name (a state layer's: its states' dtypes, comma-separated);
    ``head_size`` and ``head_size_v`` are 0 for a state layer; a scale is None where the
    description gives none (the values are the stored ones).
    """

    group: int
    spec_class: str
    dtype: str
    head_size: int = 0
    head_size_v: int = 0
    k_scale: float | None = None
    v_scale: float | None = None


@dataclass
class WorkerRecord:
    """One worker's partial checksums, with its group fingerprints and uncovered groups,
    and the facts of its layers where its description is known (empty where not)."""

    worker: WorkerInfo
    positions: Positions
    fingerprints: dict[int, int]
    not_covered: dict[int, str]
    requests: dict[str, RequestChecksums]
    layers: dict[str, LayerFacts] = field(default_factory=dict)


@dataclass
class WorkerSummary:
    """One worker of a record: who it is, its group fingerprints and uncovered groups, and
    its layers' facts (empty where its description is not known)."""

    worker: WorkerInfo
    fingerprints: dict[int, int] = field(default_factory=dict)
    not_covered: dict[int, str] = field(default_factory=dict)
    layers: dict[str, LayerFacts] = field(default_factory=dict)
