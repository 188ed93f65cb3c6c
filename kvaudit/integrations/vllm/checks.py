"""What the scheduler side of the audit checks and counts: a consumer's arrived checksums
compared with the producer's position by position, the words its log lines use for what
was compared, and the counters reported to vLLM's connector stats and Prometheus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core.scheme import valid_tokens


@dataclass(frozen=True)
class GroupLayout:
    """What the scheduler needs of a KV cache group: its block size, whether it may
    hold null blocks for positions out of its window, and that window (a sliding
    window's tokens, or a chunked local attention's chunk; 0: none known)."""

    block_size: int
    windowed: bool = False
    sliding_window: int = 0
    attention_chunk: int = 0

    def freed_positions(self, computed_tokens: int) -> int:
        """How many leading block positions vLLM may have given back to its pool once
        ``computed_tokens`` tokens were computed (the positions out of the window of
        the next token: their blocks are freed, and reused, while the request runs)."""
        if self.sliding_window:
            skipped = max(0, computed_tokens - self.sliding_window + 1)
        elif self.attention_chunk:
            skipped = computed_tokens // self.attention_chunk * self.attention_chunk
        else:
            return 0
        return skipped // self.block_size


@dataclass
class AuditCounters:
    """Counts since the last report, for vLLM's connector stats and Prometheus.

    Blocks are the consumer's loaded block positions (per group): ``checked`` compared
    with the producer's, ``mismatched`` of those differing, ``unverified`` loaded but not
    compared (no producer checksums, a group not comparable, other valid tokens);
    ``local`` held in the consumer's prefix cache, so not transferred and not compared.
    ``declined_sync_loads``: synchronous loads declined under policy ``fail``.
    The workers add ``dumps_written`` and ``overhead_seconds`` (host time in kvaudit).
    ``internal_errors``: failures of kvaudit's own code, caught by its guard.
    """

    producer_requests: int = 0
    consumer_requests: int = 0
    mismatched_requests: int = 0
    mismatched_blocks: int = 0
    not_comparable_groups: int = 0
    unverified_requests: int = 0
    checked_blocks: int = 0
    unverified_blocks: int = 0
    local_blocks: int = 0
    declined_sync_loads: int = 0
    dumps_written: int = 0
    overhead_seconds: float = 0.0
    internal_errors: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return dict(self.__dict__)


def compared_positions(
    group: Any, mine: Any, producer_tokens: int, consumer_tokens: int
) -> tuple[list[int], list[int]]:
    """The positions compared (both sides hold them with the same valid tokens) and,
    of those, the ones whose totals differ."""
    totals = mine.totals()
    compared, differing = [], []
    for offset, value in enumerate(group.totals.tolist()):
        p = group.start + offset
        if not mine.start <= p < mine.end:
            continue
        size = group.block_size
        if valid_tokens(producer_tokens, size, p) != valid_tokens(consumer_tokens, size, p):
            continue
        compared.append(p)
        if int(totals[p - mine.start]) != value:
            differing.append(p)
    return compared, differing


def position_span(first: int, end: int) -> str:
    """Positions ``first .. end - 1`` as text."""
    return str(first) if end - first == 1 else f"{first}-{end - 1}"


def compared_text(compared: list[int], held: int, skipped: int) -> str:
    """What of a group was compared, as the log lines say it."""
    noun = "position" if len(compared) == 1 else "positions"
    parts = [f"{noun} {position_span(compared[0], compared[-1] + 1)} compared" if compared
             else "no position compared"]  # fmt: skip
    if held:
        parts.append(f"{position_span(0, held)} held locally (prefix cache), not compared")
    if skipped:
        parts.append(f"{skipped} loaded not compared (the producer's valid tokens differ)")
    return "; ".join(parts)


def mismatch_line(
    audit_id: str,
    group_id: int,
    positions: list[int],
    blocks: list[int],
    where: str,
    stale: list[str],
    searched: int,
) -> str:
    """The MISMATCH log line: what was compared, what differs, and what the search of
    recent producer blocks for the differing checksums found (a search, not a cause).

    Args:
        audit_id: The request's id.
        group_id: The group.
        positions: The positions whose checksums differ.
        blocks: Their block ids here.
        where: What was compared (``compared_text``).
        stale: Per differing position holding a recent producer block's checksum,
            ``position P holds R position Q``; empty where none does.
        searched: How many recent producer blocks were searched.

    Returns:
        The line.

    """
    found = (
        "; ".join(stale) + " (a stale block)"
        if stale
        else "no recent producer block holds these checksums"
    )
    return (
        f"kvaudit: MISMATCH request {audit_id} group {group_id}: positions {positions} "
        f"(blocks {blocks}) differ from the producer's checksums ({where}); looked up among "
        f"the last {searched} blocks received from the producer: {found}"
    )


def replica_differences(mine: Any) -> list[int]:
    """Positions where a consumer replica ``(R, r)`` differs from ``(R, 0)``."""
    keys = [tuple(k) for k in mine.replica_keys]
    out = set()
    for k, (replicas, index) in enumerate(keys):
        if index == 0 or (replicas, 0) not in keys:
            continue
        base = keys.index((replicas, 0))
        for row in np.nonzero(mine.values[:, k] != mine.values[:, base])[0].tolist():
            out.add(mine.start + row)
    return sorted(out)
