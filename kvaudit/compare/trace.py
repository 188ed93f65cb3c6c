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

The steps are separate so that processes holding parts of the sides can each do theirs
(``kvaudit.distributed.spread_trace``): ``trace_units`` (what to trace), ``unit_digests``
(the consumer's content of each), ``ProducerBlocks.match`` (the producer blocks whose
slices held here match) and ``stale_sources`` (the sources, from every part's matches,
finer blocks only where the whole finds none).

The cost grows with the differing blocks plus the producer's blocks, never their
product: blocks of the same content are matched once, and the producer's blocks are
read once per block size traced, each slice's digest looked up among those of the
units wanted (a dict by content), not compared with every unit. Content that is all
zeros (a block never written, padding) is never a source: zeros say nothing of where a
block came from. A block (or run of tokens) held in many places lists the first
``MAX_SOURCES`` in the producer's order and says how many there are.

Where the raw KV is not read (a record on one side, ``--no-locate``, a ``verify
--against``: ``trace_by_checksums``), the producer blocks of the same group whose totals equal the
consumer block's total, over the same number of valid tokens, are its stale sources: the
literal rule of the spec (docs/cli.md). Under ``block`` numbering a block's checksum does
not depend on its position, so a block delivered anywhere is found; under ``request``
numbering each token is weighed by its position in the request, so only a producer block
at the same position (of another request) can match, and the report says so where a
block found no source.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..core.scheme import valid_tokens
from ..description import CacheDescription
from ..locate import SliceReader
from ..locate.slices import SliceCells, SliceId
from ..records import Record
from ..records.model import replica_zero_totals
from ..sources.raw import RawWorker
from .groups import SideChecksums, coarsen
from .model import (
    MAX_SOURCES,
    DiffReport,
    GroupComparison,
    LocatedDifference,
    StaleSource,
    TokenRun,
)

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


def _held(
    unit: TraceUnit, target: Mapping[Slice, bytes], found: Matches, rank: Mapping[str, int]
) -> list[tuple[str, int]]:
    """The producer blocks ``(request, position)`` where every slice of the unit matched
    its (complete) ``target``, in the producer's request order (``rank``), then by
    position."""
    if set(target) != set(unit.slices):
        return []  # a slice whose content is unknown matches nothing
    return sorted(
        (block for block, slices in found.items() if slices == set(unit.slices)),
        key=lambda block: (rank.get(block[0], len(rank)), block[0], block[1]),
    )


def _zeros(unit: TraceUnit, target: Mapping[Slice, bytes]) -> bool:
    """Whether every slice of the unit holds zeros: content that says nothing of where
    it came from, never traced."""
    return bool(unit.slices) and all(target.get(piece) == ZEROS for piece in unit.slices)


@dataclass
class Traced:
    """Per (request, group), each traced position's sources (the first ``MAX_SOURCES``
    per block traced) and, where more blocks hold its content, how many."""

    sources: dict[tuple[str, int], dict[int, list[StaleSource]]] = field(
        default_factory=lambda: defaultdict(dict)
    )
    matches: dict[tuple[str, int], dict[int, int]] = field(
        default_factory=lambda: defaultdict(dict)
    )

    def fill(self, report: DiffReport) -> None:
        """Set ``stale_sources`` and ``stale_matches`` of each traced group of ``report``."""
        for request_id, gid, group in report.groups():
            if (request_id, gid) in self.sources:
                group.stale_sources = self.sources[request_id, gid]
                group.stale_matches = dict(self.matches.get((request_id, gid), {}))


Digest = Callable[[list[TraceUnit]], list[dict[Slice, bytes]]]


"""The consumer's digests of each unit's slices (complete where the content is known)."""


Match = Callable[[list[TraceUnit], list[dict[Slice, bytes]]], list[Matches]]


"""Each unit's matching producer blocks, with the slices matched (over every part)."""


def _traced_blocks(
    units: Sequence[TraceUnit], digest: Digest, match: Match, rank: Mapping[str, int]
) -> list[tuple[list[tuple[str, int]], int]]:
    """Per unit, the first ``MAX_SOURCES`` producer blocks holding its content and how
    many do. Units of the same content (group, size, valid tokens, slices and digests)
    are matched once; units of zeros, or of content not known whole, not at all."""
    targets = digest(list(units))
    keys: list[tuple[object, ...] | None] = []
    first: dict[tuple[object, ...], int] = {}  # each content's first unit
    for k, (unit, target) in enumerate(zip(units, targets, strict=True)):
        if set(target) != set(unit.slices) or _zeros(unit, target):
            keys.append(None)
            continue
        key = (unit.group, unit.size, unit.valid, tuple(sorted(target.items())))
        keys.append(key)
        first.setdefault(key, k)
    found = match([units[k] for k in first.values()], [targets[k] for k in first.values()])
    held = {
        key: _held(units[k], targets[k], matches, rank)
        for (key, k), matches in zip(first.items(), found, strict=True)
    }
    result = []
    for key in keys:
        blocks = held[key] if key is not None else []
        result.append((blocks[:MAX_SOURCES], len(blocks)))
    return result


def stale_sources(
    units: Sequence[TraceUnit], digest: Digest, match: Match, order: Sequence[str]
) -> Traced:
    """Each traced position's sources: its whole unit's, else (only then traced) those of
    its blocks at the finer size, in unit order; at most ``MAX_SOURCES`` per unit, with
    how many there are where more. ``digest`` and ``match`` do the reading; ``order`` is
    the producer's order of requests."""
    rank = {rid: k for k, rid in enumerate(order)}
    traced = Traced()
    whole = [unit for unit in units if unit.whole]
    for unit, (blocks, total) in zip(whole, _traced_blocks(whole, digest, match, rank)):
        key = (unit.request, unit.group)
        traced.sources[key][unit.position] = [StaleSource(rid, unit.group, q) for rid, q in blocks]
        if total > len(blocks):
            traced.matches[key][unit.position] = total
    finer = [
        unit
        for unit in units
        if not unit.whole and not traced.sources[unit.request, unit.group][unit.position]
    ]
    if finer:
        counted: dict[tuple[str, int, int], tuple[int, bool]] = {}
        for unit, (blocks, total) in zip(finer, _traced_blocks(finer, digest, match, rank)):
            key = (unit.request, unit.group)
            traced.sources[key][unit.position] += [
                StaleSource(rid, unit.group, q, unit.size, unit.index) for rid, q in blocks
            ]
            where = (unit.request, unit.group, unit.position)
            count, cut = counted.get(where, (0, False))
            counted[where] = (count + total, cut or total > len(blocks))
        for (request_id, gid, position), (total, cut) in counted.items():
            if cut:
                traced.matches[request_id, gid][position] = total
    return traced


def trace_report(
    report: DiffReport,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
) -> None:
    """Fill each group's ``stale_sources`` from its located differences.

    Positions without located slices are left out; a position whose content no producer
    block holds maps to an empty list. Where a side's blocks are finer than the compared
    ones and a whole compared block finds no source, its finer blocks are traced.

    Args:
        report: A located report (``diff_sources`` fills ``located`` first).
        producer: The producer's raw KV, where the stale content may come from.
        consumer: The consumer's raw KV, which holds the differing blocks.
        num_tokens: Per request, the tokens compared.

    """
    workers = [*producer, *consumer]
    units = trace_units(report, num_tokens, finest_sizes(w.description for w in workers))
    blocks = ProducerBlocks(producer, unit_layers(units))

    traced = stale_sources(
        units, lambda chosen: unit_digests(consumer, chosen), blocks.match, blocks.order()
    )
    traced.fill(report)
    budget = MAX_TOKEN_RUNS
    for request_id, gid, group in report.groups():
        if (request_id, gid) in traced.sources:
            budget = _trace_token_runs(group, request_id, gid, producer, consumer, blocks, budget)


def _trace_token_runs(
    group: GroupComparison,
    request_id: str,
    group_id: int,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    blocks: ProducerBlocks,
    budget: int,
) -> int:
    """Fill the group's ``token_runs``, tracing at most ``budget`` runs (the rest marked
    not traced); returns the budget left."""
    order = blocks.order()
    for run in untraced_runs(group):
        if budget <= 0:
            group.token_runs.append(replace(run, traced=False))
            continue
        budget -= 1
        args = (group.located, producer, consumer, request_id, group_id, order)
        found = trace_run(run, *args)
        if not found.sources and 1 < run.count <= MAX_SINGLE_TOKENS:
            # Tokens exchanged within the run: each may still be found on its own.
            singles = [
                trace_run(replace(run, first=t, count=1), *args)
                for t in range(run.first, run.last + 1)
            ]
            if all(one.sources for one in singles):
                group.token_runs.extend(singles)
                continue
        group.token_runs.append(found)
    return budget


MAX_TOKEN_RUNS = 8
"""At most this many runs of differing tokens are traced token by token per report: each
reads one layer of every producer request."""

MAX_SINGLE_TOKENS = 8
"""A run of at most this many tokens that no producer place holds whole is traced again
token by token (tokens exchanged within a block)."""


def untraced_runs(group: GroupComparison) -> list[TokenRun]:
    """The runs of consecutive differing tokens (replica 0) of each position that the
    trace left without a source, not yet traced: tokens whose cells differ in more than
    a byte each and hold more than zeros."""
    runs = []
    for position, sources in sorted(group.stale_sources.items()):
        if sources:
            continue
        # Cells another token's bytes replaced differ in most of their bytes; a flipped bit
        # or byte, or zeros, came from nowhere: nothing to look for.
        moved = [
            item
            for item in group.located
            if item.position == position
            and item.replica == 0
            and not item.consumer_zeros
            and item.differing_bytes > len(item.tokens)
        ]
        tokens = sorted({int(t) for item in moved for t in item.tokens})
        start = 0
        for k in range(1, len(tokens) + 1):
            if k == len(tokens) or tokens[k] != tokens[k - 1] + 1:
                runs.append(TokenRun(position, tokens[start], k - start, (), True))
                start = k
    return runs


def _run_cells(
    reader: SliceReader, request_id: str, group_id: int, first: int, count: int, layers: set[str]
) -> dict[Slice, np.ndarray]:
    """The replica-0 cells ``[count, cell bytes]`` of ``layers`` at request positions
    ``first .. first + count - 1``, per slice holding all of them."""
    found = reader.gather(request_id, group_id, first, first + count, layers)
    return {
        (name, head): item.cells
        for (name, head, replica), item in found.items()
        if replica == 0 and len(item.tokens) == count
    }


RUN_CHUNK = 4096
"""The producer's tokens read at once when a run of tokens is traced: a long request is
read a part at a time, so that what is held stays small whatever its length."""

FEW_CANDIDATES = 16
"""A part of the producer with at most this many candidate places (where the first
slice matches) reads each candidate's tokens in every layer; with more, it reads the
part whole, a layer at a time, and checks every candidate at once."""


def _starts_holding(
    tokens: np.ndarray, cells: np.ndarray, starts: np.ndarray, want: np.ndarray
) -> np.ndarray:
    """Which of ``starts`` begin ``len(want)`` consecutive request positions that a
    slice's ``tokens`` (sorted) all hold, their ``cells`` equal to ``want`` row by row,
    as ``_run_cells`` and a comparison would say for each start."""
    count = len(want)
    lo = np.searchsorted(tokens, starts)
    ok = np.searchsorted(tokens, starts + count) - lo == count
    if cells.shape[1:] != want.shape[1:]:
        return np.zeros(len(starts), dtype=bool)
    for j in range(count):
        held = np.flatnonzero(ok)
        if not len(held):
            break
        ok[held] = (cells[lo[held] + j] == want[j]).all(axis=1)
    return ok


def _places(
    reader: SliceReader,
    rid: str,
    group_id: int,
    lo: int,
    hi: int,
    slices: Sequence[Slice],
    target: Mapping[Slice, np.ndarray],
) -> np.ndarray:
    """The first tokens ``lo <= t < hi`` of the producer request ``rid`` from which every
    slice holds the ``target`` cells (each ``[count, cell bytes]``)."""
    count = len(target[slices[0]])
    anchor = slices[0]
    span = (lo, hi + count - 1)
    held = reader.gather(rid, group_id, *span, {anchor[0]}).get((*anchor, 0))
    if held is None:
        return np.zeros(0, dtype=np.int64)
    want = target[anchor]
    starts = held.tokens[(held.cells == want[0]).all(axis=1)]
    starts = starts[(starts >= lo) & (starts < hi)]
    starts = starts[_starts_holding(held.tokens, held.cells, starts, want)]
    if len(starts) <= FEW_CANDIDATES:
        layers = {name for name, _ in slices}
        kept = []
        for first in starts.tolist():
            cells = _run_cells(reader, rid, group_id, first, count, layers)
            if all(s in cells and np.array_equal(cells[s], target[s]) for s in slices):
                kept.append(first)
        return np.array(kept, dtype=np.int64)
    for layer in sorted({name for name, _ in slices[1:]}):
        found = reader.gather(rid, group_id, *span, {layer})
        for piece in (s for s in slices[1:] if s[0] == layer):
            item = found.get((*piece, 0))
            if item is None:
                return np.zeros(0, dtype=np.int64)
            starts = starts[_starts_holding(item.tokens, item.cells, starts, target[piece])]
        if not len(starts):
            break
    return starts


def trace_run(
    run: TokenRun,
    located: Sequence[LocatedDifference],
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    request_id: str,
    group_id: int,
    order: Sequence[str],
) -> TokenRun:
    """The run with its sources: each producer place (any request, any first token).

    A source's tokens hold the consumer's cells of the run in every slice that differs
    there. The producer is read ``RUN_CHUNK`` tokens at a time: one layer finds the
    candidates, which are then read in every layer (a part with many candidates whole,
    a layer at a time). The first ``MAX_SOURCES`` places are kept, and how many there are
    where more.

    Args:
        run: The run of differing tokens traced.
        located: The located entries of the run's group.
        producer: The producer's raw KV, where the tokens may come from.
        consumer: The consumer's raw KV, which holds the run.
        request_id: The consumer's request.
        group_id: The group.
        order: The producer's requests, in the order sources are listed.

    Returns:
        The run, its ``sources`` filled (empty where none holds it) and its ``matches``
        where more places hold it than are listed.

    """
    slices = sorted(
        {
            (item.layer, item.head)
            for item in located
            if item.position == run.position
            and item.replica == 0
            and any(run.first <= t <= run.last for t in item.tokens)
        }
    )
    layers = {name for name, _ in slices}
    target = _run_cells(
        SliceReader.open(consumer, request_id, group_id),
        request_id,
        group_id,
        run.first,
        run.count,
        layers,
    )
    if not slices or any(s not in target for s in slices):
        return run
    counts = {rid: int(r.num_tokens) for w in producer for rid, r in w.requests.items()}
    sources: list[tuple[str, int]] = []
    total = 0
    for rid in order:
        tokens = counts.get(rid, 0)
        if tokens < run.count:
            continue
        reader = SliceReader.open(producer, rid, group_id)
        last = tokens - run.count + 1  # past the last first token with room for the run
        for lo in range(0, last, RUN_CHUNK):
            places = _places(reader, rid, group_id, lo, min(lo + RUN_CHUNK, last), slices, target)
            if rid == request_id:
                places = places[places != run.first]  # the run itself
            total += len(places)
            sources += [(rid, int(first)) for first in places[: MAX_SOURCES - len(sources)]]
    matches = total if total > len(sources) else None
    return replace(run, sources=tuple(sources), matches=matches)


__all__ = [
    "ProducerBlocks",
    "TraceUnit",
    "finest_sizes",
    "stale_sources",
    "trace_report",
    "trace_run",
    "trace_units",
    "unit_digests",
    "unit_layers",
    "untraced_runs",
]


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
