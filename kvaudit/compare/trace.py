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
(``kvaudit.distributed.tracing``): ``trace_units`` (what to trace), ``unit_digests``
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

The jobs lie in sibling modules, their names imported here: ``trace_blocks`` (units,
digests, ``ProducerBlocks``), ``trace_runs`` (runs of tokens), ``trace_shifts`` (tokens
a few slots from where they belong) and ``trace_checksums``
(``trace_by_checksums``); this module decides each position's sources
(``stale_sources``) and traces a whole report (``trace_report``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..workers import RawWorker
from .model import MAX_SOURCES, DiffReport, StaleSource
from .trace_blocks import (
    ZEROS,
    Matches,
    ProducerBlocks,
    Slice,
    TraceUnit,
    finest_sizes,
    trace_units,
    unit_digests,
    unit_layers,
)
from .trace_checksums import partial_note, trace_by_checksums
from .trace_runs import MAX_TOKEN_RUNS, trace_run, trace_token_runs, untraced_runs
from .trace_shifts import trace_shifts


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
            budget = trace_token_runs(
                group, request_id, gid, producer, consumer, blocks.order(), budget
            )
            count = num_tokens.get(request_id)
            if count:
                trace_shifts(group, request_id, gid, producer, consumer, count)


__all__ = [
    "Matches",
    "ProducerBlocks",
    "Slice",
    "TraceUnit",
    "finest_sizes",
    "partial_note",
    "stale_sources",
    "trace_by_checksums",
    "trace_report",
    "trace_run",
    "trace_shifts",
    "trace_units",
    "unit_digests",
    "unit_layers",
    "untraced_runs",
]
