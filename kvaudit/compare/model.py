"""The diff report model: what a ``diff`` or ``verify`` found, per request and group.

``DiffReport`` holds one ``GroupComparison`` per request and group; the locate step adds
``LocatedDifference`` entries to the groups whose blocks differ. ``kvaudit.formats``
writes these as JSON and JUnit, ``kvaudit.report`` as tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..scheme import ReplicaKey
from ..validation import Positions

NO_RECEIVED = "no producer checksums received"


@dataclass
class LocatedDifference:
    """One (layer, global head) slice that differs at a compared block position.

    ``tokens`` are the request positions whose cells differ, ``first_byte`` the first
    differing byte of the first of them, the errors the largest over the differing
    elements read in their dtype (infinite where a value has no finite error).
    ``replica`` is 0 when consumer replica 0 was compared with the producer, else the
    consumer replica index compared with the consumer's replica 0.
    """

    position: int
    layer: str
    head: int
    tokens: list[int]
    first_byte: int
    max_abs_error: float
    max_rel_error: float
    replica: int = 0


@dataclass
class GroupComparison:
    """The comparison of one request's group.

    ``compared`` counts the positions compared, ``mismatched_positions`` lists those whose
    totals differ and ``replica_mismatches`` each ``(position, R, r)`` where consumer
    replica ``(R, r)`` differs; positions are numbered at ``block_size``, the coarser of
    the two sides'. ``unverified`` is why the group could not be compared (None when it
    was). ``located`` is filled by the locate step.
    """

    compared: int = 0
    mismatched_positions: list[int] = field(default_factory=list)
    replica_mismatches: list[tuple[int, int, int]] = field(default_factory=list)
    unverified: str | None = None
    located: list[LocatedDifference] = field(default_factory=list)
    block_size: int = 0

    @property
    def replicas_differing(self) -> list[ReplicaKey]:
        """The replica keys ``(R, r)`` that differ somewhere, sorted."""
        return sorted({(replicas, index) for _, replicas, index in self.replica_mismatches})

    @property
    def differs(self) -> bool:
        """Whether a compared block or a consumer replica differs."""
        return bool(self.mismatched_positions or self.replica_mismatches)

    @property
    def ok(self) -> bool:
        """Whether every compared block matched, no replica differed and it was compared."""
        return not self.differs and self.unverified is None


@dataclass
class DiffReport:
    """What a ``diff`` or ``verify`` found: per request and group, a ``GroupComparison``.

    ``only_in_producer`` lists requests the consumer lacks (a failure);
    ``only_in_consumer`` lists requests the producer lacks (informational).
    """

    positions: Positions
    requests: dict[str, dict[int, GroupComparison]] = field(default_factory=dict)
    only_in_producer: list[str] = field(default_factory=list)
    only_in_consumer: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True exactly when the exit status is 0: every compared block matched, nothing
        was left unverified and the consumer has every producer request."""
        return not self.only_in_producer and all(group.ok for _, _, group in self.groups())

    def groups(self) -> Iterator[tuple[str, int, GroupComparison]]:
        """Each ``(request id, group id, comparison)``, groups in id order."""
        for request_id, groups in self.requests.items():
            for gid in sorted(groups):
                yield request_id, gid, groups[gid]
