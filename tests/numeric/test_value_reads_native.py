"""The C extension that reads a dump's rows for ``diff --numeric``
(``kvaudit/_native/_value_reads.c``): rows of any cell strides scattered into ``[heads, tokens,
elements]`` order as numpy would gather them, whole or cut short; a file that ends early;
layouts and outputs out of bounds refused; a failed read an OSError. Skipped where the
extension did not build, unless ``KVAUDIT_REQUIRE_NATIVE=1``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers.native_builds import assert_built_where_required, built, skip_unless_built

NAME = "kvaudit._native._value_reads"
NATIVE = built(NAME)
pytestmark = skip_unless_built(NATIVE, NAME, "diff --numeric reads rows in Python instead")


def test_the_extension_built_where_required() -> None:
    assert_built_where_required(NATIVE, NAME)


def rows_file(path: Path, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A file of random uint16 rows ``shape`` (rows first), and its contents."""
    data = np.random.default_rng(seed).integers(0, 2**16, shape, dtype=np.uint16)
    path.write_bytes(data.tobytes())
    return data


def scatter(
    path: Path,
    pieces: np.ndarray,
    rows: list[int],
    out: tuple[np.ndarray, np.ndarray],
    kept: tuple[int, int] | None = None,
) -> int:
    """Read ``rows`` of ``pieces`` (a view of the file's contents, as a dump maps them:
    ``[rows, kernel blocks, heads, tokens, elements]``), their token positions
    ``kept = (first, count)`` (all by default), into ``out = (array, target)``, ``target``
    a view of ``array``."""
    out, target = out
    base = pieces.__array_interface__["data"][0]
    whole = pieces.base if pieces.base is not None else pieces
    start = base - whole.__array_interface__["data"][0]
    offsets = start + np.asarray(rows, dtype=np.int64) * pieces.strides[0]
    _, blocks, heads, tokens, elements = pieces.shape
    span = sum((n - 1) * s for n, s in zip(pieces.shape[1:], pieces.strides[1:])) + 2
    row = (span, blocks, heads, tokens, *pieces.strides[1:4], elements * 2)
    offset = target.__array_interface__["data"][0] - out.__array_interface__["data"][0]
    first, count = (0, len(rows) * blocks * tokens) if kept is None else kept
    descriptor = os.open(path, os.O_RDONLY)
    try:
        where = (offset, *target.strides[:2], first, count)
        return NATIVE.scatter_rows(descriptor, offsets, row, out, where)
    finally:
        os.close(descriptor)


def gathered(pieces: np.ndarray, rows: list[int]) -> np.ndarray:
    """What numpy makes of the same rows: ``[heads, rows * blocks * tokens, elements]``."""
    picked = pieces[rows].transpose(2, 0, 1, 3, 4)
    return picked.reshape(picked.shape[0], -1, picked.shape[-1])


@pytest.mark.parametrize(
    ("layout", "part"),
    [
        ("NTHC", slice(None)),  # cells one after another: [tokens, heads]
        ("NHTC", slice(None)),  # [heads, tokens]
        ("NTHC", slice(4, 12)),  # a part of each cell: gaps between the cells read
    ],
)
def test_rows_land_where_numpy_puts_them(layout: str, part: slice, tmp_path: Path) -> None:
    blocks, heads, tokens, cell = 2, 3, 4, 16
    inner = (tokens, heads) if layout == "NTHC" else (heads, tokens)
    data = rows_file(tmp_path / "f", (6, blocks, *inner, cell), seed=len(layout))
    if layout == "NTHC":
        data = data.transpose(0, 1, 3, 2, 4)
    pieces = data[..., part]
    rows = [4, 0, 5, 2]
    want = gathered(pieces, rows)
    out = np.zeros((heads + 2, len(rows) * blocks * tokens + 3, pieces.shape[-1] + 5), np.uint16)
    target = out[1 : 1 + heads, 2 : 2 + want.shape[1], 5:]
    assert scatter(tmp_path / "f", pieces, rows, (out, target)) == len(rows)
    np.testing.assert_array_equal(target, want)
    outside = np.ones(out.shape, bool)
    outside[1 : 1 + heads, 2 : 2 + want.shape[1], 5:] = False
    assert not out[outside].any()  # nothing written elsewhere
    # Rows cut short: the tokens from the third of the first row to the second of the last.
    out[...] = 0
    first, count = 2, want.shape[1] - 2 - (tokens - 2)
    short = out[1 : 1 + heads, 2 : 2 + count, 5:]
    assert scatter(tmp_path / "f", pieces, rows, (out, short), (first, count)) == len(rows)
    np.testing.assert_array_equal(short, want[:, first : first + count])
    outside[...] = True
    outside[1 : 1 + heads, 2 : 2 + count, 5:] = False
    assert not out[outside].any()


def test_a_file_that_ends_early_reads_fewer_rows(tmp_path: Path) -> None:
    data = rows_file(tmp_path / "f", (4, 1, 2, 3, 8), seed=1)
    os.truncate(tmp_path / "f", data.nbytes - 10)
    out = np.zeros((2, 12, 8), np.uint16)
    assert scatter(tmp_path / "f", data, [0, 3, 1], (out, out)) == 1


def test_layouts_and_outputs_out_of_bounds_are_refused(tmp_path: Path) -> None:
    rows_file(tmp_path / "f", (2, 1, 2, 3, 8), seed=2)
    out = np.zeros((2, 3, 8), np.uint16)
    offsets = np.zeros(1, np.int64)
    descriptor = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        good = (96, 1, 2, 3, 96, 48, 16, 16)
        assert NATIVE.scatter_rows(descriptor, offsets, good, out, (0, 48, 16, 0, 3)) == 1
        beyond_span = (95, 1, 2, 3, 96, 48, 16, 16)
        with pytest.raises(ValueError, match="row layout"):
            NATIVE.scatter_rows(descriptor, offsets, beyond_span, out, (0, 48, 16, 0, 3))
        with pytest.raises(ValueError, match="row layout"):  # more tokens than the rows hold
            NATIVE.scatter_rows(descriptor, offsets, good, out, (0, 48, 16, 1, 3))
        with pytest.raises(ValueError, match="output holds 96 bytes"):
            NATIVE.scatter_rows(descriptor, offsets, good, out, (2, 48, 16, 0, 3))
        with pytest.raises(ValueError, match="int64"):
            where = (0, 48, 16, 0, 3)
            NATIVE.scatter_rows(descriptor, np.zeros(1, np.int32), good, out, where)
    finally:
        os.close(descriptor)
    with pytest.raises(OSError):
        NATIVE.scatter_rows(descriptor, offsets, good, out, (0, 48, 16, 0, 3))  # closed
