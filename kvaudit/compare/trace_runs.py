"""Tracing runs of differing tokens to the producer places that hold them: what a block
trace left without a source (a block that holds tokens of several places, tokens
exchanged within a block) traced token by token, at any first token of any producer
request.

A run is searched for a chunk of the producer's tokens at a time (``RUN_CHUNK``): one
layer finds the candidate first tokens, which are then checked in every layer that
differs there; at most ``MAX_TOKEN_RUNS`` runs are traced per report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from ..locate import SliceReader
from ..locate.model import LocatedDifference
from ..workers import RawWorker
from .model import MAX_SOURCES, GroupComparison, TokenRun
from .trace_blocks import Slice


def trace_token_runs(
    group: GroupComparison,
    request_id: str,
    group_id: int,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    order: Sequence[str],
    budget: int,
) -> int:
    """Fill the group's ``token_runs``, tracing at most ``budget`` runs (the rest marked
    not traced).

    Args:
        group: A group whose block trace is done (its ``stale_sources`` filled).
        request_id: The consumer's request.
        group_id: The group.
        producer: The producer's raw KV, where the tokens may come from.
        consumer: The consumer's raw KV, which holds the runs.
        order: The producer's requests, in the order sources are listed.
        budget: How many runs may still be traced in this report.

    Returns:
        The budget left.

    """
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
