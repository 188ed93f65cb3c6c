"""``verify --stored``: each dump's stored checksums of offloaded blocks against the blocks
checksummed again.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..checksum.dump_set import checksum_dump_set
from ..compare import DiffReport, StoredCheck, stored_report, verify_stored_blocks
from ..description import LEFT_OUT_BY_DESCRIPTION
from ..dumps import Dump, DumpSet
from ..records import Record
from ..sources import Progress, Runtime, resolve_device

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
    stored = dump.stored_checksums[[dump.row_of(block_id) for block_id in block_ids[:count]]]
    failed = verify_stored_blocks(rid, gid, positions, recomputed, stored, hashes, fingerprint)
    return StoredCheck(rid, gid, block_size, checked=positions, failed=failed)
