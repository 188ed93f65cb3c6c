"""Records: checksums per request, group and block position under each replica key.

A ``WorkerRecord`` is what one worker computed; ``Record`` sums the workers of one
engine (a dump set) and is what ``kvaudit checksum --format json`` writes (docs/cli.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .scheme import ReplicaKey

POSITION_NUMBERINGS = ("request", "block")


@dataclass
class GroupChecksums:
    """One group's checksums of one request.

    ``values[i, k]`` is the checksum of position ``start + i`` under
    ``replica_keys[k]`` (uint64).
    """

    block_size: int
    start: int
    replica_keys: list[ReplicaKey]
    values: np.ndarray
    fingerprint: int

    @property
    def count(self) -> int:
        return int(self.values.shape[0])

    def totals(self) -> np.ndarray:
        """Per position, the sum of the columns whose replica index is 0 (uint64)."""
        columns = [k for k, (_, index) in enumerate(self.replica_keys) if index == 0]
        if not columns:
            return np.zeros(self.count, dtype=np.uint64)
        return self.values[:, columns].sum(axis=1, dtype=np.uint64)


@dataclass
class RequestChecksums:
    """One request's checksums: its token count and each checksummed group."""

    num_tokens: int
    groups: dict[int, GroupChecksums] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerInfo:
    """Which worker a record comes from."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    role: str = "producer"
    engine: str = ""
    source: str = ""


@dataclass
class WorkerRecord:
    """One worker's partial checksums, with its group fingerprints and uncovered groups."""

    worker: WorkerInfo
    positions: str
    fingerprints: dict[int, int]
    not_covered: dict[int, str]
    requests: dict[str, RequestChecksums]
