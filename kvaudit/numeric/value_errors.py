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
        return Chunk(token_abs, token_scale, None, zeros, none, zeros, none)
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
        return Chunk(token_abs, token_scale, None, zeros, over, zeros, over)
    ratio = c  # c is not needed any more
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(a, p, out=ratio)
    # 0 / 0 (both 0) is NaN, which fmax skips; a head of only those has no error.
    head_rel = np.fmax(np.fmax.reduce(ratio.reshape(heads, -1), axis=1), 0.0)
    if atol == 0:
        # a > rtol |p| is a / |p| > rtol (0 / 0, a NaN, is not over; a / 0 is).
        counted = np.flatnonzero(head_rel > rtol)
        exceed = np.greater(ratio, rtol, out=scratch("exceed", np.bool_, p.shape))
    else:
        counted = np.flatnonzero(head_abs > atol)
        if counted.size:
            np.multiply(p, rtol, out=ratio)
            ratio += atol
            exceed = np.greater(a, ratio, out=scratch("exceed", np.bool_, p.shape))
    if counted.size:
        over[:] = counts(exceed)
    squares = _squares(a)
    return Chunk(token_abs, token_scale, None, head_rel, over, squares, zeros.astype(np.int64))


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
    over = np.zeros(heads, dtype=np.int64)
    one_sided = None if mismatch is None else mismatch.any(axis=2)
    if head_abs.max() > 0:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.divide(a, p, out=c)  # c is not needed any more
            token_rel = np.nan_to_num(np.fmax.reduce(ratio, axis=2), nan=0.0, posinf=np.inf)
        if one_sided is not None:
            token_rel[one_sided] = np.inf
        if head_abs.max() > atol:
            if atol == 0:
                # As in fast_errors (and the C extension): the same test rounds the same
                # way whichever path a chunk takes.
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
    return Chunk(token_abs, token_scale, one_sided, token_rel.max(axis=1), over, squares, nonfinite)


class LayerErrors:
    """One layer's errors per global head, batch after batch (``SliceErrors`` at the end):
    ``figures`` and ``counts`` hold the per-head arrays (updated in place, by numpy or by
    ``kvaudit._native._element_errors``)."""

    def __init__(self, heads: int) -> None:
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
) -> np.ndarray:
    """Add one layer's batch (``[heads, tokens, elements]`` from request position ``lo``,
    compared where ``mask``; ``p`` and ``c`` are overwritten) to its errors, about
    ``chunk_elements`` of a side at a time; returns per token the largest over heads of
    ``max |c - p| / max |p|`` (NaN where no head compared it)."""
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
    if head_abs.max() > 0:
        errors.merge_worst(lo, np.where(mask, token_abs, 0.0))
    return np.where(mask.any(axis=0), token_norm.max(axis=0, initial=0.0), np.nan)


def _joined(chunks: list[Chunk], name: str) -> np.ndarray:
    """One field of the chunks, their heads joined in order."""
    if len(chunks) == 1:
        return getattr(chunks[0], name)
    return np.concatenate([getattr(chunk, name) for chunk in chunks])
