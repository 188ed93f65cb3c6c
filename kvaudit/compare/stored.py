"""``verify --stored``: offloaded blocks against their stored checksums.

A stored checksum is a worker's partial sum of a block XOR a tag of the block's hash and
the group's fingerprint (docs/checksum.md); each worker's blocks are checked on their own
and the checks merged into one ``DiffReport``. ``verify_stored_blocks`` checks one worker's
blocks; ``verify_stored`` drives it over each dump of a source, its blocks checksummed
again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..checksum.dump_set import checksum_dump_set
from ..core.errors import KvauditError
from ..core.validation import Positions
from ..description import LEFT_OUT_BY_DESCRIPTION
from ..description.fingerprint import block_checksum_tags
from ..dumps import Dump, DumpSet
from ..records import Record
from ..sources import Runtime, resolve_device
from ..workers import Progress
from .model import DiffReport, GroupComparison, seed_lane_notes

STORED_SEED_LANE = "stored checksums carry the seed lane alone"
"""Why ``verify --stored`` compares by the seed lane: an engine stores one 64-bit word."""


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
                seed_lane_only=STORED_SEED_LANE,
            )
    report = DiffReport(positions, requests)
    report.warnings = seed_lane_notes(report)
    return report


NO_STORED = "a dump of the set holds no stored checksums"


def verify_stored(
    dump_set: DumpSet,
    *,
    request_ids: Sequence[str] | None = None,
    runtime: Runtime | None = None,
    progress: Progress | None = None,
) -> DiffReport:
    """Each dump's stored checksums against its blocks recomputed (checksum.md, "Stored
    checksums of offloaded blocks"): per worker, every listed block with a block hash.

    A dump without stored checksums leaves its requests' groups unverified; a group no
    block of which has a hash is unverified too, and so is a group a worker cannot
    checksum; a group its description leaves out (``transfer: false``, ``host_resident:
    true``) is left out.
    """
    runtime = runtime or resolve_device("auto")
    ids = dump_set.request_ids if request_ids is None else request_ids
    checks = [
        check for dump in dump_set.dumps for check in stored_checks(dump, ids, runtime, progress)
    ]
    return stored_report(checks, positions="request")


def stored_checks(
    dump: Dump, request_ids: Sequence[str], runtime: Runtime, progress: Progress | None = None
) -> list[StoredCheck]:
    """One dump's stored-checksum checks of those requests it holds, group by group."""
    held = [rid for rid in request_ids if rid in dump.requests]
    if not held:
        return []
    record = checksum_dump_set(
        DumpSet([dump], True),
        request_ids=held,
        positions="request",
        backend=runtime.backend,
        device=runtime.device,
        progress=progress,
    )
    summary = record.workers[0]
    checks: list[StoredCheck] = []
    for rid in held:
        request = dump.requests[rid]
        for gid in sorted(request.groups):
            reason = summary.not_covered.get(gid)
            if reason in LEFT_OUT_BY_DESCRIPTION:
                continue
            if reason is not None:
                block_size = dump.description.group(gid).block_size
                unverified = f"not covered on this worker ({reason})"
                checks.append(StoredCheck(rid, gid, block_size, unverified=unverified))
                continue
            checks.append(_stored_check(dump, record, summary.fingerprints[gid], rid, gid))
    return checks


def _stored_check(dump: Dump, record: Record, fingerprint: int, rid: str, gid: int) -> StoredCheck:
    """One worker's check of one request's group."""
    request = dump.requests[rid]
    start, block_ids = request.groups[gid]
    block_size = dump.description.group(gid).block_size
    if dump.stored_checksums is None:
        return StoredCheck(rid, gid, block_size, unverified=NO_STORED)
    hashes = request.block_hashes.get(gid, [])
    count = len(hashes)
    positions = list(range(start, start + count))
    group = record.requests[rid].groups[gid]
    recomputed = group.values[start - group.start : start - group.start + count]
    stored = dump.stored_checksums[[dump.row_of(block_id, gid) for block_id in block_ids[:count]]]
    failed = verify_stored_blocks(rid, gid, positions, recomputed, stored, hashes, fingerprint)
    return StoredCheck(rid, gid, block_size, checked=positions, failed=failed)
