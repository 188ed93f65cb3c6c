"""Tracing differing consumer blocks to the producer blocks whose content they hold.

A consumer block that differs from the producer's block at its position may hold another
block's KV: a slot reused while a transfer was in flight, a stale sender. Content does
not depend on where it sits, so for each differing position the cells of its differing
(layer, global head) slices (the located entries of replica 0) are compared, byte for
byte over the block's valid tokens, with those of every producer block of the same group
(any request, any position) that holds at least as many valid tokens. Each producer block
whose slices hold the same bytes is a ``StaleSource`` of the consumer position. That is
what equal block-numbered checksums of the two blocks would say, decided on the bytes
that the locate step reads anyway.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Mapping, Sequence

from .compare.model import DiffReport, GroupComparison, StaleSource
from .locate import SliceReader
from .scheme import valid_tokens
from .sources.raw import RawWorker

_Slice = tuple[str, int]
"""``(layer name, global head)``: a slice of replica 0."""


def _digests(
    reader: SliceReader,
    request_id: str,
    group_id: int,
    lo: int,
    hi: int,
    layers: set[str],
) -> dict[_Slice, bytes]:
    """Per replica-0 slice of ``layers``, a digest of its cells at request positions
    ``lo .. hi - 1`` (wherever in the request they sit)."""
    found = reader.gather(request_id, group_id, lo, hi, layers)
    result = {}
    for (name, head, replica), item in found.items():
        if replica == 0 and len(item.tokens):
            result[name, head] = hashlib.blake2b(item.cells.tobytes(), digest_size=16).digest()
    return result


def _wanted_slices(group: GroupComparison) -> dict[int, set[_Slice]]:
    """Per mismatched position, the slices whose replica 0 differs from the producer."""
    slices: dict[int, set[_Slice]] = defaultdict(set)
    for item in group.located:
        if item.replica == 0:
            slices[item.position].add((item.layer, item.head))
    return slices


def _producer_blocks(producer: Sequence[RawWorker], group_id: int, size: int) -> dict[str, range]:
    """Each producer request that lists blocks of the group, with the positions (at
    ``size``) its listed blocks and tokens reach: bounded by the blocks listed."""
    found: dict[str, range] = {}
    for worker in producer:
        if all(group.id != group_id for group in worker.description.groups):
            continue  # another pipeline stage's worker: none of the group's layers
        block_size = worker.description.group(group_id).block_size
        for request_id, request in worker.requests.items():
            if group_id not in request.groups:
                continue
            start, block_ids = request.groups[group_id]
            with_tokens = -(-int(request.num_tokens) // size)
            lo = start * block_size // size
            hi = min(with_tokens, -(-(start + len(block_ids)) * block_size // size))
            seen = found.get(request_id, range(lo, lo))
            found[request_id] = range(min(seen.start, lo), max(seen.stop, hi))
    return found


def trace_group(
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    request_id: str,
    group_id: int,
    group: GroupComparison,
    num_tokens: int,
) -> dict[int, list[StaleSource]]:
    """The producer blocks (positions at the group's compared block size) holding the
    content of each of the group's mismatched positions, from its located entries;
    ``num_tokens`` are the tokens compared. Positions without located slices are left
    out; a position no producer block explains maps to an empty list."""
    wanted = _wanted_slices(group)
    if not wanted:
        return {}
    size = group.block_size
    layers = {name for slices in wanted.values() for name, _ in slices}
    consumed = SliceReader.open(consumer, request_id, group_id)
    blocks = _producer_blocks(producer, group_id, size)
    produced = {rid: SliceReader.open(producer, rid, group_id) for rid in blocks}
    counts = {
        rid: int(next(w.requests[rid].num_tokens for w in producer if rid in w.requests))
        for rid in blocks
    }
    # Producer digests per (request, position, valid tokens), computed once.
    cache: dict[tuple[str, int, int], dict[_Slice, bytes]] = {}
    result: dict[int, list[StaleSource]] = {}
    for position in sorted(set(group.mismatched_positions)):
        slices = wanted.get(position)
        if not slices:
            continue
        lo = position * size
        valid = int(valid_tokens(num_tokens, size, position))
        held = _digests(consumed, request_id, group_id, lo, lo + valid, layers)
        target = {key: held.get(key) for key in slices}
        sources = []
        for rid, reader in produced.items():
            for q in blocks[rid]:
                if int(valid_tokens(counts[rid], size, q)) < valid:
                    continue
                key = (rid, q, valid)
                if key not in cache:
                    cache[key] = _digests(reader, rid, group_id, q * size, q * size + valid, layers)
                digests = cache[key]
                if all(
                    digest is not None and digests.get(s) == digest for s, digest in target.items()
                ):
                    sources.append(StaleSource(rid, group_id, q))
        result[position] = sources
    return result


def trace_report(
    report: DiffReport,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
) -> None:
    """Fill each group's ``stale_sources`` from its located differences."""
    for request_id, gid, group in report.groups():
        if group.mismatched_positions and request_id in num_tokens:
            group.stale_sources = trace_group(
                producer, consumer, request_id, gid, group, num_tokens[request_id]
            )


__all__ = ["trace_group", "trace_report"]
