"""Comparing two sides' raw KV by value: per request, layer and head, how large the
errors are and where (docs/numeric.md).

``numeric_diff`` reads a producer's and a consumer's ``RawWorker``s (dumps or live
tensors, any TP sizes, layouts and block ids) batch by batch over the tokens both hold,
decodes every element in its layer's dtype (``kvaudit.elements``) times the layer's scale,
and accumulates, per (layer, global head): the largest absolute and relative errors, the
RMS error, the elements over ``atol + rtol * |producer|``, the NaN or Inf on one side only
and the worst token positions; per layer and token bin, the largest relative error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .compare.numeric import GroupNumeric, NumericReport, RequestNumeric, SliceErrors
from .sources.raw import RawWorker
from .value_reads import (
    LayerValues,
    SideWorker,
    batch_tokens,
    read_side,
    side_layers,
    side_workers,
)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

WORST_TOKENS = 5
"""How many worst token positions each (layer, head) keeps."""
MAX_BINS = 256
"""At most this many token bins per layer in the layers x tokens picture."""
THREADS = 4
"""At most this many threads read the sides and compare layers."""
BATCH_BYTES = 8 << 20
"""About how many raw bytes each side reads per batch (memory stays bounded)."""


def _accumulate(
    slices: list[SliceErrors],
    lo: int,
    p: np.ndarray,
    c: np.ndarray,
    mask: np.ndarray,
    atol: float,
    rtol: float,
) -> np.ndarray:
    """Add one batch of one layer (``[heads, tokens, elements]`` from request position
    ``lo``; tokens not in ``mask`` hold zeros on both sides) to its slices; returns per
    token the largest over heads of ``max |c - p| / max |p|`` (NaN where no head
    compared it)."""
    heads, tokens, elements = p.shape
    counts = mask.sum(axis=1)
    a = np.subtract(c, p)
    np.abs(a, out=a)
    mismatch = None
    token_abs = a.max(axis=2) if elements else np.zeros((heads, tokens), a.dtype)
    if not np.isfinite(token_abs).all():
        bad = ~np.isfinite(a)
        pb, cb = p[bad], c[bad]
        same = (np.isnan(pb) & np.isnan(cb)) | (pb == cb)
        one_side = (np.isnan(pb) != np.isnan(cb)) | (np.isinf(pb) != np.isinf(cb))
        a[bad] = np.where(same, 0.0, np.inf)
        mismatch = np.zeros(a.shape, dtype=bool)
        mismatch[bad] = one_side
        token_abs = a.max(axis=2)
    np.abs(p, out=p)
    token_scale = p.max(axis=2) if elements else np.zeros((heads, tokens), a.dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        token_norm = np.nan_to_num(token_abs / token_scale, nan=0.0, posinf=np.inf)
    head_abs = token_abs.max(axis=1) if tokens else np.zeros(heads)
    token_rel = np.zeros((heads, tokens), dtype=a.dtype)
    over = np.zeros(heads, dtype=np.int64)
    if head_abs.size and head_abs.max() > 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.divide(a, p, out=c)  # c is not needed any more
            token_rel = np.nan_to_num(np.fmax.reduce(ratio, axis=2), nan=0.0, posinf=np.inf)
        if mismatch is not None:
            token_rel[mismatch.any(axis=2)] = np.inf
            token_norm[mismatch.any(axis=2)] = np.inf
        if head_abs.max() > atol:
            if atol == 0 and mismatch is None:
                # a > rtol |p| is a / |p| > rtol (0 / 0, a NaN, is not over; a / 0 is).
                exceed = ratio > rtol
            else:
                np.multiply(p, rtol, out=ratio)
                ratio += atol
                exceed = a > ratio
            if mismatch is not None:
                exceed |= mismatch
            over = np.count_nonzero(exceed.reshape(heads, -1), axis=1)
        if mismatch is not None:
            a[mismatch] = 0.0
        # Per token in the work dtype (a few hundred elements), then summed in float64.
        np.square(a, out=a)
        squares = a.sum(axis=2).sum(axis=1, dtype=np.float64)
    else:
        squares = np.zeros(heads)
    nonfinite = (
        np.count_nonzero(mismatch.reshape(heads, -1), axis=1)
        if mismatch is not None
        else np.zeros(heads, dtype=np.int64)
    )
    head_rel = token_rel.max(axis=1) if tokens else np.zeros(heads)
    head_scale = np.nan_to_num(token_scale.max(axis=1), nan=0.0) if tokens else np.zeros(heads)
    for h, item in enumerate(slices):
        if not counts[h]:
            continue
        item.tokens += int(counts[h])
        item.elements += int(counts[h]) * elements
        item.max_abs_error = max(item.max_abs_error, float(head_abs[h]))
        item.max_rel_error = max(item.max_rel_error, float(head_rel[h]))
        item.max_producer = max(item.max_producer, float(head_scale[h]))
        item.sum_squares += float(squares[h])
        item.over_tolerance += int(over[h])
        item.nonfinite_mismatches += int(nonfinite[h])
        if head_abs[h] > 0:
            _merge_worst(item, lo, token_abs[h], mask[h])
    return np.where(mask.any(axis=0), token_norm.max(axis=0, initial=0.0), np.nan)


def _merge_worst(item: SliceErrors, lo: int, token_abs: np.ndarray, held: np.ndarray) -> None:
    """Keep the slice's ``WORST_TOKENS`` positions of largest error (earliest on ties);
    ``token_abs[t]`` is the largest error at request position ``lo + t``."""
    errors = np.where(held, token_abs, 0.0)
    count = min(WORST_TOKENS, len(errors))
    top = np.argsort(-errors, kind="stable")[:count]
    merged = item.worst + [(lo + int(t), float(errors[t])) for t in top]
    merged = [pair for pair in merged if pair[1] > 0]
    merged.sort(key=lambda pair: (-pair[1], pair[0]))
    item.worst = merged[:WORST_TOKENS]


def _compare_layer(
    slices: list[SliceErrors],
    lo: int,
    left: tuple[np.ndarray, np.ndarray],
    right: tuple[np.ndarray, np.ndarray],
    tolerance: tuple[float, float],
    bins: np.ndarray,
    layer_tokens: np.ndarray,
) -> None:
    """One layer's batch added to its slices and its row of token bins."""
    (p, held_p), (c, held_c) = left, right
    if p.dtype != c.dtype:
        p, c = np.asarray(p, np.float64), np.asarray(c, np.float64)
    row = _accumulate(slices, lo, p, c, held_p & held_c, *tolerance)
    np.fmax.at(layer_tokens, bins, row)


def _layer_plan(
    producer: Mapping[str, LayerValues], consumer: Mapping[str, LayerValues]
) -> tuple[list[str], list[str]]:
    """The layers both sides hold alike (by layer number and name), and why the others
    are not compared."""
    names = sorted(
        set(producer) | set(consumer), key=lambda n: ((producer.get(n) or consumer[n]).number, n)
    )
    common, reasons = [], []
    for name in names:
        left, right = producer.get(name), consumer.get(name)
        if left is None or right is None:
            side = "producer" if left is None else "consumer"
            reasons.append(f"layer {name} is not on the {side}")
        elif (left.heads, left.elements) != (right.heads, right.elements):
            reasons.append(
                f"layer {name}: {left.heads} heads x {left.elements} elements on the producer, "
                f"{right.heads} x {right.elements} on the consumer"
            )
        else:
            common.append(name)
    return common, reasons


def _compare_group(
    sides: tuple[list[SideWorker], list[SideWorker]],
    request_id: str,
    group_id: int,
    num_tokens: int,
    tolerance: tuple[float, float],
    progress: Callable[[int], None] | None,
    batch_bytes: int,
    pool: ThreadPoolExecutor,
) -> tuple[GroupNumeric | None, list[str]]:
    """One request's group compared by value, and why parts of it are not compared; the
    sides are read, and the layers compared, on the pool's threads (numpy and torch
    release the GIL)."""
    producer, consumer = sides
    for side, label in ((producer, "producer"), (consumer, "consumer")):
        if not side:
            return None, [f"no {label} worker holds this group and covers it"]
    layers = (side_layers(producer), side_layers(consumer))
    common, reasons = _layer_plan(*layers)
    info = layers[0]
    heads = max((info[name].heads for name in common), default=0)
    width = max(1, -(-num_tokens // MAX_BINS))
    layer_tokens = np.full((len(common), -(-num_tokens // width)), np.nan)
    slices = {
        name: [SliceErrors(name, info[name].number, h) for h in range(info[name].heads)]
        for name in common
    }
    step = batch_tokens(sides, batch_bytes)
    for lo in range(0, num_tokens, step):
        hi = min(num_tokens, lo + step)

        reads = [
            pool.submit(read_side, sides[i], layers[i], common, (request_id, group_id), lo, hi)
            for i in (0, 1)
        ]
        (left, read_left), (right, read_right) = (job.result() for job in reads)
        if progress is not None:
            progress(read_left + read_right)
        bins = np.arange(lo, hi) // width
        jobs = [
            pool.submit(
                _compare_layer,
                slices[name],
                lo,
                left[name],
                right[name],
                tolerance,
                bins,
                layer_tokens[index],
            )
            for index, name in enumerate(common)
        ]
        for job in jobs:
            job.result()
    flat = [item for name in common for item in slices[name]]
    reasons += [
        f"layer {item.layer} head {item.head}: no token held on both sides"
        for item in flat
        if not item.tokens and num_tokens
    ]
    return GroupNumeric(group_id, common, heads, flat, width, layer_tokens), reasons


def numeric_diff(
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    request_ids: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    batch_bytes: int = BATCH_BYTES,
) -> NumericReport:
    """The producer's raw KV compared with the consumer's by value, request by request
    over the first ``num_tokens[id]`` tokens (those both hold), batch by batch.

    An element fails when ``|consumer - producer| > atol + rtol * |producer|`` or when a
    NaN or Inf is on one side only. Requests one side lacks, layers one side lacks (or
    holds in another shape) and heads no token of which both sides hold are listed as
    not compared; Mamba state layers are compared by checksum only.
    """
    from concurrent.futures import ThreadPoolExecutor  # only when comparing (start-up)

    report = NumericReport(atol, rtol)
    with ThreadPoolExecutor(min(THREADS, os.cpu_count() or 1)) as pool:
        _compare_requests(
            report, producer, consumer, num_tokens, request_ids, progress, batch_bytes, pool
        )
    return report


def _compare_requests(
    report: NumericReport,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
    request_ids: Sequence[str] | None,
    progress: Callable[[int], None] | None,
    batch_bytes: int,
    pool: ThreadPoolExecutor,
) -> None:
    """Fill the report request by request."""
    atol, rtol = report.atol, report.rtol
    held = [{rid for worker in side for rid in worker.requests} for side in (producer, consumer)]
    ids = sorted(held[0] | held[1]) if request_ids is None else list(request_ids)
    for rid in ids:
        if rid not in held[1]:
            report.only_producer.append(rid)
            continue
        if rid not in held[0]:
            report.only_consumer.append(rid)
            continue
        count = num_tokens.get(rid, 0)
        result = RequestNumeric(rid, count)
        group_ids = sorted(
            {gid for side in (producer, consumer) for w in side for gid in _groups(w, rid)}
        )
        for gid in group_ids:
            sides = (side_workers(producer, rid, gid), side_workers(consumer, rid, gid))
            group, reasons = _compare_group(
                sides, rid, gid, count, (atol, rtol), progress, batch_bytes, pool
            )
            report.not_compared.extend((rid, gid, reason) for reason in reasons)
            if group is not None:
                result.groups[gid] = group
        report.requests[rid] = result


def _groups(worker: RawWorker, request_id: str) -> list[int]:
    """The groups a worker lists blocks of for a request."""
    request = worker.requests.get(request_id)
    return [] if request is None else list(request.groups)
