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

Where the sides' block sizes differ, positions are compared at the coarser size, but KV
is reused and sent in each side's own blocks: one stale block of the finer side leaves
the rest of the coarse block intact, and no producer block holds the whole. A position
that nothing holds whole is therefore traced again block by block at the finer size,
each block whose tokens differ on its own, its sources named at that size.
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


def _wanted_slices(group: GroupComparison, size: int) -> dict[int, dict[int, set[_Slice]]]:
    """Per mismatched position, per block (at ``size``) holding tokens that differ, the
    slices whose replica 0 differs from the producer there."""
    slices: dict[int, dict[int, set[_Slice]]] = defaultdict(lambda: defaultdict(set))
    for item in group.located:
        if item.replica == 0:
            for token in item.tokens:
                slices[item.position][int(token) // size].add((item.layer, item.head))
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


def _finest(workers: Sequence[RawWorker], group_id: int) -> int | None:
    """The smallest block size of the group among the workers that hold its layers."""
    sizes = [
        worker.description.group(group_id).block_size
        for worker in workers
        if any(group.id == group_id for group in worker.description.groups)
    ]
    return min(sizes, default=None)


class _Producer:
    """The producer's blocks of one group, read and digested on demand, each digest once."""

    def __init__(self, producer: Sequence[RawWorker], group_id: int, layers: set[str]) -> None:
        self.producer, self.group_id, self.layers = producer, group_id, layers
        requests = _producer_blocks(producer, group_id, 1)
        self.readers = {rid: SliceReader.open(producer, rid, group_id) for rid in requests}
        self.counts = {
            rid: int(next(w.requests[rid].num_tokens for w in producer if rid in w.requests))
            for rid in requests
        }
        self.blocks: dict[int, dict[str, range]] = {}
        self.digests: dict[tuple[str, int, int], dict[_Slice, bytes]] = {}

    def holding(
        self, size: int, valid: int, target: dict[_Slice, bytes | None]
    ) -> list[tuple[str, int]]:
        """``(request, position at size)`` of each producer block (at ``size``) with at least
        ``valid`` valid tokens whose slices hold ``target``'s digests over ``valid`` tokens."""
        if size not in self.blocks:
            self.blocks[size] = _producer_blocks(self.producer, self.group_id, size)
        found = []
        for rid, positions in self.blocks[size].items():
            for q in positions:
                if int(valid_tokens(self.counts[rid], size, q)) < valid:
                    continue
                key = (rid, q * size, valid)
                if key not in self.digests:
                    self.digests[key] = _digests(
                        self.readers[rid],
                        rid,
                        self.group_id,
                        q * size,
                        q * size + valid,
                        self.layers,
                    )
                digests = self.digests[key]
                if all(
                    digest is not None and digests.get(s) == digest for s, digest in target.items()
                ):
                    found.append((rid, q))
        return found


def trace_group(
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    request_id: str,
    group_id: int,
    group: GroupComparison,
    num_tokens: int,
) -> dict[int, list[StaleSource]]:
    """The producer blocks holding the content of each of the group's mismatched
    positions, from its located entries; ``num_tokens`` are the tokens compared.

    A position is traced whole, at the group's compared block size; where nothing holds
    it and the sides' block sizes differ, each of its blocks at the finer size whose
    tokens differ is traced on its own (a sender's or a slot's unit of reuse), and its
    sources carry that ``block_size`` and the ``consumer_position`` traced. Positions
    without located slices are left out; a position no producer block explains maps to
    an empty list."""
    size = group.block_size
    fine = min(
        (found for found in (_finest(producer, group_id), _finest(consumer, group_id)) if found),
        default=size,
    )
    units = _wanted_slices(group, fine)
    if not units:
        return {}
    layers = {
        name for per_unit in units.values() for slices in per_unit.values() for name, _ in slices
    }
    consumed = SliceReader.open(consumer, request_id, group_id)
    blocks = _Producer(producer, group_id, layers)
    result: dict[int, list[StaleSource]] = {}
    for position in sorted(set(group.mismatched_positions)):
        per_unit = units.get(position)
        if not per_unit:
            continue
        slices = set().union(*per_unit.values())
        sources = [
            StaleSource(rid, group_id, q)
            for rid, q in _holding(blocks, consumed, request_id, position, size, num_tokens, slices)
        ]
        if not sources and fine < size:
            for unit, unit_slices in sorted(per_unit.items()):
                sources += [
                    StaleSource(rid, group_id, q, fine, unit)
                    for rid, q in _holding(
                        blocks, consumed, request_id, unit, fine, num_tokens, unit_slices
                    )
                ]
        result[position] = sources
    return result


def _holding(
    blocks: _Producer,
    consumed: SliceReader,
    request_id: str,
    position: int,
    size: int,
    num_tokens: int,
    slices: set[_Slice],
) -> list[tuple[str, int]]:
    """The producer blocks (at ``size``) whose ``slices`` hold the same bytes as the
    consumer's block at ``position`` over its valid tokens."""
    lo = position * size
    valid = int(valid_tokens(num_tokens, size, position))
    held = _digests(consumed, request_id, blocks.group_id, lo, lo + valid, blocks.layers)
    return blocks.holding(size, valid, {key: held.get(key) for key in slices})


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
