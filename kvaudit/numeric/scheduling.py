"""Comparing two sides' raw KV by value: per request, layer and head, how large the
errors are and where (docs/numeric.md).

``numeric_diff`` reads a producer's and a consumer's ``RawWorker``s (dumps or live
tensors, any TP sizes, layouts and block ids) batch by batch over the tokens both hold,
each layer of a batch on a thread, piece by piece (``kvaudit.numeric.layers``), short
requests of the same workers together: every element decoded in its layer's
dtype times the layer's scale and accumulated, in one pass by the C extension where it is
built (``kvaudit.numeric.native``), else in numpy (``kvaudit.core.elements``,
``kvaudit.numeric.value_errors``), per (layer, global head): the largest absolute and relative
errors, the RMS error, the elements over ``atol + rtol * |producer|``, the NaN or Inf on
one side only and the worst token positions; per layer and token bin, the largest
relative error.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..core.errors import KvauditError
from ..workers import RawWorker
from .budget import DEFAULT_BUDGET, NumericBudget
from .layers import (
    ThreadFiles,
    Threads,
    chunk_tokens,
    compare_layer,
    layer_plan,
    piece_tokens,
)
from .model import GroupNumeric, NumericReport, RequestNumeric, SliceErrors, Tolerance
from .native import native_module, reads
from .reads import (
    GroupWorker,
    LayerValues,
    attention_views,
    batch_tokens,
    block_unit,
    plan_rows,
    side_layers,
    side_workers,
)
from .value_errors import LayerErrors

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..views import LayerView

MAX_BINS = 256
"""At most this many token bins per layer in the layers x tokens picture."""
THREADS = 4
"""At most this many threads read the sides and compare layers."""


@dataclass(frozen=True)
class _GroupPlan:
    """How a group is compared for one set of workers on each side: the layers both hold
    alike (``common``, their ``layers`` on each side), why the others are not compared,
    the block unit and the tokens per piece, the views read, and whether requests can be
    compared together (``stacks``: both sides dumps, read in place by the C extension)."""

    layers: tuple[dict[str, LayerValues], dict[str, LayerValues]]
    common: list[str]
    reasons: list[str]
    unit: int
    piece: int
    chosen: tuple[list[dict[str, LayerView]], list[dict[str, LayerView]]]
    stacks: bool

    @classmethod
    def of(
        cls, sides: tuple[list[GroupWorker], list[GroupWorker]], budget: NumericBudget
    ) -> _GroupPlan:
        layers = (side_layers(sides[0]), side_layers(sides[1]))
        common, reasons = layer_plan(*layers)
        unit = block_unit(sides)
        mapped = all(getattr(held.raw, "maps", None) for side in sides for held in side)
        piece = piece_tokens(unit, layers[0], common, mapped, budget)
        chosen = (attention_views(sides[0]), attention_views(sides[1]))
        native = native_module()
        stacks = (
            native is not None
            and mapped
            and bool(common)
            and all(reads(native, side[name].dtype) for side in layers for name in common)
        )
        return cls(layers, common, reasons, unit, piece, chosen, stacks)

    def stackable(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` can be compared together with others: one
        piece, where requests of this plan stack at all."""
        return self.stacks and 0 < num_tokens <= self.piece


@dataclass(frozen=True)
class _Unit:
    """One request's group to compare: its id, group, tokens, both sides' workers, the
    request's result it goes into and the plan of its workers."""

    request_id: str
    group_id: int
    num_tokens: int
    sides: tuple[list[GroupWorker], list[GroupWorker]]
    result: RequestNumeric
    plan: _GroupPlan


def _compare_group(
    unit: _Unit,
    tolerance: Tolerance,
    progress: Callable[[int], None] | None,
    threads: Threads,
) -> tuple[GroupNumeric, list[str]]:
    """One request's group compared by value, and why parts of it are not compared: the
    layers of each batch read and compared on the pool's threads (numpy releases the GIL),
    the sides' mapped pages dropped after each."""
    producer, consumer = unit.sides
    num_tokens, plan = unit.num_tokens, unit.plan
    info, common = plan.layers[0], plan.common
    layer_tokens, width = _token_bins(num_tokens, len(common))
    layer_ratios, _ = _token_bins(num_tokens, len(common))
    errors = {name: LayerErrors(info[name].heads) for name in common}
    piece = plan.piece
    budget = threads[1].budget
    step = max(piece, batch_tokens(unit.sides, budget.batch_bytes) // piece * piece)
    request = (unit.request_id, unit.group_id)
    for lo in range(0, num_tokens, step):
        hi = min(num_tokens, lo + step)
        pieces = [
            (
                start,
                min(hi, start + piece),
                (
                    plan_rows(producer, plan.chosen[0], request, start, min(hi, start + piece)),
                    plan_rows(consumer, plan.chosen[1], request, start, min(hi, start + piece)),
                ),
            )
            for start in range(lo, hi, piece)
        ]
        jobs = [
            threads[0].submit(
                compare_layer,
                errors[name],
                pieces,
                name,
                (plan.layers[0][name], plan.layers[1][name]),
                tolerance,
                (layer_tokens[index], width),
                threads[1],
                chunk_tokens(plan.unit, budget),
                layer_ratios[index],
            )
            for index, name in enumerate(common)
        ]
        read = sum(job.result() for job in jobs)
        if progress is not None:
            progress(read)
    flat = [
        item
        for name in common
        for item in errors[name].slices(name, info[name].number, info[name].elements)
    ]
    return _group_result(unit, flat, (layer_tokens, width), layer_ratios)


def _token_bins(num_tokens: int, layers: int) -> tuple[np.ndarray, int]:
    """The layers x token bins picture of a request's group, all NaN (at most
    ``MAX_BINS`` bins per layer), and the tokens per bin."""
    width = max(1, -(-num_tokens // MAX_BINS))
    return np.full((layers, -(-num_tokens // width)), np.nan), width


def _group_result(
    unit: _Unit,
    flat: list[SliceErrors],
    layer_tokens: tuple[np.ndarray, int],
    layer_ratios: np.ndarray,
) -> tuple[GroupNumeric, list[str]]:
    """A group's figures from its layers' heads (``layer_ratios``: its layers x token bins
    of the tolerance ratio), and why parts of it were not compared."""
    plan = unit.plan
    info = plan.layers[0]
    heads = max((info[name].heads for name in plan.common), default=0)
    reasons = plan.reasons + [
        f"layer {item.layer} head {item.head}: no token held on both sides"
        for item in flat
        if not item.tokens and unit.num_tokens
    ]
    values, width = layer_tokens
    group = GroupNumeric(
        unit.group_id, plan.common, heads, flat, width, values, layer_token_ratios=layer_ratios
    )
    return group, reasons


@dataclass
class _Stack:
    """Several short requests' groups (same workers, one piece each) being compared at
    once: each layer in one call of the C extension, the requests' heads one after another
    (each head's figures the same bits as alone), on the pool's threads."""

    units: list[_Unit]
    tokens: int
    stacked: dict[str, LayerErrors]
    jobs: list[Future[tuple[np.ndarray, int] | None]]
    ratios: list[np.ndarray]
    """Per layer, the tolerance ratio of each stacked head's tokens ``[heads, tokens]``."""

    @classmethod
    def start(cls, units: list[_Unit], tolerance: Tolerance, threads: Threads) -> _Stack:
        """Submit the units' layers to the pool (their plan ``stacks``)."""
        plan = units[0].plan
        native = native_module()
        assert native is not None  # the plan stacks: the C extension is there
        info, common = plan.layers[0], plan.common
        tokens = max(unit.num_tokens for unit in units)
        stack = tuple(
            [
                plan_rows(
                    unit.sides[s],
                    plan.chosen[s],
                    (unit.request_id, unit.group_id),
                    0,
                    unit.num_tokens,
                )
                for unit in units
            ]
            for s in (0, 1)
        )
        stacked = {name: LayerErrors(len(units) * info[name].heads) for name in common}
        ratios = [np.empty((len(units) * info[name].heads, tokens)) for name in common]
        chunk = chunk_tokens(plan.unit, threads[1].budget)
        jobs = [
            threads[0].submit(
                threads[1].places.add,
                native,
                stacked[name],
                (0, tokens, stack),
                name,
                (plan.layers[0][name], plan.layers[1][name]),
                tolerance,
                chunk,
                ratio,
            )
            for name, ratio in zip(common, ratios)
        ]
        return cls(units, tokens, stacked, jobs, ratios)

    def finish(
        self, progress: Callable[[int], None] | None
    ) -> list[tuple[GroupNumeric, list[str]]] | None:
        """Each unit's figures and notes, once every layer is done; None where their rows
        cannot be read so (compare them one by one)."""
        found = [job.result() for job in self.jobs]
        if any(item is None for item in found):
            return None
        if progress is not None:
            progress(sum(read for _, read in found))
        plan, count = self.units[0].plan, len(self.units)
        info, common = plan.layers[0], plan.common
        # Split again per request: each layer's heads as runs of slices, its token rows'
        # largest over each request's heads.
        runs = [
            self.stacked[name].runs_of_slices(name, info[name].number, info[name].elements, count)
            for name in common
        ]
        token_rows = [
            np.fmax.reduce(rows.reshape(count, -1, self.tokens), axis=1) for rows, _ in found
        ]
        ratio_rows = [
            np.fmax.reduce(rows.reshape(count, -1, self.tokens), axis=1) for rows in self.ratios
        ]
        groups = []
        for r, unit in enumerate(self.units):
            layer_tokens, width = _token_bins(unit.num_tokens, len(common))
            layer_ratios, _ = _token_bins(unit.num_tokens, len(common))
            positions = np.arange(unit.num_tokens) // width
            for index, (rows, ratios) in enumerate(zip(token_rows, ratio_rows)):
                np.fmax.at(layer_tokens[index], positions, rows[r, : unit.num_tokens])
                np.fmax.at(layer_ratios[index], positions, ratios[r, : unit.num_tokens])
            flat = [item for layer in runs for item in layer[r]]
            groups.append(_group_result(unit, flat, (layer_tokens, width), layer_ratios))
        return groups


def numeric_diff(
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    request_ids: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    budget: NumericBudget = DEFAULT_BUDGET,
) -> NumericReport:
    """The producer's raw KV compared with the consumer's by value, request by request.

    Each request is compared over its first ``num_tokens[id]`` tokens (those both hold),
    batch by batch. An element fails when
    ``|consumer - producer| > atol + rtol * |producer|`` or when a NaN or Inf is on one
    side only. Requests one side lacks, layers one side lacks (or holds in another shape)
    and heads no token of which both sides hold are listed as not compared; Mamba state
    layers are compared by checksum only. ``budget`` bounds what is read, decoded and
    held at once.

    Args:
        producer: The producer's raw KV, one entry per worker.
        consumer: The consumer's raw KV, one entry per worker.
        num_tokens: Per request, the tokens both sides hold.
        atol: The absolute tolerance of an element.
        rtol: The tolerance relative to the producer's element.
        request_ids: The requests compared, in that order; None for every request either
            side holds, sorted.
        progress: Called with the bytes compared since its last call.
        budget: What the comparison reads, decodes and holds at once.

    Returns:
        The report: per request, group, layer and head, the errors and where they are.

    Raises:
        KvauditError: A tolerance that is not a finite number >= 0, or a dump file that
            shrank while it was read.

    """
    from concurrent.futures import ThreadPoolExecutor  # only when comparing (start-up)

    for name, value in (("atol", atol), ("rtol", rtol)):
        # A NaN tolerance would pass everything: no comparison with it is ever true.
        if not (math.isfinite(value) and value >= 0):
            raise KvauditError(f"{name}: expected a finite number >= 0, got {value}")
    report = NumericReport(atol, rtol)
    threads = min(THREADS, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool, ThreadFiles(threads, budget) as files:
        _compare_requests(
            report,
            producer,
            consumer,
            num_tokens,
            request_ids,
            progress,
            (pool, files),
        )
    return report


def _compare_requests(
    report: NumericReport,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
    request_ids: Sequence[str] | None,
    progress: Callable[[int], None] | None,
    threads: Threads,
) -> None:
    """Fill the report request by request: consecutive short requests of the same
    workers (one piece each, read in place) are compared together, in stacks of about a
    piece's rows (a call of the C extension per layer, not per request and layer)."""
    tolerance = Tolerance(report.atol, report.rtol)
    held = [{rid for worker in side for rid in worker.requests} for side in (producer, consumer)]
    ids = sorted(held[0] | held[1]) if request_ids is None else list(request_ids)
    plans: dict[tuple[int, tuple[int, ...], tuple[int, ...]], _GroupPlan] = {}
    stack: list[_Unit] = []  # short requests' groups gathered
    running: _Stack | None = None  # the last stack started

    def done(unit: _Unit, group: GroupNumeric, reasons: list[str]) -> None:
        report.not_compared.extend((unit.request_id, unit.group_id, why) for why in reasons)
        group.not_compared = list(reasons)
        unit.result.groups[unit.group_id] = group

    def compare_alone(unit: _Unit) -> None:
        done(unit, *_compare_group(unit, tolerance, progress, threads))

    def finish_running() -> None:
        nonlocal running
        if running is not None:
            found = running.finish(progress)
            if found is None:
                for unit in running.units:
                    compare_alone(unit)
            else:
                for unit, (group, reasons) in zip(running.units, found):
                    done(unit, group, reasons)
        running = None

    def close_stack(keep_running: bool) -> None:
        """Start comparing the gathered stack, and finish the one before meanwhile: the
        report keeps the requests' order; ``keep_running``: leave this one running."""
        nonlocal running
        units = stack[:]
        stack.clear()
        started = _Stack.start(units, tolerance, threads) if len(units) > 1 else None
        finish_running()
        if started is None:
            for unit in units:  # one, or none
                compare_alone(unit)
            return
        running = started
        if not keep_running:
            finish_running()

    for rid in ids:
        if rid not in held[1]:
            report.only_producer.append(rid)
            continue
        if rid not in held[0]:
            report.only_consumer.append(rid)
            continue
        count = num_tokens.get(rid, 0)
        result = report.requests[rid] = RequestNumeric(rid, count)
        group_ids = sorted(
            {gid for side in (producer, consumer) for w in side for gid in _groups(w, rid)}
        )
        for gid in group_ids:
            sides = (side_workers(producer, rid, gid), side_workers(consumer, rid, gid))
            missing = [label for side, label in zip(sides, SIDES) if not side]
            if missing:
                close_stack(keep_running=False)
                why = f"no {missing[0]} worker holds this group and covers it"
                report.not_compared.append((rid, gid, why))
                continue
            # Groups of the same workers share a plan.
            ids_p, ids_c = (tuple(id(held.raw) for held in side) for side in sides)
            plan = plans.get((gid, ids_p, ids_c))
            if plan is None:
                plan = plans[gid, ids_p, ids_c] = _GroupPlan.of(sides, threads[1].budget)
            unit = _Unit(rid, gid, count, sides, result, plan)
            if plan.stackable(count):
                tokens = max([count, *(other.num_tokens for other in stack)])
                if stack and (stack[0].plan is not plan or (len(stack) + 1) * tokens > plan.piece):
                    close_stack(keep_running=True)
                stack.append(unit)
                continue
            close_stack(keep_running=False)
            compare_alone(unit)
    close_stack(keep_running=False)


SIDES = ("producer", "consumer")


def _groups(worker: RawWorker, request_id: str) -> list[int]:
    """The groups a worker lists blocks of for a request."""
    request = worker.requests.get(request_id)
    return [] if request is None else list(request.groups)
