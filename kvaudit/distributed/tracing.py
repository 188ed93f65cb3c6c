"""The torchrun runtime's tracing after locating: each process digests the blocks its own
dumps hold, and only digests and matches travel (``kvaudit.compare.trace``'s steps, each
run where the dumps are).

Rank 0, which holds the located entries, gives every process the blocks to trace
(``kvaudit.compare.trace.trace_units``). Each process digests the slices of those consumer blocks
that its consumer dumps hold; the digests, gathered, are the targets. Each process then
lists the producer blocks of its own dumps whose slices it holds match their targets; a
producer block is a source when every slice of the unit matched on some process
(``kvaudit.compare.trace.stale_sources``), as one process decides over all the dumps. A slice two
processes give different digests of is never matched.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from ..compare import DiffReport
from ..compare.trace import (
    Matches,
    ProducerBlocks,
    Slice,
    TraceUnit,
    finest_sizes,
    stale_sources,
    trace_units,
    unit_digests,
    unit_layers,
)
from .spread_source import SpreadSource


def _unit(data: Mapping[str, Any]) -> TraceUnit:
    """A unit from its JSON (``dataclasses.asdict`` of it)."""
    slices = tuple((str(name), int(head)) for name, head in data["slices"])
    return TraceUnit(**{**data, "slices": slices})


def _targets(parts: Sequence[Sequence[Sequence[Any]]], count: int) -> list[dict[Slice, bytes]]:
    """Per unit, the digests of its slices over every process's ``[name, head, hex]``; a
    slice processes give different digests of is left out, so it matches nothing."""
    seen: list[dict[Slice, set[str]]] = [defaultdict(set) for _ in range(count)]
    for part in parts:
        for found, held in zip(seen, part):
            for name, head, digest in held:
                found[str(name), int(head)].add(str(digest))
    return [
        {key: bytes.fromhex(next(iter(d))) for key, d in found.items() if len(d) == 1}
        for found in seen
    ]


def _matches(parts: Sequence[Sequence[Sequence[Any]]], count: int) -> list[Matches]:
    """Per unit, each producer block with the slices that matched on any process, over
    every process's ``[request, position, [[name, head], ...]]``."""
    merged: list[Matches] = [{} for _ in range(count)]
    for part in parts:
        for found, blocks in zip(merged, part):
            for request_id, position, slices in blocks:
                held = found.setdefault((str(request_id), int(position)), set())
                held.update((str(name), int(head)) for name, head in slices)
    return merged


def trace_across(
    report: DiffReport,
    producer: SpreadSource,
    consumer: SpreadSource,
    num_tokens: Mapping[str, int],
) -> None:
    """Fill each differing group's ``stale_sources`` on rank 0, as ``trace_report`` does
    in one process; every process takes part. ``producer`` is the whole producer (any
    of its requests may hold a block's content), ``consumer`` cut to the tokens compared.

    Raises:
        KvauditError: On every process, when one failed to read its dumps.

    """
    comm = producer.comm
    rank = comm.place.rank

    def plan() -> list[dict[str, Any]] | None:
        if rank != 0:
            return None
        descriptions = [*producer.descriptions(), *consumer.descriptions()]
        units = trace_units(report, num_tokens, finest_sizes(descriptions))
        return [dataclasses.asdict(unit) for unit in units]

    units = [_unit(data) for data in comm.outcomes(plan)[0]]
    if not units:
        return
    blocks = ProducerBlocks(list(producer.local.values()), unit_layers(units))

    def digest(chosen: list[TraceUnit]) -> list[dict[Slice, bytes]]:
        def own() -> list[list[list[Any]]]:
            held = unit_digests(list(consumer.local.values()), chosen)
            return [[[name, head, d.hex()] for (name, head), d in part.items()] for part in held]

        return _targets(comm.outcomes(own), len(chosen))

    def match(chosen: list[TraceUnit], targets: list[dict[Slice, bytes]]) -> list[Matches]:
        def own() -> list[list[list[Any]]]:
            found = blocks.match(chosen, targets)
            return [[[rid, q, sorted(slices)] for (rid, q), slices in f.items()] for f in found]

        return _matches(comm.outcomes(own), len(chosen))

    order = list(dict.fromkeys(rid for item in producer.held for rid in item.requests))
    traced = stale_sources(units, digest, match, order)
    if rank == 0:
        traced.fill(report)


__all__ = ["trace_across"]
