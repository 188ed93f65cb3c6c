"""Offloaded blocks against their stored checksums (``verify --stored``).

A stored checksum is a worker's partial sum of a block XOR a tag of the block's hash and
the group's fingerprint (docs/checksum.md); each worker's blocks are checked on their own
and the checks merged into one ``DiffReport``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import KvauditError
from ..core.validation import Positions
from ..description.fingerprint import block_checksum_tags
from .model import DiffReport, GroupComparison


def _uint64(values: np.ndarray | Sequence[int], what: str) -> np.ndarray:
    """An integer array as uint64 with the same bits (int64 wrap-around included)."""
    array = np.asarray(values)
    if array.dtype == np.int64:
        return array.view(np.uint64)
    if array.size == 0:
        return array.astype(np.uint64)
    if array.dtype.kind not in "iu":
        raise KvauditError(f"{what}: expected 64-bit integers, got {array.dtype}")
    return array.astype(np.uint64)


def verify_stored_blocks(
    request_id: str,
    group_id: int,
    positions: Sequence[int],
    recomputed: np.ndarray,
    stored: np.ndarray,
    block_hashes: Sequence[bytes],
    fingerprint: int,
) -> list[int]:
    """The positions whose stored checksum does not match one worker's recomputed sum.

    ``recomputed`` holds, per block, this worker's sum over its replica keys, or a
    ``[blocks, keys]`` array that is summed here (mod 2**64); ``stored`` the stored
    entries of the blocks' rows; ``block_hashes`` each block's hash; ``fingerprint``
    this worker's fingerprint of the group. A block passes when
    ``recomputed XOR tag(block_hash, fingerprint) == stored``.

    Raises:
        KvauditError: The arrays do not have one entry per position.

    """
    where = f"request {request_id} group {group_id}"
    sums = _uint64(recomputed, f"{where}: recomputed checksums")
    if sums.ndim == 2:
        sums = sums.sum(axis=1, dtype=np.uint64)
    entries = _uint64(stored, f"{where}: stored checksums")
    counts = {
        "recomputed checksums": sums.shape[0] if sums.ndim == 1 else -1,
        "stored checksums": entries.shape[0] if entries.ndim == 1 else -1,
        "block hashes": len(block_hashes),
    }
    for name, count in counts.items():
        if count != len(positions):
            raise KvauditError(
                f"{where}: {len(positions)} positions but "
                f"{'a malformed array of' if count < 0 else count} {name}"
            )
    if len(positions) == 0:
        return []
    tags = block_checksum_tags(block_hashes, fingerprint)
    failed = np.nonzero((sums ^ tags) != entries)[0]
    return [int(positions[i]) for i in failed.tolist()]


@dataclass
class StoredCheck:
    """One worker's stored-checksum check of one request's group: the positions checked
    and those that failed, or why it could not be checked."""

    request_id: str
    group_id: int
    block_size: int
    checked: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    unverified: str | None = None


def stored_report(checks: Iterable[StoredCheck], *, positions: Positions) -> DiffReport:
    """The workers' stored-checksum checks merged per request and group into a report.

    A position fails when it fails on any worker; a group is unverified when any worker
    could not check it, or when no worker checked a single block of it.
    """
    merged: dict[str, dict[int, list[StoredCheck]]] = {}
    for check in checks:
        merged.setdefault(check.request_id, {}).setdefault(check.group_id, []).append(check)
    requests: dict[str, dict[int, GroupComparison]] = {}
    for rid, groups in merged.items():
        requests[rid] = {}
        for gid in sorted(groups):
            parts = groups[gid]
            checked = {int(p) for part in parts for p in part.checked}
            failed = sorted({int(p) for part in parts for p in part.failed})
            reasons = list(dict.fromkeys(p.unverified for p in parts if p.unverified))
            if not reasons and not checked:
                reasons = ["no block of it has both a stored checksum and a block hash"]
            requests[rid][gid] = GroupComparison(
                compared=len(checked),
                mismatched_positions=failed,
                unverified="; ".join(reasons) if reasons else None,
                block_size=max(part.block_size for part in parts),
            )
    return DiffReport(positions, requests)
