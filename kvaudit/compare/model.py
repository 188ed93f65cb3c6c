"""The diff report model: what a ``diff`` or ``verify`` found, per request and group.

``DiffReport`` holds one ``GroupComparison`` per request and group; the locate step adds
``LocatedDifference`` entries to the groups whose blocks differ. ``kvaudit.formats``
writes these as JSON and JUnit, ``kvaudit.report`` as tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..core.scheme import ReplicaKey
from ..core.validation import Positions
from ..locate.model import LocatedDifference

NO_RECEIVED = "no producer checksums received"

MAX_SOURCES = 8
"""At most this many producer places are listed per traced block (or finer block) and
per run of tokens: content that many places hold (zeros aside: a repeated pattern, a
prompt shared by many requests) would otherwise make the report as large as the
producer. How many there are is kept (``GroupComparison.stale_matches``,
``TokenRun.matches``) and said: ``matches N places, first K shown``."""


def matches_text(total: int, shown: int) -> str:
    """What a report says of a list of places cut short: ``matches 1200 places, first 8
    shown``."""
    return f"matches {total} places, first {shown} shown"


@dataclass(frozen=True)
class TokenShift:
    """Consumer tokens ``first .. last`` of one request that hold the producer's tokens
    ``first - shift .. last - shift`` of the same request, in every slice that differs
    there: KV written ``shift`` slots late (negative: early).

    ``slices`` are the ``(layer, head)`` slices compared, ``residue`` the differing
    tokens of the same positions that the shift does not explain (the slot the shift
    left behind, typically).
    """

    first: int
    last: int
    shift: int
    slices: tuple[tuple[str, int], ...] = ()
    residue: tuple[int, ...] = ()


@dataclass(frozen=True)
class StaleSource:
    """A producer block whose content a differing consumer block holds.

    ``position`` is in the producer's numbering of the compared block size. A trace at a
    finer block size (block sizes differ and only part of the compared block is stale)
    sets ``block_size`` to it: ``position`` is then the producer's block at that size,
    and ``consumer_position`` the consumer's block at that size holding its content.
    """

    request: str
    group: int
    position: int
    block_size: int | None = None
    consumer_position: int | None = None


@dataclass(frozen=True)
class TokenRun:
    """Consumer tokens ``first .. first + count - 1`` of a differing position that no
    producer block holds whole, traced token by token.

    ``sources`` are the producer places ``(request, first token)`` whose tokens hold the
    same bytes in every slice that differs there; empty where none does (not traced: no
    producer slice holds these bytes). ``traced`` is False where the run was not looked
    for (past the report's limit of runs traced). ``matches`` is how many places hold the
    run where more do than ``sources`` lists (the first ``MAX_SOURCES`` of them, in the
    producer's order); None where every one is listed.
    """

    position: int
    first: int
    count: int
    sources: tuple[tuple[str, int], ...] = ()
    traced: bool = True
    matches: int | None = None

    @property
    def last(self) -> int:
        """The request position of the run's last token."""
        return self.first + self.count - 1


@dataclass
class GroupComparison:
    """The comparison of one request's group.

    ``compared`` counts the positions compared, ``mismatched_positions`` lists those whose
    totals differ and ``replica_mismatches`` each ``(position, R, r)`` where consumer
    replica ``(R, r)`` differs; positions are numbered at ``block_size``, the coarser of
    the two sides'. ``missing_positions`` lists the positions the producer holds with
    valid tokens that the consumer lacks in whole or in part; ``held`` each side's
    number of positions with valid tokens (producer, consumer). ``unverified`` is why the
    group could not be compared (None when it was). ``located`` and ``stale_sources``
    (consumer position to the producer blocks holding its content) are filled by the
    locate step, and ``token_runs`` (the runs of differing tokens of positions that no
    producer block holds, traced token by token) by the trace; ``stale_matches`` holds,
    for each traced position whose sources were cut to the first ``MAX_SOURCES`` (per
    block traced), how many producer blocks hold its content. ``layers`` (the group's
    layer names, in order) and ``heads`` (its global KV heads) are filled where a side's
    description is known, for the pictures and the diagnosis (empty and 0 where not).
    ``not_located`` says why a differing group was not located where the sides hold the
    KV of some requests only (an output folder's dumps), None otherwise. ``token_shifts``
    are the runs of differing tokens that hold the same request's tokens a few slots
    away (``kvaudit.compare.trace_shifts``).
    ``layer_differences`` gives, per differing position, the ``(layer number, plane)``
    whose layer sums differ, where both sides' records hold layer sums (an in-engine
    audit's output folder): what names the layer and K or V without a dump.
    ``seed_lane_only`` says why the group was compared by the seed lane alone (a side
    carries no strong lane, or it was asked), None where both lanes were compared or the
    group was not compared (docs/checksum.md).
    """

    compared: int = 0
    mismatched_positions: list[int] = field(default_factory=list)
    replica_mismatches: list[tuple[int, int, int]] = field(default_factory=list)
    unverified: str | None = None
    located: list[LocatedDifference] = field(default_factory=list)
    block_size: int = 0
    missing_positions: list[int] = field(default_factory=list)
    held: tuple[int, int] | None = None
    stale_sources: dict[int, list[StaleSource]] = field(default_factory=dict)
    token_runs: list[TokenRun] = field(default_factory=list)
    stale_matches: dict[int, int] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)
    heads: int = 0
    not_located: str | None = None
    token_shifts: list[TokenShift] = field(default_factory=list)
    layer_differences: dict[int, list[tuple[int, str]]] = field(default_factory=dict)
    seed_lane_only: str | None = None

    @property
    def replicas_differing(self) -> list[ReplicaKey]:
        """The replica keys ``(R, r)`` that differ somewhere, sorted."""
        return sorted({(replicas, index) for _, replicas, index in self.replica_mismatches})

    @property
    def differs(self) -> bool:
        """Whether a compared block or a consumer replica differs."""
        return bool(self.mismatched_positions or self.replica_mismatches)

    def passes(self, *, allow_missing: bool = False) -> bool:
        """Whether the group passes: nothing differs, it was compared, nothing is missing.

        Every compared block matched, no replica differed, the group was compared and
        (unless ``allow_missing``) the consumer lacks no position.

        Args:
            allow_missing: Positions the consumer lacks do not fail the group.

        Returns:
            Whether the group passes.

        """
        missing = bool(self.missing_positions) and not allow_missing
        return not self.differs and self.unverified is None and not missing

    @property
    def ok(self) -> bool:
        """``passes()`` with missing positions counted as failures."""
        return self.passes()


@dataclass
class DiffReport:
    """What a ``diff`` or ``verify`` found: per request and group, a ``GroupComparison``.

    ``only_in_producer`` lists requests the consumer lacks (a failure);
    ``only_in_consumer`` lists requests the producer lacks (informational).
    ``num_tokens`` holds each request's token count on each side (producer, consumer;
    None where a side does not say). ``allow_missing`` accepts missing positions and
    ``allow_empty`` a report in which nothing was compared. ``warnings`` are things the
    user should know (swapped roles, a set compared with itself); ``untraced`` says why
    the trace of differing blocks to producer blocks is partial (by request-numbered
    checksums, a block left without a source) or absent, None when it is neither.
    ``scale_differences`` lists each layer scale that differs between the sides (``scale
    differs: consumer k_scale 2.0, producer 1.0, LAYER``): a mismatch, whatever the
    checksums say.
    """

    positions: Positions
    requests: dict[str, dict[int, GroupComparison]] = field(default_factory=dict)
    only_in_producer: list[str] = field(default_factory=list)
    only_in_consumer: list[str] = field(default_factory=list)
    num_tokens: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    allow_missing: bool = False
    allow_empty: bool = False
    warnings: list[str] = field(default_factory=list)
    untraced: str | None = None
    scale_differences: list[str] = field(default_factory=list)

    def group_ok(self, group: GroupComparison) -> bool:
        """Whether a group passes under the report's ``allow_missing``.

        Args:
            group: One of the report's group comparisons.

        Returns:
            ``group.passes(allow_missing=self.allow_missing)``.

        """
        return group.passes(allow_missing=self.allow_missing)

    @property
    def compared(self) -> int:
        """The blocks compared over every request and group."""
        return sum(group.compared for _, _, group in self.groups())

    @property
    def empty_reason(self) -> str | None:
        """Why nothing was verified, or None when something was or ``allow_empty`` accepts it.

        Nothing is verified when no block was compared, the sides share no request, or a
        request has no group to compare.
        """
        if self.allow_empty:
            return None
        empty = [rid for rid, groups in self.requests.items() if not groups]
        if empty:
            return f"no group of request {', '.join(empty)} is covered on either side"
        if self.compared == 0 and not self.only_in_producer:
            if not self.requests:
                return "the two sides have no request in common"
            return "no block was compared"
        return None

    @property
    def ok(self) -> bool:
        """True exactly when the exit status is 0.

        Every compared block matched, nothing was left unverified or missing (unless
        allowed), something was compared (unless allowed) and the consumer has every
        producer request, and no layer's scale differs.
        """
        if self.only_in_producer or self.scale_differences or self.empty_reason is not None:
            return False
        return all(self.group_ok(group) for _, _, group in self.groups())

    def groups(self) -> Iterator[tuple[str, int, GroupComparison]]:
        """Each ``(request id, group id, comparison)``, groups in id order."""
        for request_id, groups in self.requests.items():
            for gid in sorted(groups):
                yield request_id, gid, groups[gid]


def seed_lane_notes(report: DiffReport) -> list[str]:
    """The report's lines saying which compared groups rested on the seed lane alone and
    why (each reason once): a verdict there misses what only the strong lane sees.

    Args:
        report: A report whose groups say ``seed_lane_only``.

    Returns:
        ``compared by the seed lane only: <why>`` per distinct reason, in report order.

    """
    reasons = dict.fromkeys(
        group.seed_lane_only
        for _, _, group in report.groups()
        if group.seed_lane_only is not None and group.compared
    )
    return [f"{SEED_LANE_NOTE}: {reason}" for reason in reasons if reason is not None]


SEED_LANE_NOTE = "compared by the seed lane only"
"""How a report's note on groups compared by the seed lane alone begins."""
