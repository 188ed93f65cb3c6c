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

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .compare.numeric import GroupNumeric, NumericReport, RequestNumeric, SliceErrors
from .elements import work_dtype
from .sources.raw import RawWorker
from .value_reads import (
    LayerValues,
    RowFiles,
    SideWorker,
    WorkerRows,
    attention_views,
    batch_tokens,
    block_unit,
    decode_layer,
    plan_rows,
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
CHUNK_ELEMENTS = 1 << 17
"""About how many elements of a side are decoded and compared at once (they stay in the
cache)."""


_INTEGERS = {4: np.int32, 8: np.int64}
"""Integers of a float's size: non-negative floats order as their bits do."""
_SCRATCH = threading.local()


def _scratch(key: str, dtype: type[np.generic], shape: tuple[int, ...]) -> np.ndarray:
    """A buffer of this thread's, reused batch after batch (grown when too small)."""
    buffers: dict[str, np.ndarray] = _SCRATCH.__dict__.setdefault("buffers", {})
    need = math.prod(shape) * np.dtype(dtype).itemsize
    buffer = buffers.get(key)
    if buffer is None or buffer.nbytes < need:
        buffer = buffers[key] = np.empty(need, dtype=np.uint8)
    return buffer[:need].view(dtype).reshape(shape)


def _row_max(x: np.ndarray) -> np.ndarray:
    """The largest of each last-axis row of non-negative floats (NaN where one is NaN),
    compared as integers: the same values, without the float reduction's NaN checks."""
    ints = _INTEGERS[x.dtype.itemsize]
    return x.view(ints).max(axis=-1).view(x.dtype)


def _counts(flags: np.ndarray) -> np.ndarray:
    """The True flags of each ``flags[h]``: eight flags a word, summed bytewise by one
    multiplication (its top byte), where the flags fill whole words."""
    heads = flags.shape[0]
    if flags.size % (8 * heads) or not flags.flags.c_contiguous:
        return np.count_nonzero(flags.reshape(heads, -1), axis=1)
    words = flags.view(np.uint64).reshape(heads, -1)
    byte_sums = np.multiply(words, np.uint64(0x0101010101010101))
    byte_sums >>= np.uint64(56)
    return byte_sums.sum(axis=1, dtype=np.int64)


def _squares(a: np.ndarray) -> np.ndarray:
    """Per head, the sum of the squares of ``a`` ``[heads, tokens, elements]``: per token
    a dot product in the work dtype (a few hundred elements), then summed in float64."""
    return np.vecdot(a, a).sum(axis=1, dtype=np.float64)


@dataclass
class _Chunk:
    """Errors of some heads of one layer's batch: per ``[heads, tokens]`` the largest
    ``|c - p|`` and ``|p|`` (and the tokens with a NaN or Inf on one side, if any), per
    head the largest relative error, the elements over tolerance, the squares' sum and
    the elements with a NaN or Inf on one side."""

    token_abs: np.ndarray
    token_scale: np.ndarray
    one_sided: np.ndarray | None
    head_rel: np.ndarray
    over: np.ndarray
    squares: np.ndarray
    nonfinite: np.ndarray


def _fast(p: np.ndarray, c: np.ndarray, atol: float, rtol: float) -> _Chunk | None:
    """``_exact`` for heads whose values are all finite on both sides, in fewer passes and
    in reused buffers (``p`` and ``c`` are overwritten); None, with ``p`` and ``c``
    untouched, where a value is not finite. Sides equal bit for bit skip the errors."""
    heads, tokens, _ = p.shape
    zeros = np.zeros(heads)
    a = _scratch("a", p.dtype, p.shape)
    if np.array_equal(p[:, 0], c[:, 0]) and np.array_equal(p, c):
        token_scale = _row_max(np.abs(p, out=a))
        if not np.isfinite(token_scale).all():
            return None
        none = np.zeros(heads, dtype=np.int64)
        token_abs = np.zeros((heads, tokens), dtype=p.dtype)
        return _Chunk(token_abs, token_scale, None, zeros, none, zeros, none)
    with np.errstate(invalid="ignore", over="ignore"):  # Inf - Inf, overflow: see below
        np.subtract(c, p, out=a)
    np.abs(a, out=a)
    token_abs = _row_max(a)
    if not np.isfinite(token_abs).all():
        return None
    np.abs(p, out=p)
    token_scale = _row_max(p)
    head_abs = token_abs.max(axis=1)
    over = np.zeros(heads, dtype=np.int64)
    if head_abs.max() == 0:
        return _Chunk(token_abs, token_scale, None, zeros, over, zeros, over)
    ratio = c  # c is not needed any more
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(a, p, out=ratio)
    # 0 / 0 (both 0) is NaN, which fmax skips; a head of only those has no error.
    head_rel = np.fmax(np.fmax.reduce(ratio.reshape(heads, -1), axis=1), 0.0)
    if atol == 0:
        # a > rtol |p| is a / |p| > rtol (0 / 0, a NaN, is not over; a / 0 is).
        counted = np.flatnonzero(head_rel > rtol)
        exceed = np.greater(ratio, rtol, out=_scratch("exceed", np.bool_, p.shape))
    else:
        counted = np.flatnonzero(head_abs > atol)
        if counted.size:
            np.multiply(p, rtol, out=ratio)
            ratio += atol
            exceed = np.greater(a, ratio, out=_scratch("exceed", np.bool_, p.shape))
    if counted.size:
        over[:] = _counts(exceed)
    squares = _squares(a)
    return _Chunk(token_abs, token_scale, None, head_rel, over, squares, zeros.astype(np.int64))


def _exact(p: np.ndarray, c: np.ndarray, atol: float, rtol: float) -> _Chunk:
    """The errors of ``[heads, tokens, elements]`` values, NaN and Inf included (NaN
    against NaN and an Inf against the same Inf agree; on one side only they count as
    infinite errors); ``p`` and ``c`` are overwritten."""
    heads, tokens, elements = p.shape
    with np.errstate(invalid="ignore", over="ignore"):  # told apart below
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
    head_abs = token_abs.max(axis=1)
    token_rel = np.zeros((heads, tokens), dtype=a.dtype)
    over = np.zeros(heads, dtype=np.int64)
    one_sided = None if mismatch is None else mismatch.any(axis=2)
    if head_abs.max() > 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.divide(a, p, out=c)  # c is not needed any more
            token_rel = np.nan_to_num(np.fmax.reduce(ratio, axis=2), nan=0.0, posinf=np.inf)
        if one_sided is not None:
            token_rel[one_sided] = np.inf
        if head_abs.max() > atol:
            if atol == 0 and mismatch is None:
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
        squares = _squares(a)
    else:
        squares = np.zeros(heads)
    nonfinite = (
        np.count_nonzero(mismatch.reshape(heads, -1), axis=1)
        if mismatch is not None
        else np.zeros(heads, dtype=np.int64)
    )
    return _Chunk(
        token_abs, token_scale, one_sided, token_rel.max(axis=1), over, squares, nonfinite
    )


class _LayerErrors:
    """One layer's errors per global head, batch after batch (``SliceErrors`` at the end)."""

    def __init__(self, heads: int) -> None:
        self.tokens = np.zeros(heads, dtype=np.int64)
        self.max_abs = np.zeros(heads)
        self.max_rel = np.zeros(heads)
        self.max_producer = np.zeros(heads)
        self.sum_squares = np.zeros(heads)
        self.over = np.zeros(heads, dtype=np.int64)
        self.nonfinite = np.zeros(heads, dtype=np.int64)
        self.worst_error = np.zeros((heads, WORST_TOKENS))
        self.worst_position = np.full((heads, WORST_TOKENS), -1, dtype=np.int64)

    def merge_worst(self, lo: int, errors: np.ndarray) -> None:
        """Keep each head's ``WORST_TOKENS`` positions of largest error (earliest on ties);
        ``errors[h, t]`` is the largest error of head ``h`` at request position ``lo + t``."""
        if (errors.max(axis=1) <= self.worst_error[:, -1]).all():
            return  # later positions lose ties: nothing here enters
        count = min(WORST_TOKENS, errors.shape[1])
        top = np.argsort(-errors, axis=1, kind="stable")[:, :count]
        error = np.concatenate([self.worst_error, np.take_along_axis(errors, top, axis=1)], axis=1)
        position = np.concatenate([self.worst_position, top + lo], axis=1)
        order = np.lexsort((position, -error), axis=1)[:, :WORST_TOKENS]
        self.worst_error = np.take_along_axis(error, order, axis=1)
        self.worst_position = np.take_along_axis(position, order, axis=1)

    def slices(self, layer: str, number: int, elements: int) -> list[SliceErrors]:
        """The layer's heads as ``SliceErrors``."""
        result = []
        for h in range(len(self.tokens)):
            worst = [
                (int(position), float(error))
                for position, error in zip(self.worst_position[h], self.worst_error[h])
                if error > 0
            ]
            result.append(
                SliceErrors(
                    layer,
                    number,
                    h,
                    tokens=int(self.tokens[h]),
                    elements=int(self.tokens[h]) * elements,
                    max_abs_error=float(self.max_abs[h]),
                    max_rel_error=float(self.max_rel[h]),
                    max_producer=float(self.max_producer[h]),
                    sum_squares=float(self.sum_squares[h]),
                    over_tolerance=int(self.over[h]),
                    nonfinite_mismatches=int(self.nonfinite[h]),
                    worst=worst,
                )
            )
        return result


def _compare_values(
    errors: _LayerErrors,
    lo: int,
    p: np.ndarray,
    c: np.ndarray,
    mask: np.ndarray,
    tolerance: tuple[float, float],
) -> np.ndarray:
    """Add one layer's batch (``[heads, tokens, elements]`` from request position ``lo``,
    compared where ``mask``; ``p`` and ``c`` are overwritten) to its errors; returns per
    token the largest over heads of ``max |c - p| / max |p|`` (NaN where no head compared
    it)."""
    heads, tokens, elements = p.shape
    if not mask.all():
        p[~mask] = 0
        c[~mask] = 0
    step = max(1, CHUNK_ELEMENTS // max(tokens * elements, 1))
    chunks = []
    for h in range(0, heads, step):
        left, right = p[h : h + step], c[h : h + step]
        chunk = _fast(left, right, *tolerance) if elements else None
        chunks.append(chunk if chunk is not None else _exact(left, right, *tolerance))
    token_abs = np.concatenate([chunk.token_abs for chunk in chunks])
    token_scale = np.concatenate([chunk.token_scale for chunk in chunks])
    with np.errstate(divide="ignore", invalid="ignore"):
        # 0 / 0 (nothing to compare against, no error) is NaN: 0 (fmax skips NaN).
        token_norm = np.fmax(token_abs / token_scale, 0.0)
    for h, chunk in zip(range(0, heads, step), chunks):
        if chunk.one_sided is not None:
            token_norm[h : h + step][chunk.one_sided] = np.inf
    head_abs = token_abs.max(axis=1)
    errors.tokens += mask.sum(axis=1)
    np.maximum(errors.max_abs, head_abs, out=errors.max_abs)
    np.maximum(
        errors.max_rel, np.concatenate([chunk.head_rel for chunk in chunks]), out=errors.max_rel
    )
    head_scale = np.fmax(token_scale.max(axis=1), 0.0)
    np.maximum(errors.max_producer, head_scale, out=errors.max_producer)
    errors.sum_squares += np.concatenate([chunk.squares for chunk in chunks])
    errors.over += np.concatenate([chunk.over for chunk in chunks])
    errors.nonfinite += np.concatenate([chunk.nonfinite for chunk in chunks])
    if head_abs.max() > 0:
        errors.merge_worst(lo, np.where(mask, token_abs, 0.0))
    return np.where(mask.any(axis=0), token_norm.max(axis=0, initial=0.0), np.nan)


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


Piece = tuple[int, int, tuple[list[WorkerRows], list[WorkerRows]]]
"""Request positions ``lo .. hi - 1`` and the rows of each side that hold them."""


def _compare_layer(
    errors: _LayerErrors,
    pieces: Sequence[Piece],
    name: str,
    layers: tuple[LayerValues, LayerValues],
    tolerance: tuple[float, float],
    layer_tokens: tuple[np.ndarray, int],
) -> int:
    """One layer's batch, piece by piece: both sides decoded into this thread's buffers
    (small enough to stay in the cache while compared) and added to its errors and its
    row of token bins ``layer_tokens = (values, positions per bin)``; returns the bytes
    read. The rows' mapped pages are dropped after."""
    read = 0
    row, width = layer_tokens
    with RowFiles() as files:
        for lo, hi, plans in pieces:
            values = []
            for key, plan, layer in zip("pc", plans, layers):
                shape = (layer.heads, hi - lo, layer.elements)
                buffer = _scratch(key, work_dtype(layer.dtype), shape)
                held = np.zeros(shape[:2], dtype=bool)
                read += decode_layer(plan, name, layer, (buffer, held), files)
                values.append((buffer, held))
            (p, held_p), (c, held_c) = values
            if p.dtype != c.dtype:
                p, c = p.astype(np.float64), c.astype(np.float64)
            token_row = _compare_values(errors, lo, p, c, held_p & held_c, tolerance)
            np.fmax.at(row, np.arange(lo, hi) // width, token_row)
    # Rows far apart map a large folio of file pages each: dropped at once (another
    # thread's rows of the same files are read again from the page cache if needed).
    workers = {
        id(item.worker): item.worker for *_, plans in pieces for plan in plans for item in plan
    }
    for worker in workers.values():
        worker.drop_pages()
    return read


def _piece_tokens(unit: int, layers: Mapping[str, LayerValues], common: Sequence[str]) -> int:
    """Tokens per piece: a multiple of ``unit``, about ``CHUNK_ELEMENTS`` per side."""
    per_token = max((layers[name].heads * layers[name].elements for name in common), default=1)
    return max(unit, CHUNK_ELEMENTS // max(per_token, 1) // unit * unit)


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
    """One request's group compared by value, and why parts of it are not compared: the
    layers of each batch read and compared on the pool's threads (numpy releases the GIL),
    the sides' mapped pages dropped after each."""
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
    errors = {name: _LayerErrors(info[name].heads) for name in common}
    piece = _piece_tokens(block_unit(sides), info, common)
    step = max(piece, batch_tokens(sides, batch_bytes) // piece * piece)
    chosen = (attention_views(producer), attention_views(consumer))
    request = (request_id, group_id)
    for lo in range(0, num_tokens, step):
        hi = min(num_tokens, lo + step)
        pieces = [
            (
                start,
                min(hi, start + piece),
                (
                    plan_rows(producer, chosen[0], request, start, min(hi, start + piece)),
                    plan_rows(consumer, chosen[1], request, start, min(hi, start + piece)),
                ),
            )
            for start in range(lo, hi, piece)
        ]
        jobs = [
            pool.submit(
                _compare_layer,
                errors[name],
                pieces,
                name,
                (layers[0][name], layers[1][name]),
                tolerance,
                (layer_tokens[index], width),
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
