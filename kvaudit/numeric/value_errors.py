"""The errors between two sides' element values for ``kvaudit.numeric``: a batch of one
layer (``[heads, tokens, elements]`` on each side) reduced per ``(head, token)`` and per
head in a few passes (values finite on both sides, or equal), or exactly as defined for
NaN and Inf (docs/numeric.md), and accumulated per head batch after batch."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from .model import SliceErrors, Tolerance

WORST_TOKENS = 5
"""How many worst token positions each (layer, head) keeps."""
_INTEGERS = {4: np.int32, 8: np.int64}
"""Integers of a float's size: non-negative floats order as their bits do."""
_SCRATCH = threading.local()


def scratch(key: str, dtype: type[np.generic], shape: tuple[int, ...]) -> np.ndarray:
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


def counts(flags: np.ndarray) -> np.ndarray:
    """The True flags of each ``flags[h]``: eight flags a word, summed bytewise by one
    multiplication (its top byte), where the flags fill whole words."""
    heads = flags.shape[0]
    if flags.size % (8 * heads) or not flags.flags.c_contiguous:
        return np.count_nonzero(flags.reshape(heads, -1), axis=1)
    words = flags.reshape(heads, -1).view(np.uint64)  # rows of whole words (not so the last axis)
    byte_sums = np.multiply(words, np.uint64(0x0101010101010101))
    byte_sums >>= np.uint64(56)
    return byte_sums.sum(axis=1, dtype=np.int64)


def _squares(a: np.ndarray) -> np.ndarray:
    """Per head, the sum of the squares of ``a`` ``[heads, tokens, elements]``: per token
    a dot product in the work dtype (a few hundred elements), then summed in float64."""
    return np.vecdot(a, a).sum(axis=1, dtype=np.float64)


@dataclass
class Chunk:
    """Errors of some heads of one layer's batch: per ``[heads, tokens]`` the largest
    ``|c - p|`` and ``|p|`` (and the tokens with a NaN or Inf on one side, if any) and the
    tolerance ratio (``tolerance_ratio``), per head the largest relative error, the
    elements over tolerance, the squares' sum and the elements with a NaN or Inf on one
    side."""

    token_abs: np.ndarray
    token_scale: np.ndarray
    token_ratio: np.ndarray
    one_sided: np.ndarray | None
    head_rel: np.ndarray
    over: np.ndarray
    squares: np.ndarray
    nonfinite: np.ndarray


def tolerance_ratio(
    token_rel: np.ndarray, token_bounded: np.ndarray | None, rtol: float
) -> np.ndarray:
    """Per ``[heads, tokens]`` the largest ``|c - p| / (atol + rtol |p|)`` of the row's
    elements: ``token_bounded`` where atol is not 0 (None: atol is 0), else the largest
    relative error over ``rtol`` (in the work type, as the C extension takes it; 0 / 0
    is 0). Above 1 exactly where an element is over the tolerance, but for rounding at
    the border."""
    if token_bounded is not None:
        return token_bounded
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = token_rel / rtol
    return np.nan_to_num(ratio, nan=0.0, posinf=np.inf)


def _bounded(a: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Per row the largest ``a / bound`` (``bound`` ``atol + rtol |p|`` with atol > 0,
    overwritten; NaN skipped, at least 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(a, bound, out=bound)
    return np.fmax(np.fmax.reduce(bound, axis=2), 0.0)


def fast_errors(p: np.ndarray, c: np.ndarray, atol: float, rtol: float) -> Chunk | None:
    """``exact_errors`` for heads whose values are all finite on both sides, in fewer passes and
    in reused buffers (``p`` and ``c`` are overwritten); None, with ``p`` and ``c``
    untouched, where a value is not finite. Sides equal bit for bit skip the errors."""
    heads, tokens, _ = p.shape
    zeros = np.zeros(heads)
    a = scratch("a", p.dtype, p.shape)
    if np.array_equal(p[:, 0], c[:, 0]) and np.array_equal(p, c):
        token_scale = _row_max(np.abs(p, out=a))
        if not np.isfinite(token_scale).all():
            return None
        none = np.zeros(heads, dtype=np.int64)
        token_abs = np.zeros((heads, tokens), dtype=p.dtype)
        return Chunk(token_abs, token_scale, token_abs, None, zeros, none, zeros, none)
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
        return Chunk(token_abs, token_scale, token_abs, None, zeros, over, zeros, over)
    ratio = c  # c is not needed any more
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(a, p, out=ratio)
    bounded = None
    if atol == 0:
        # 0 / 0 (both 0) is NaN, which fmax skips; a row of only those has no error.
        token_rel = np.fmax(np.fmax.reduce(ratio, axis=2), 0.0)
        head_rel = token_rel.max(axis=1)
        # a > rtol |p| is a / |p| > rtol (0 / 0, a NaN, is not over; a / 0 is).
        counted = np.flatnonzero(head_rel > rtol)
        exceed = np.greater(ratio, rtol, out=scratch("exceed", np.bool_, p.shape))
    else:
        token_rel = np.empty((heads, 0))  # not needed: the ratio is bounded below
        head_rel = np.fmax(np.fmax.reduce(ratio.reshape(heads, -1), axis=1), 0.0)
        counted = np.flatnonzero(head_abs > atol)
        np.multiply(p, rtol, out=ratio)
        ratio += atol
        if counted.size:
            exceed = np.greater(a, ratio, out=scratch("exceed", np.bool_, p.shape))
    if counted.size:
        over[:] = counts(exceed)
    if atol != 0:
        bounded = _bounded(a, ratio)
    token_ratio = tolerance_ratio(token_rel, bounded, rtol)
    squares = _squares(a)
    return Chunk(
        token_abs, token_scale, token_ratio, None, head_rel, over, squares, zeros.astype(np.int64)
    )


def exact_errors(p: np.ndarray, c: np.ndarray, atol: float, rtol: float) -> Chunk:
    """The errors of ``[heads, tokens, elements]`` values, NaN and Inf included (NaN
    against NaN and an Inf against the same Inf agree; on one side only, an Inf against
    the opposite Inf included, they count as infinite errors); ``p`` and ``c`` are
    overwritten."""
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
        # An Inf agrees only with the same Inf (the opposite Inf is one-sided too).
        one_side = ~same & ((np.isnan(pb) != np.isnan(cb)) | np.isinf(pb) | np.isinf(cb))
        a[bad] = np.where(same, 0.0, np.inf)
        mismatch = np.zeros(a.shape, dtype=bool)
        mismatch[bad] = one_side
        token_abs = a.max(axis=2)
    np.abs(p, out=p)
    # A NaN has no magnitude: the largest |p| of the other values (not by np.fmax, which
    # keeps a signalling NaN).
    token_scale = (
        np.where(np.isnan(p), 0.0, p).max(axis=2)
        if elements
        else np.zeros((heads, tokens), a.dtype)
    )
    head_abs = token_abs.max(axis=1)
    token_rel = np.zeros((heads, tokens), dtype=a.dtype)
    token_ratio = token_rel
    over = np.zeros(heads, dtype=np.int64)
    one_sided = None if mismatch is None else mismatch.any(axis=2)
    if head_abs.max() > 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.divide(a, p, out=c)  # c is not needed any more
            token_rel = np.nan_to_num(np.fmax.reduce(ratio, axis=2), nan=0.0, posinf=np.inf)
        if one_sided is not None:
            token_rel[one_sided] = np.inf
        bounded = None
        if atol == 0:
            # As in fast_errors (and the C extension): the same test rounds the same
            # way whichever path a chunk takes.
            exceed = ratio > rtol
        else:
            np.multiply(p, rtol, out=ratio)
            ratio += atol
            exceed = a > ratio
            bounded = _bounded(a, ratio)
            if one_sided is not None:
                bounded[one_sided] = np.inf
        token_ratio = tolerance_ratio(token_rel, bounded, rtol)
        if head_abs.max() > atol:
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
    return Chunk(
        token_abs,
        token_scale,
        token_ratio,
        one_sided,
        token_rel.max(axis=1),
        over,
        squares,
        nonfinite,
    )


class LayerErrors:
    """One layer's errors per global head, batch after batch (``SliceErrors`` at the end):
    ``figures``, ``counts`` and ``max_ratio`` (the largest ``|c - p| / (atol + rtol |p|)``)
    hold the per-head arrays (updated in place, by numpy or by
    ``kvaudit._native._element_errors``)."""

    def __init__(self, heads: int) -> None:
        self.max_ratio = np.zeros(heads)
        self.figures = np.zeros((4, heads))
        self.max_abs, self.max_rel, self.max_producer, self.sum_squares = self.figures
        self.counts = np.zeros((3, heads), dtype=np.int64)
        self.tokens, self.over, self.nonfinite = self.counts
        self.worst_error = np.zeros((heads, WORST_TOKENS))
        self.worst_position = np.full((heads, WORST_TOKENS), -1, dtype=np.int64)

    def merge_worst(self, lo: int, errors: np.ndarray) -> None:
        """Keep each head's ``WORST_TOKENS`` positions of largest error (earliest on ties);
        ``errors[h, t]`` is the largest error of head ``h`` at request position ``lo + t``."""
        if (errors.max(axis=1) <= self.worst_error[:, -1]).all():
            return  # later positions lose ties: nothing here enters
        count = min(WORST_TOKENS, errors.shape[1])
        heads = np.arange(errors.shape[0])[:, None]
        top = np.argsort(-errors, axis=1, kind="stable")[:, :count]
        error = np.concatenate([self.worst_error, errors[heads, top]], axis=1)
        position = np.concatenate([self.worst_position, top + lo], axis=1)
        order = np.lexsort((position, -error), axis=1)[:, :WORST_TOKENS]
        self.worst_error[...] = error[heads, order]
        self.worst_position[...] = position[heads, order]

    def outputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The arrays the C extension updates in place: figures, counts, worst errors and
        their positions."""
        return self.figures, self.counts, self.worst_error, self.worst_position

    def slices(self, layer: str, number: int, elements: int) -> list[SliceErrors]:
        """The layer's heads as ``SliceErrors``."""
        return self.runs_of_slices(layer, number, elements, 1)[0]

    def runs_of_slices(
        self, layer: str, number: int, elements: int, runs: int
    ) -> list[list[SliceErrors]]:
        """The layer's heads as ``SliceErrors`` in ``runs`` equal runs, each head numbered
        within its run (several requests' heads compared together, one run each)."""
        # Python numbers taken out of the arrays at once (one head at a time through
        # numpy scalars cost more than the comparison with many short requests).
        tokens, over, nonfinite = self.counts.tolist()
        max_abs, max_rel, max_producer, sum_squares = self.figures.tolist()
        worst_positions, worst_errors = self.worst_position.tolist(), self.worst_error.tolist()
        max_ratio = self.max_ratio.tolist()
        heads = len(tokens) // runs
        return [
            [
                SliceErrors(
                    layer,
                    number,
                    h - first,
                    tokens=tokens[h],
                    elements=tokens[h] * elements,
                    max_abs_error=max_abs[h],
                    max_rel_error=max_rel[h],
                    max_producer=max_producer[h],
                    sum_squares=sum_squares[h],
                    over_tolerance=over[h],
                    nonfinite_mismatches=nonfinite[h],
                    max_tolerance_ratio=max_ratio[h],
                    worst=[
                        (position, error)
                        for position, error in zip(worst_positions[h], worst_errors[h])
                        if error > 0
                    ],
                )
                for h in range(first, first + heads)
            ]
            for first in range(0, heads * runs, heads)
        ]


def add_batch(
    errors: LayerErrors,
    lo: int,
    p: np.ndarray,
    c: np.ndarray,
    mask: np.ndarray,
    tolerance: Tolerance,
    chunk_elements: int,
    token_ratio: np.ndarray | None = None,
) -> np.ndarray:
    """Add one layer's batch (``[heads, tokens, elements]`` from request position ``lo``,
    compared where ``mask``; ``p`` and ``c`` are overwritten) to its errors, about
    ``chunk_elements`` of a side at a time; returns per token the largest over heads of
    ``max |c - p| / max |p|`` (NaN where no head compared it), and fills ``token_ratio``
    (where given, ``[tokens]``) with the largest over heads of the tolerance ratio
    ``max |c - p| / (atol + rtol |p|)`` (``tolerance_ratio``; NaN likewise)."""
    heads, tokens, elements = p.shape
    if not mask.all():
        p[~mask] = 0
        c[~mask] = 0
    step = max(1, chunk_elements // max(tokens * elements, 1))
    chunks = []
    for h in range(0, heads, step):
        left, right = p[h : h + step], c[h : h + step]
        chunk = fast_errors(left, right, *tolerance.pair()) if elements else None
        chunks.append(chunk if chunk is not None else exact_errors(left, right, *tolerance.pair()))
    token_abs, token_scale = _joined(chunks, "token_abs"), _joined(chunks, "token_scale")
    with np.errstate(divide="ignore", invalid="ignore"):
        # 0 / 0 (nothing to compare against, no error) is NaN: 0 (fmax skips NaN).
        token_norm = np.fmax(token_abs / token_scale, 0.0)
    for h, chunk in zip(range(0, heads, step), chunks):
        if chunk.one_sided is not None:
            token_norm[h : h + step][chunk.one_sided] = np.inf
    head_abs = token_abs.max(axis=1)
    errors.tokens += mask.sum(axis=1)
    np.maximum(errors.max_abs, head_abs, out=errors.max_abs)
    np.maximum(errors.max_rel, _joined(chunks, "head_rel"), out=errors.max_rel)
    # NaN (any payload: np.fmax keeps a signalling NaN) is no scale.
    head_scale = np.nan_to_num(token_scale.max(axis=1), nan=0.0, posinf=np.inf)
    np.maximum(errors.max_producer, head_scale, out=errors.max_producer)
    errors.sum_squares += _joined(chunks, "squares")
    errors.over += _joined(chunks, "over")
    errors.nonfinite += _joined(chunks, "nonfinite")
    ratios = np.where(mask, _joined(chunks, "token_ratio"), 0.0)
    np.maximum(errors.max_ratio, ratios.max(axis=1, initial=0.0), out=errors.max_ratio)
    if token_ratio is not None:
        token_ratio[...] = np.where(mask.any(axis=0), ratios.max(axis=0, initial=0.0), np.nan)
    if head_abs.max() > 0:
        errors.merge_worst(lo, np.where(mask, token_abs, 0.0))
    return np.where(mask.any(axis=0), token_norm.max(axis=0, initial=0.0), np.nan)


def _joined(chunks: list[Chunk], name: str) -> np.ndarray:
    """One field of the chunks, their heads joined in order."""
    if len(chunks) == 1:
        return getattr(chunks[0], name)
    return np.concatenate([getattr(chunk, name) for chunk in chunks])
