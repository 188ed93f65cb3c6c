"""Tracing differing consumer blocks by the two sides' checksums, where the raw KV is not
read (a record on one side, ``--no-locate``, a ``verify --against``).

The producer blocks of the same group whose totals equal the consumer block's total,
over the same number of valid tokens, are its stale sources: the literal rule of the
spec (docs/cli.md). Under ``block`` numbering a block's checksum does not depend on its
position, so a block delivered anywhere is found; under ``request`` numbering each token
is weighed by its position in the request, so only a producer block at the same
position (of another request) can match, and the report says so where a block found no
source (``partial_note``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..core.scheme import valid_tokens
from ..records import Record
from ..records.model import replica_zero_totals
from .groups import SideChecksums, coarsen
from .model import MAX_SOURCES, DiffReport, StaleSource

Content = tuple[int, int]


"""A block's content as its checksums see it: ``(total, valid tokens)``."""


def partial_note(why: str) -> str:
    """What a report says of a trace by request-numbered checksums that left a differing
    block without a source: a block from another position cannot be found that way."""
    return (
        f"traced by checksums only ({why}): request-numbered checksums match only a block "
        "at the same position; a record checksummed with --positions block, or both sides' "
        "raw KV, traces any position"
    )


def _contents(
    record: Record, gid: int, block_size: int, fingerprint: int
) -> dict[Content, list[tuple[str, int]]]:
    """Every block of group ``gid`` in ``record`` at ``block_size`` (finer blocks summed,
    as a diff compares them), by content: ``(request, position)`` pairs."""
    found: dict[Content, list[tuple[str, int]]] = defaultdict(list)
    for request_id, request in record.requests.items():
        group = request.groups.get(gid)
        if group is None or group.fingerprint != fingerprint or block_size % group.block_size:
            continue
        positions, columns = coarsen(SideChecksums.of(group, request.num_tokens), block_size)
        totals = replica_zero_totals(columns, group.replica_keys).tolist()
        valid = valid_tokens(request.num_tokens, block_size, positions).tolist()
        for position, total, tokens in zip(positions.tolist(), totals, valid, strict=True):
            if tokens > 0:
                found[total, tokens].append((request_id, position))
    return found


def _consumer_contents(
    record: Record, request_id: str, gid: int, block_size: int, positions: list[int]
) -> dict[int, Content]:
    """The content of each of the consumer's ``positions`` (at ``block_size``) that it
    forms there."""
    request = record.requests[request_id]
    group = request.groups[gid]
    if block_size % group.block_size:
        return {}
    formed, columns = coarsen(SideChecksums.of(group, request.num_tokens), block_size)
    totals = replica_zero_totals(columns, group.replica_keys)
    at = {int(q): k for k, q in enumerate(formed.tolist())}
    wanted = [q for q in positions if q in at]
    valid = valid_tokens(request.num_tokens, block_size, np.array(wanted, dtype=np.int64))
    return {
        q: (int(totals[at[q]]), int(tokens))
        for q, tokens in zip(wanted, valid.tolist(), strict=True)
    }


def trace_by_checksums(report: DiffReport, producer: Record, consumer: Record) -> bool:
    """Fill the ``stale_sources`` of every differing group of ``report`` from the two
    records' checksums (a position no producer block matches maps to an empty list; the
    first ``MAX_SOURCES`` are listed, ``stale_matches`` counts where more match; a block
    whose total is 0, as zeros are, is not traced). Returns whether the trace is
    partial: some position found no source under ``request`` numbering, where only
    sources at its own position can be found."""
    index: dict[tuple[int, int, int], dict[Content, list[tuple[str, int]]]] = {}
    unmatched = False
    for request_id, gid, group in report.groups():
        if not group.mismatched_positions or request_id not in consumer.requests:
            continue
        consumed = consumer.requests[request_id].groups.get(gid)
        if consumed is None:
            continue
        key = (gid, group.block_size, consumed.fingerprint)
        if key not in index:
            index[key] = _contents(producer, *key)
        held = _consumer_contents(
            consumer, request_id, gid, group.block_size, group.mismatched_positions
        )
        for position in group.mismatched_positions:
            content = held.get(position)
            # Zeros (which every scheme sums to 0) say nothing of where a block came from.
            known = content is not None and content[0] != 0
            matches = index[key].get(content, []) if known else []
            sources = [
                StaleSource(source, gid, at)
                for source, at in matches
                if (source, at) != (request_id, position)
            ]
            group.stale_sources[position] = sources[:MAX_SOURCES]
            if len(sources) > MAX_SOURCES:
                group.stale_matches[position] = len(sources)
            unmatched = unmatched or (known and not sources)
    return unmatched and consumer.positions == "request"
