"""``combine_workers``: one engine's worker records summed into a ``Record``, request by
request and group by group, over the union of positions and replica keys; a group that a
worker covering it does not hold in whole is marked partial.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..core.errors import KvauditError
from ..core.scheme import MASK64, strong_add
from ..core.validation import POSITION_NUMBERINGS, describe_worker, worker_layout
from .model import GroupChecksums, LayerSums, RequestChecksums, WorkerRecord, WorkerSummary
from .record import Record


def combine_workers(records: Sequence[WorkerRecord]) -> Record:
    """Sums the partial checksums of one engine's workers.

    Each request and group covers the union of the workers' positions and replica keys;
    a worker's absent positions and keys count as 0. Where a worker that covers the group
    (gives it a fingerprint) lacks the request's group, or holds other positions of it
    than another worker, the group's ``partial`` says so: its sums miss that worker's
    part. A group's fingerprint sums, over PP stages, the one reported by each stage's
    lowest TP rank present.

    Args:
        records: One ``WorkerRecord`` per worker of the engine (any TP and PP ranks; a
            missing worker is not an error).

    Returns:
        The engine's record; ``complete`` is false and ``missing_workers`` lists the
        ``(pp_rank, tp_rank)`` absent when the TP x PP layout lacks workers.

    Raises:
        KvauditError: No records, workers that disagree on the position numbering, TP or
            PP size, a request's token count or a group's block size, or two workers with
            the same ranks; the message names the sources.

    Example:
        The sums add up across TP ranks: an engine at TP=2 (a head per rank) gets the totals of
        one worker holding both heads:

        >>> import numpy as np, torch
        >>> from kvaudit import Checksummer, RequestBlocks, combine_workers
        >>> from kvaudit.description import parse_description
        >>> def engine(caches):
        ...     spec = {"type": "full_attention", "block_size": 4, "head_size": 8,
        ...             "num_kv_heads": 2 // len(caches), "dtype": "float16", "layout": "NTHC"}
        ...     description = parse_description({"kvaudit": 1, "num_blocks": 2, "model_kv_heads": 2,
        ...         "groups": [{"spec": spec, "layers": ["model.layers.0.attn"]}]}, "tp")
        ...     request = {"r": RequestBlocks(8, {0: (0, [1, 0])})}
        ...     return combine_workers([
        ...         Checksummer(description, {"model.layers.0.attn": cache}, tp_rank=rank,
        ...                     tp_size=len(caches)).checksum(request)
        ...         for rank, cache in enumerate(caches)])
        >>> kv = torch.randn(2, 4, 2, 16).to(torch.float16)  # NTHC: [blocks, tokens, heads, K|V]
        >>> whole = engine([kv])
        >>> split = engine([kv[:, :, :1].contiguous(), kv[:, :, 1:].contiguous()])
        >>> split.complete, len(split.workers)
        (True, 2)
        >>> np.array_equal(whole.requests["r"].groups[0].totals(),
        ...                split.requests["r"].groups[0].totals())
        True

    """
    if not records:
        raise KvauditError("no worker records to combine")
    first = records[0]
    for record in records:
        if record.positions not in POSITION_NUMBERINGS:
            raise KvauditError(
                f"{describe_worker(record.worker)}: unknown position numbering {record.positions!r}"
            )
        if record.positions != first.positions:
            raise KvauditError(
                f"workers disagree on positions: {describe_worker(first.worker)} numbers them by "
                f"{first.positions}, {describe_worker(record.worker)} by {record.positions}"
            )
    missing = worker_layout([record.worker for record in records])

    # Per PP stage, the worker of lowest TP rank present reports the stage's fingerprints.
    stage_reporters: dict[int, WorkerRecord] = {}
    for record in records:
        current = stage_reporters.get(record.worker.pp_rank)
        if current is None or record.worker.tp_rank < current.worker.tp_rank:
            stage_reporters[record.worker.pp_rank] = record

    # Per worker, the groups it checksums for some request (found once: many requests).
    contributing = {
        id(record): {gid for request in record.requests.values() for gid in request.groups}
        for record in records
    }
    requests: dict[str, RequestChecksums] = {}
    for request_id in dict.fromkeys(rid for record in records for rid in record.requests):
        holders = [record for record in records if request_id in record.requests]
        request = requests[request_id] = _combine_request(request_id, holders, stage_reporters)
        for gid, group in request.groups.items():
            group.partial = _partial(request_id, gid, records, contributing)

    workers = [
        WorkerSummary(
            record.worker, dict(record.fingerprints), dict(record.not_covered), dict(record.layers)
        )
        for record in records
    ]
    return Record(first.positions, workers, not missing, requests, missing)


def _combine_request(
    request_id: str, holders: Sequence[WorkerRecord], stage_reporters: Mapping[int, WorkerRecord]
) -> RequestChecksums:
    """One request summed over the workers that hold it."""
    first = holders[0]
    num_tokens = first.requests[request_id].num_tokens
    for record in holders:
        if record.requests[request_id].num_tokens != num_tokens:
            raise KvauditError(
                f"request {request_id}: {describe_worker(first.worker)} has {num_tokens} tokens, "
                f"{describe_worker(record.worker)} has {record.requests[request_id].num_tokens}"
            )
    group_ids = sorted({gid for record in holders for gid in record.requests[request_id].groups})
    groups: dict[int, GroupChecksums] = {}
    for gid in group_ids:
        parts = [
            (record, record.requests[request_id].groups[gid])
            for record in holders
            if gid in record.requests[request_id].groups
        ]
        groups[gid] = _combine_group(request_id, gid, parts, stage_reporters)
    return RequestChecksums(num_tokens, groups)


def _combine_group(
    request_id: str,
    gid: int,
    parts: Sequence[tuple[WorkerRecord, GroupChecksums]],
    stage_reporters: Mapping[int, WorkerRecord],
) -> GroupChecksums:
    """One request's group summed over the workers that hold it."""
    first_record, first_group = parts[0]
    for record, group in parts:
        if group.block_size != first_group.block_size:
            raise KvauditError(
                f"request {request_id} group {gid}: {describe_worker(first_record.worker)} has "
                f"block size {first_group.block_size}, {describe_worker(record.worker)} has "
                f"{group.block_size}"
            )
    keys = sorted({tuple(key) for _, group in parts for key in group.replica_keys})
    column = {key: k for k, key in enumerate(keys)}
    start = min(group.start for _, group in parts)
    end = max(group.end for _, group in parts)
    values = np.zeros((end - start, len(keys)), dtype=np.uint64)
    # The strong lane only where every worker's part carries it: a sum missing a part
    # would read as a mismatch.
    strong = np.zeros_like(values) if all(group.strong is not None for _, group in parts) else None
    for _, group in parts:
        columns = [column[tuple(key)] for key in group.replica_keys]
        rows = slice(group.start - start, group.end - start)
        # uint64 addition wraps modulo 2**64, as the definition requires.
        values[rows, columns] += np.asarray(group.values, dtype=np.uint64)
        if strong is not None and group.strong is not None:
            strong[rows, columns] = strong_add(
                strong[rows, columns], np.asarray(group.strong, dtype=np.uint64)
            )

    held = {id(record): group for record, group in parts}
    fingerprint = 0
    for reporter in stage_reporters.values():
        if gid in reporter.fingerprints:
            fingerprint += reporter.fingerprints[gid]
        elif id(reporter) in held:
            fingerprint += held[id(reporter)].fingerprint
    return GroupChecksums(
        block_size=first_group.block_size,
        start=start,
        replica_keys=[(int(r), int(i)) for r, i in keys],
        values=values,
        fingerprint=fingerprint & MASK64,
        strong=strong,
        layer_sums=layer_sums_sum([group for _, group in parts], start, end),
    )


def layer_sums_sum(groups: Sequence[GroupChecksums], start: int, end: int) -> LayerSums | None:
    """The layer sums of some workers' parts of one group, summed per label mod 2**64.

    Args:
        groups: Each worker's checksums of the group.
        start: The first position of the sum.
        end: One past its last position.

    Returns:
        Positions ``start .. end - 1``, one column per label any worker has (labels in
        order); None when a worker recorded no layer sums (a sum without its part would
        name a layer that does not differ).

    """
    sums = [group.layer_sums for group in groups]
    if not sums or any(s is None for s in sums):
        return None
    parts = sorted({part for s in sums if s is not None for part in s.parts})
    column = {part: k for k, part in enumerate(parts)}
    values = np.zeros((end - start, len(parts)), dtype=np.uint64)
    for group, s in zip(groups, sums, strict=True):
        assert s is not None
        columns = [column[part] for part in s.parts]
        rows = slice(group.start - start, group.end - start)
        # uint64 addition wraps modulo 2**64, as the totals' does.
        values[rows, columns] += np.asarray(s.values, dtype=np.uint64)
    return LayerSums(parts, values)


def _partial(
    request_id: str,
    gid: int,
    records: Sequence[WorkerRecord],
    contributing: Mapping[int, set[int]],
) -> str | None:
    """Why a request's group sums miss a worker's part, or None: every worker that covers
    the group (TP ranks and PP stages share one block table) must hold the same positions
    of it."""
    lacking: list[WorkerRecord] = []
    spans: dict[tuple[int, int], list[WorkerRecord]] = {}
    for record in records:
        if gid not in record.fingerprints or gid in record.not_covered:
            continue
        request = record.requests.get(request_id)
        group = None if request is None else request.groups.get(gid)
        if group is not None:
            spans.setdefault((group.start, group.end), []).append(record)
        elif gid in contributing[id(record)] or not record.requests:
            # A worker that lists requests but adds nothing to the group in any of them (a
            # producer's rank holding copies only) is not missed.
            lacking.append(record)
    if lacking and spans:
        names = ", ".join(describe_worker(record.worker) for record in lacking)
        return f"{names} {'does' if len(lacking) == 1 else 'do'} not hold it"
    if len(spans) > 1:
        held = "; ".join(
            f"{', '.join(describe_worker(record.worker) for record in holders)} {start}..{end - 1}"
            for (start, end), holders in sorted(spans.items())
        )
        return f"its workers hold different positions ({held})"
    return None
