"""The tolerance ratio of ``diff --numeric`` (what the HTML pictures colour): per (layer,
head) and per token the largest ``|c - p| / (atol + rtol |p|)`` (with atol 0, the largest
relative error over rtol), on the numpy path and in the C extension, against an
independent float64 computation; above 1 exactly where elements are over the tolerance."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.native_builds import built

from kvaudit.core.dtypes import parse_dtype
from kvaudit.numeric.budget import DEFAULT_BUDGET
from kvaudit.numeric.model import Tolerance
from kvaudit.numeric.native import add_raw_batch
from kvaudit.numeric.value_errors import LayerErrors, add_batch

NATIVE = built("kvaudit._native._element_errors")
TOLERANCES = [(0.002, 0.07), (0.01, 0.0), (0.0, 0.05), (0.0, 0.0)]


def batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 values ``[3 heads, 9 tokens, 16 elements]``: small drift everywhere, one
    head's token 4 damaged, one exact zero against a non-zero."""
    rng = np.random.default_rng(seed)
    p = rng.normal(0, 1, (3, 9, 16)).astype(np.float16)
    c = (p * (1 + rng.normal(0, 1e-3, p.shape))).astype(np.float16)
    c[1, 4, 3] += np.float16(0.5)
    p[2, 7, 0], c[2, 7, 0] = 0.0, 1e-4
    return p, c


def reference(p: np.ndarray, c: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """Per (head, token) the largest ratio, in float64 (0 / 0 is 0)."""
    a = np.abs(c.astype(np.float64) - p.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        if atol == 0:
            ratio = (a / np.abs(p.astype(np.float64))) / rtol
        else:
            ratio = a / (atol + rtol * np.abs(p.astype(np.float64)))
    return np.nan_to_num(ratio, nan=0.0, posinf=np.inf).max(axis=2)


def numpy_ratio(
    p: np.ndarray, c: np.ndarray, tolerance: Tolerance
) -> tuple[LayerErrors, np.ndarray]:
    errors, row = LayerErrors(p.shape[0]), np.empty(p.shape[1])
    held = np.ones(p.shape[:2], dtype=bool)
    p, c = p.astype(np.float32), c.astype(np.float32)  # float16's work dtype
    add_batch(errors, 0, p, c, held, tolerance, DEFAULT_BUDGET.chunk_elements, row)
    return errors, row


@pytest.mark.parametrize("tolerance", TOLERANCES)
def test_numpy_path_against_the_reference(tolerance: tuple[float, float]) -> None:
    p, c = batch(1)
    errors, row = numpy_ratio(p, c, Tolerance(*tolerance))
    want = reference(p, c, *tolerance)
    np.testing.assert_allclose(errors.max_ratio, want.max(axis=1), rtol=1e-5)
    np.testing.assert_allclose(row, want.max(axis=0), rtol=1e-5)
    slices = errors.slices("layer", 0, 16)
    for item in slices:
        assert (item.max_tolerance_ratio > 1) == (item.over_tolerance > 0)
    assert slices[1].max_tolerance_ratio > 1  # the damaged token fails every tolerance


@pytest.mark.skipif(NATIVE is None, reason="the C extension is not built")
@pytest.mark.parametrize("tolerance", TOLERANCES)
def test_the_extension_gives_the_numpy_ratio_bit_for_bit(tolerance: tuple[float, float]) -> None:
    p, c = batch(2)
    theirs, row = numpy_ratio(p, c, Tolerance(*tolerance))
    ours, native_row = LayerErrors(3), np.empty(9)
    side = (parse_dtype("float16"), 8, (None, None))
    add_raw_batch(
        NATIVE,
        ours,
        0,
        (p.view(np.uint16), c.view(np.uint16)),
        np.ones((3, 9), dtype=bool),
        (side, side),
        Tolerance(*tolerance),
        native_row,
    )
    np.testing.assert_array_equal(ours.max_ratio, theirs.max_ratio)
    np.testing.assert_array_equal(native_row, row)


def test_a_row_not_held_is_nan_and_counts_nowhere() -> None:
    p, c = batch(3)
    held = np.ones((3, 9), dtype=bool)
    held[:, 4] = False
    errors, row = LayerErrors(3), np.empty(9)
    p, c = p.astype(np.float32), c.astype(np.float32)
    add_batch(errors, 0, p, c, held, Tolerance(0.002, 0.07), DEFAULT_BUDGET.chunk_elements, row)
    assert np.isnan(row[4]) and np.isfinite(np.delete(row, 4)).all()
    assert errors.max_ratio[1] < 1  # head 1's damage was at the token not held
