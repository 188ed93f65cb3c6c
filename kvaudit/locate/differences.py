"""``locate_differences``: the (layer, global head) slices whose cells differ at a block
position, compared byte by byte on both sides, with the differing tokens, the first
differing byte and the largest errors of the differing elements read in their dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..core.dtypes import DType, dtype_name, dtype_size
from ..core.elements import decode
from ..core.errors import KvauditError
from ..core.scheme import valid_tokens
from ..workers import RawWorker
from .cells import CellSegment
from .model import ElementChange, LocatedDifference
from .slices import SliceCells, SliceId, SliceReader

if TYPE_CHECKING:
    import torch


def element_errors(
    reference: np.ndarray, other: np.ndarray, segments: Sequence[CellSegment]
) -> tuple[float, float]:
    """The largest absolute and relative error over the elements whose bytes differ, in
    uint8 cells ``[tokens, cell bytes]`` read as the segments' dtypes.

    The relative error is relative to the reference value (infinite where the reference
    is 0 and the other is not); a NaN on one side only counts as an infinite error, NaN on
    both sides as none.
    """
    max_abs, max_rel, _ = _differing_elements(reference, other, segments)
    return max_abs, max_rel


def _differing_elements(
    reference: np.ndarray, other: np.ndarray, segments: Sequence[CellSegment]
) -> tuple[float, float, int]:
    """``element_errors``, and how many floating elements of ``other`` are NaN or
    infinite where the same elements of ``reference`` are finite: each differing element
    decoded once."""
    max_abs = 0.0
    max_rel = 0.0
    nonfinite = 0
    for segment in segments:
        size = dtype_size(segment.dtype)
        a = np.ascontiguousarray(reference[:, segment.start : segment.end]).reshape(-1, size)
        b = np.ascontiguousarray(other[:, segment.start : segment.end]).reshape(-1, size)
        differ = (a != b).any(axis=1)
        if not differ.any():
            continue
        abs_errors, rel_errors, count = _errors(a[differ], b[differ], segment.dtype)
        max_abs = max(max_abs, float(abs_errors.max()))
        max_rel = max(max_rel, float(rel_errors.max()))
        nonfinite += count
    return max_abs, max_rel, nonfinite


_BITS = np.array([bin(value).count("1") for value in range(256)], dtype=np.int64)
"""The set bits of each byte value."""


def largest_value(cells: np.ndarray, segments: Sequence[CellSegment]) -> float:
    """The largest finite magnitude of the elements of uint8 cells ``[tokens, cell
    bytes]`` read as the segments' dtypes (0.0 where there is none)."""
    largest = 0.0
    for segment in segments:
        size = dtype_size(segment.dtype)
        raw = np.ascontiguousarray(cells[:, segment.start : segment.end]).reshape(-1, size)
        magnitudes = np.abs(_elements(raw, segment.dtype).astype(np.float64))
        magnitudes = magnitudes[np.isfinite(magnitudes)]
        if magnitudes.size:
            largest = max(largest, float(magnitudes.max()))
    return largest


def scaled_error(max_abs: float, largest: float) -> float:
    """An error against the largest value around it: 0 where nothing differs, infinite
    where that value is 0 or the error has no finite size."""
    if max_abs == 0:
        return 0.0
    if largest == 0 or not np.isfinite(max_abs):
        return float("inf")
    return max_abs / largest


def _errors(
    a: np.ndarray, b: np.ndarray, dtype: DType | torch.dtype
) -> tuple[np.ndarray, np.ndarray, int]:
    """Absolute and relative errors of elements given as their bytes ``[n, size]``, and
    how many of ``b`` are NaN or infinite where those of ``a`` are finite."""
    nonfinite = 0
    if dtype.is_floating_point:
        x = _elements(a, dtype)
        y = _elements(b, dtype)
        nonfinite = int((np.isfinite(x) & ~np.isfinite(y)).sum())
        with np.errstate(invalid="ignore", over="ignore"):
            abs_errors = np.abs(x - y)
        one_nan = np.isnan(x) != np.isnan(y)
        both_nan = np.isnan(x) & np.isnan(y)
        abs_errors[one_nan] = np.inf
        abs_errors[both_nan] = 0.0
        reference = np.abs(x)
    else:
        # Python integers: exact differences, even of 64-bit values beyond float precision.
        xs = _elements(a, dtype).tolist()
        ys = _elements(b, dtype).tolist()
        abs_errors = np.array([float(abs(x - y)) for x, y in zip(xs, ys)])
        reference = np.array([float(abs(x)) for x in xs])
    rel_errors = np.zeros_like(abs_errors)
    nonzero = abs_errors != 0
    infinite = nonzero & (np.isinf(abs_errors) | (reference == 0) | ~np.isfinite(reference))
    rel_errors[infinite] = np.inf
    finite = nonzero & ~infinite
    rel_errors[finite] = abs_errors[finite] / reference[finite]
    return abs_errors, rel_errors, nonfinite


def _elements(raw: np.ndarray, dtype: DType | torch.dtype) -> np.ndarray:
    """Elements given as their bytes ``[n, size]``: float64 values of a floating dtype,
    else the integers (a bool element as its byte)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if dtype.is_floating_point:
        values = np.empty((len(raw), 1), dtype=np.float64)
        with np.errstate(invalid="ignore"):  # a signalling NaN widened is still a NaN
            decode(raw, dtype, values)
        return values.reshape(-1)
    name = dtype_name(dtype)
    integers = np.dtype("uint8" if name == "bool" else name).newbyteorder("<")
    return raw.reshape(-1).view(integers)


def _located_entry(
    position: int, name: str, head: int, reference: SliceCells, other: SliceCells, replica: int
) -> LocatedDifference | None:
    """The located entry of one slice pair at the tokens both hold, or None when their
    cells agree there; ``replica`` (when not 0) is the consumer replica compared."""
    tokens, index_a, index_b = np.intersect1d(reference.tokens, other.tokens, return_indices=True)
    a, b = reference.cells[index_a], other.cells[index_b]
    if a.shape[1] != b.shape[1]:
        return None
    differ = a != b
    rows = np.flatnonzero(differ.any(axis=1))
    if not len(rows):
        return None
    max_abs, max_rel, nonfinite = _differing_elements(a[rows], b[rows], reference.segments)
    largest = largest_value(a, reference.segments)
    flipped = np.bitwise_xor(a[rows], b[rows])
    element = None
    if len(rows) == 1:
        element = _one_element(a[rows[0]], b[rows[0]], reference.segments, reference.parts)
    return LocatedDifference(
        position=position,
        layer=name,
        head=head,
        tokens=[int(t) for t in tokens[rows]],
        first_byte=int(np.argmax(differ[rows[0]])),
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        scaled_error=scaled_error(max_abs, largest),
        replica=replica,
        consumer_worker=other.worker,
        file=other.file,
        differing_bytes=int(np.count_nonzero(flipped)),
        differing_bits=int(_BITS[flipped].sum()),
        consumer_zeros=not b[rows].any(),
        nonfinite=nonfinite,
        kv_exchanged=_kv_exchanged(a[rows], b[rows], reference.parts),
        element=element,
    )


def _kv_exchanged(a: np.ndarray, b: np.ndarray, parts: tuple[int, ...]) -> bool:
    """Whether cells ``b`` (a K row then a V row each, of equal sizes: ``parts``) hold
    cells ``a`` with their K and V rows exchanged."""
    if len(parts) != 2 or parts[1] * 2 != a.shape[1]:
        return False
    half = parts[1]
    return bool(
        np.array_equal(b[:, :half], a[:, half:]) and np.array_equal(b[:, half:], a[:, :half])
    )


def _one_element(
    a: np.ndarray, b: np.ndarray, segments: Sequence[CellSegment], parts: tuple[int, ...]
) -> ElementChange | None:
    """The one element in which cell ``b`` differs from cell ``a`` (both uint8 ``[cell
    bytes]``), or None where more than one does; its index counted within its K or V
    row where the cell has two parts, else within its segment."""
    found: tuple[int, int, CellSegment, float | int, float | int] | None = None
    for segment in segments:
        size = dtype_size(segment.dtype)
        x = a[segment.start : segment.end].reshape(-1, size)
        y = b[segment.start : segment.end].reshape(-1, size)
        differ = np.flatnonzero((x != y).any(axis=1))
        if not len(differ):
            continue
        if len(differ) > 1 or found is not None:
            return None
        k = int(differ[0])
        values = [_elements(side[k : k + 1], segment.dtype)[0] for side in (x, y)]
        floating = segment.dtype.is_floating_point
        before, after = (float(v) if floating else int(v) for v in values)
        found = (segment.start + k * size, size, segment, before, after)
    if found is None:
        return None
    byte, size, segment, before, after = found
    part, start = "", segment.start
    if len(parts) == 2:
        part, start = ("K", parts[0]) if byte < parts[1] else ("V", parts[1])
    return ElementChange(part, (byte - start) // size, dtype_name(segment.dtype), before, after)


def _content(item: SliceCells) -> bytes:
    """A digest of a slice's cells and the tokens they sit at."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(item.tokens, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(item.cells).tobytes())
    return digest.digest()


def _with_holders(
    entries: list[LocatedDifference],
    produced: Mapping[SliceId, SliceCells],
    consumed: Mapping[SliceId, SliceCells],
) -> list[LocatedDifference]:
    """The entries of one position, each of replica 0 with the other producer slice whose
    cells it holds (``holds``), where one does: heads or layers exchanged."""
    wanted = [entry for entry in entries if entry.replica == 0]
    if not wanted:
        return entries
    by_content: dict[bytes, tuple[str, int]] = {}
    for (name, head, replica), item in produced.items():
        if replica == 0:
            by_content.setdefault(_content(item), (name, head))
    result = []
    for entry in entries:
        if entry.replica == 0 and not entry.consumer_zeros:
            # Zeros held are never another slice's: they read as zeros, not an exchange.
            holder = by_content.get(_content(consumed[entry.layer, entry.head, 0]))
            if holder is not None and holder != (entry.layer, entry.head):
                entry = replace(entry, holds=holder)
        result.append(entry)
    return result


def locate_differences(
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    request_id: str,
    group_id: int,
    positions: Iterable[int],
    block_size: int,
    num_tokens: int,
) -> list[LocatedDifference]:
    """The (layer, global head) slices that differ at each of ``positions``.

    Each entry gives the slice's differing request positions, first differing byte and
    largest errors. Positions are numbered in blocks of ``block_size`` tokens, which may
    be coarser than either side's; position ``p`` covers request positions
    ``p * block_size .. p * block_size + block_size - 1`` below ``num_tokens``. Producer
    replica 0 is compared with consumer replica 0; each consumer replica ``r > 0`` with
    consumer replica 0 (its entries have ``replica == r``). Only the blocks of those
    positions are read. Entries are sorted by position, replica, layer number, layer name
    and head.

    Args:
        producer: The producer's raw KV, one entry per worker.
        consumer: The consumer's raw KV, one entry per worker.
        request_id: The request whose blocks are compared.
        group_id: The group whose blocks are compared.
        positions: The block positions to compare (repeats are compared once).
        block_size: The tokens of one position.
        num_tokens: The request's tokens compared; tokens at or past it are not read.

    Returns:
        The differing slices; an empty list where the cells agree.

    Raises:
        KvauditError: ``block_size`` is not positive.

    """
    if block_size < 1:
        raise KvauditError(f"block size must be positive, got {block_size}")
    sides = [SliceReader.open(raw, request_id, group_id) for raw in (producer, consumer)]
    entries: list[LocatedDifference] = []
    for position in sorted(set(positions)):
        lo = position * block_size
        hi = lo + int(valid_tokens(num_tokens, block_size, position))
        if hi <= lo:
            continue
        produced, consumed = (side.gather(request_id, group_id, lo, hi) for side in sides)
        found = []
        for (name, head, replica), item in consumed.items():
            # Replica 0 is checked against the producer, another replica against replica 0.
            reference = (consumed if replica else produced).get((name, head, 0))
            if reference is None:
                continue
            entry = _located_entry(position, name, head, reference, item, replica)
            if entry is not None:
                found.append(((replica, item.number, name, head), entry))
        found.sort(key=lambda pair: pair[0])
        entries.extend(_with_holders([entry for _, entry in found], produced, consumed))
    return entries
