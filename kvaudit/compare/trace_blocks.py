"""Tracing differing consumer blocks by their bytes: the units to trace, the consumer's
digest of each, and the producer blocks whose slices hold the same (``trace`` decides
each position's sources from these).

The cost grows with the differing blocks plus the producer's blocks, never their
product: blocks of the same content are matched once, and the producer's blocks are
read once per block size traced, each slice's digest looked up among those of the
units wanted (a dict by content), not compared with every unit. Content that is all
zeros (a block never written, padding) is never a source: zeros say nothing of where a
block came from.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.scheme import valid_tokens
from ..description import CacheDescription
from ..locate import SliceReader
from ..locate.slices import SliceCells, SliceId
from ..workers import RawWorker
from .model import DiffReport

Slice = tuple[str, int]


"""``(layer name, global head)``: a slice of replica 0."""


Matches = dict[tuple[str, int], set[Slice]]


"""Producer blocks ``(request, position)`` with the unit's slices found to match there."""


@dataclass(frozen=True)
class TraceUnit:
    """One consumer block to trace: block ``index`` at ``size`` of a request's group (its
    first ``valid`` tokens), within compared position ``position`` (``whole``: the
    compared block itself), and the ``slices`` that differ there."""

    request: str
    group: int
    position: int
    size: int
    index: int
    valid: int
    slices: tuple[Slice, ...]
    whole: bool

    @property
    def first(self) -> int:
        """The request position of the block's first token."""
        return self.index * self.size


def finest_sizes(descriptions: Iterable[CacheDescription]) -> dict[int, int]:
    """Each group's smallest block size over the descriptions (both sides')."""
    sizes: dict[int, int] = {}
    for description in descriptions:
        for group in description.groups:
            sizes[group.id] = min(sizes.get(group.id, group.block_size), group.block_size)
    return sizes


def trace_units(
    report: DiffReport, num_tokens: Mapping[str, int], finest: Mapping[int, int]
) -> list[TraceUnit]:
    """The blocks to trace: each mismatched position with located slices, whole at the
    compared size, and, where ``finest[group]`` is smaller, each of its blocks at that
    size whose tokens differ; ``num_tokens`` are the tokens compared per request."""
    units = []
    for request_id, gid, group in report.groups():
        if not group.mismatched_positions or request_id not in num_tokens:
            continue
        size, tokens = group.block_size, num_tokens[request_id]
        fine = min(finest.get(gid, size), size)
        per_position: dict[int, dict[int, set[Slice]]] = defaultdict(lambda: defaultdict(set))
        for item in group.located:
            if item.replica == 0:
                for token in item.tokens:
                    per_position[item.position][int(token) // fine].add((item.layer, item.head))
        for position in sorted(set(group.mismatched_positions)):
            per_block = per_position.get(position)
            if not per_block:
                continue
            whole = sorted(set().union(*per_block.values()))
            valid = int(valid_tokens(tokens, size, position))
            units.append(
                TraceUnit(request_id, gid, position, size, position, valid, tuple(whole), True)
            )
            if fine < size:
                for index, slices in sorted(per_block.items()):
                    valid = int(valid_tokens(tokens, fine, index))
                    units.append(
                        TraceUnit(
                            request_id,
                            gid,
                            position,
                            fine,
                            index,
                            valid,
                            tuple(sorted(slices)),
                            False,
                        )
                    )
    return units


ZEROS = b""
"""The digest of cells that are all zero: a label of its own, so that a unit whose every
slice holds zeros can be told apart (and left without a source)."""


def _digest(cells: np.ndarray) -> bytes:
    """The digest of a slice's cells (``ZEROS`` where every byte is zero)."""
    if not cells.any():
        return ZEROS
    return hashlib.blake2b(cells.tobytes(), digest_size=16).digest()


def _digests(
    reader: SliceReader, request_id: str, group_id: int, lo: int, hi: int, layers: set[str]
) -> dict[Slice, bytes]:
    """Per replica-0 slice of ``layers`` that the reader's workers hold, a digest of its
    cells at request positions ``lo .. hi - 1`` (wherever in the request they sit)."""
    return _prefix_digests(reader, request_id, group_id, lo, [hi - lo], layers)[hi - lo]


def _prefix_digests(
    reader: SliceReader,
    request_id: str,
    group_id: int,
    lo: int,
    valids: Sequence[int],
    layers: set[str],
) -> dict[int, dict[Slice, bytes]]:
    """Per count ``v`` of ``valids`` (ascending), ``_digests`` of positions ``lo .. lo +
    v - 1``, from one read of the longest."""
    found = reader.gather(request_id, group_id, lo, lo + valids[-1], layers)
    return _block_digests(found, lo, valids)


def _block_digests(
    found: Mapping[SliceId, SliceCells], lo: int, valids: Sequence[int]
) -> dict[int, dict[Slice, bytes]]:
    """Per count ``v`` of ``valids``, the digest of each replica-0 slice's cells at
    request positions ``lo .. lo + v - 1`` among cells read over a span holding them:
    what a read of just those positions gives, the rows of those tokens (sorted)."""
    result: dict[int, dict[Slice, bytes]] = {v: {} for v in valids}
    for (name, head, replica), item in found.items():
        if replica != 0:
            continue
        start = int(np.searchsorted(item.tokens, lo))
        for v in valids:
            stop = int(np.searchsorted(item.tokens, lo + v))
            if stop > start:
                result[v][name, head] = _digest(item.cells[start:stop])
    return result


def unit_digests(
    consumer: Sequence[RawWorker], units: Sequence[TraceUnit]
) -> list[dict[Slice, bytes]]:
    """Per unit, the digests of its slices that the ``consumer`` workers hold."""
    readers: dict[tuple[str, int], SliceReader] = {}
    result = []
    for unit in units:
        key = (unit.request, unit.group)
        if key not in readers:
            readers[key] = SliceReader.open(consumer, *key)
        layers = {name for name, _ in unit.slices}
        held = _digests(readers[key], *key, unit.first, unit.first + unit.valid, layers)
        result.append({s: held[s] for s in unit.slices if s in held})
    return result


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


class ProducerBlocks:
    """The producer blocks of the groups traced, read and digested when matched."""

    def __init__(self, producer: Sequence[RawWorker], layers: Mapping[int, set[str]]) -> None:
        self.producer, self.layers = producer, layers
        self.blocks: dict[tuple[int, int], dict[str, range]] = {}
        self.counts = {
            rid: int(request.num_tokens) for w in producer for rid, request in w.requests.items()
        }

    def order(self) -> list[str]:
        """The producer's request ids, in the order its workers list them."""
        return list(dict.fromkeys(rid for w in self.producer for rid in w.requests))

    def match(
        self, units: Sequence[TraceUnit], targets: Sequence[Mapping[Slice, bytes]]
    ) -> list[Matches]:
        """Per unit, the producer blocks (at the unit's size, any request, at least the
        unit's valid tokens) where the unit's slices held here all equal its target (at
        least one), with those slices.

        Each producer block of a group and size is read once, its digests for every
        count of valid tokens the units need taken from that one read, and each digest
        looked up among the units' (a dict by content): the work grows with the units
        plus the producer's blocks, and with the matches found.

        Args:
            units: The units traced.
            targets: Per unit, the consumer's digest of each of its slices (where known).

        Returns:
            Per unit, its matching producer blocks with the slices matched there.

        """
        found: list[Matches] = [{} for _ in units]
        wanted: dict[tuple[int, int], dict[tuple[int, Slice, bytes], list[int]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for k, (unit, target) in enumerate(zip(units, targets, strict=True)):
            for piece in unit.slices:
                if piece in target:
                    wanted[unit.group, unit.size][unit.valid, piece, target[piece]].append(k)
        for (gid, size), keys in wanted.items():
            valids = sorted({valid for valid, _, _ in keys})
            for rid, q, per_valid in self._scan(gid, size, valids):
                for valid, digests in per_valid.items():
                    candidates = {
                        k for piece, d in digests.items() for k in keys.get((valid, piece, d), ())
                    }
                    for k in sorted(candidates):
                        held = [piece for piece in units[k].slices if piece in digests]
                        if all(targets[k].get(piece) == digests[piece] for piece in held):
                            found[k][rid, q] = set(held)
        return found

    def _scan(
        self, group_id: int, size: int, valids: list[int]
    ) -> Iterator[tuple[str, int, dict[int, dict[Slice, bytes]]]]:
        """Each producer block ``(request, position)`` of the group at ``size`` that
        holds at least the fewest of ``valids`` (ascending) tokens, with its digests per
        count of valid tokens it holds. A request's blocks are read several at a time
        (``READ_BLOCKS``, ``READ_BYTES``), each block once."""
        if (group_id, size) not in self.blocks:
            self.blocks[group_id, size] = _producer_blocks(self.producer, group_id, size)
        layers = self.layers[group_id]
        for rid, positions in self.blocks[group_id, size].items():
            counts = valid_tokens(
                self.counts[rid], size, np.arange(positions.start, positions.stop)
            )
            wanted = [
                (q, valids[: bisect.bisect_right(valids, tokens)])
                for q, tokens in zip(positions, counts.tolist(), strict=True)
            ]
            wanted = [(q, usable) for q, usable in wanted if usable]
            reader = SliceReader.open(self.producer, rid, group_id) if wanted else None
            step, k = 1, 0
            while reader is not None and k < len(wanted):
                part = wanted[k : k + step]
                lo, hi = part[0][0] * size, part[-1][0] * size + part[-1][1][-1]
                found = reader.gather(rid, group_id, lo, hi, layers)
                for q, usable in part:
                    yield rid, q, _block_digests(found, q * size, usable)
                k += len(part)
                held = sum(item.cells.nbytes for item in found.values())
                # Grown at most fourfold a read: the next blocks may hold more bytes.
                fit = READ_BYTES * len(part) // max(held, 1)
                step = max(1, min(4 * len(part), READ_BLOCKS, fit))


READ_BYTES = 16 << 20
"""At most about this many bytes of the producer's cells are held by one read of the
block trace, never the whole of a long request at once."""

READ_BLOCKS = 256
"""At most this many blocks of a request are read at once by the block trace: enough
that what a read costs besides its blocks is spread thin."""


def unit_layers(units: Iterable[TraceUnit]) -> dict[int, set[str]]:
    """Per group, the layers of the units' slices."""
    layers: dict[int, set[str]] = defaultdict(set)
    for unit in units:
        layers[unit.group].update(name for name, _ in unit.slices)
    return layers
