"""The C extension of ``diff --numeric`` (``kvaudit/_native/_element_errors.c``): one layer's batch
of raw element bits against the independent numpy computation (valued_sets.errors_reference,
and below the same with NaN and Inf) for every dtype, fp8 with scales, NaN and Inf on one
side and on both, denormals, -0.0, values exactly at the tolerance, rows not held, ragged
shapes; equal to the numpy path (``kvaudit.numeric.value_errors``) on random batches (hypothesis),
batch after batch; the GIL released. Where the extension did not build these tests skip
(the numpy path runs everywhere), unless ``KVAUDIT_REQUIRE_NATIVE=1``."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers.native_builds import assert_built_where_required, built, skip_unless_built
from helpers.valued_sets import errors_reference
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaudit.core.dtypes import DType, parse_dtype, torch_dtype
from kvaudit.core.elements import decode, work_dtype
from kvaudit.numeric.budget import DEFAULT_BUDGET
from kvaudit.numeric.model import Tolerance
from kvaudit.numeric.native import SCALES, add_raw_batch, native_module, raw_dtype, reads
from kvaudit.numeric.value_errors import LayerErrors, add_batch

NAME = "kvaudit._native._element_errors"
NATIVE = built(NAME)
pytestmark = skip_unless_built(NATIVE, NAME, "the numpy path of diff --numeric runs instead")
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
Side = tuple[DType, int, SCALES]


def test_the_extension_built_where_required() -> None:
    assert_built_where_required(NATIVE, NAME)


def test_kvaudit_native_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVAUDIT_NATIVE", "0")
    assert native_module() is None
    monkeypatch.setenv("KVAUDIT_NATIVE", "1")
    assert native_module() is NATIVE
    assert reads(NATIVE, *(parse_dtype(name) for name in DTYPES))
    assert not reads(NATIVE, parse_dtype("int8"))


def to_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float values as the bits of ``dtype`` (torch rounds), an unsigned array of their size."""
    kind = parse_dtype(dtype)
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
    raw = tensor.to(torch_dtype(kind)).view(torch.uint8).numpy()
    return raw.view(raw_dtype(kind)).reshape(values.shape)


def from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The float64 values of bits, decoded by torch (independently of kvaudit)."""
    tensor = torch.from_numpy(np.ascontiguousarray(bits).view(np.uint8))
    return tensor.view(torch_dtype(parse_dtype(dtype))).to(torch.float64).numpy()


def native_errors(
    bits: tuple[np.ndarray, np.ndarray],
    sides: tuple[Side, Side],
    tolerance: tuple[float, float],
    held: np.ndarray | None = None,
    errors: LayerErrors | None = None,
    lo: int = 0,
) -> tuple[LayerErrors, np.ndarray]:
    """A batch through the C extension: the layer's errors and the token row."""
    heads, tokens, _ = bits[0].shape
    held = np.ones((heads, tokens), dtype=bool) if held is None else held
    errors = LayerErrors(heads) if errors is None else errors
    return errors, add_raw_batch(NATIVE, errors, lo, bits, held, sides, Tolerance(*tolerance))


def numpy_errors(
    bits: tuple[np.ndarray, np.ndarray],
    sides: tuple[Side, Side],
    tolerance: tuple[float, float],
    held: np.ndarray | None = None,
    errors: LayerErrors | None = None,
    lo: int = 0,
) -> tuple[LayerErrors, np.ndarray]:
    """The same batch through the numpy path: decoded into each side's work dtype, scaled
    there (as value_reads.decode_layer does), then ``add_batch``."""
    heads, tokens, _ = bits[0].shape
    values = []
    for raw, (dtype, head_size, (k_scale, v_scale)) in zip(bits, sides):
        out = np.empty(raw.shape, work_dtype(dtype))
        decode(raw.view(np.uint8), dtype, out)
        with np.errstate(all="ignore"):  # Inf times a scale, overflow
            if k_scale is not None:
                out[..., :head_size] *= k_scale
            if v_scale is not None:
                out[..., head_size:] *= v_scale
        values.append(out)
    p, c = values
    if p.dtype != c.dtype:
        p, c = p.astype(np.float64), c.astype(np.float64)
    held = np.ones((heads, tokens), dtype=bool) if held is None else held
    errors = LayerErrors(heads) if errors is None else errors
    with np.errstate(all="ignore"):
        row = add_batch(
            errors, lo, p, c, held.copy(), Tolerance(*tolerance), DEFAULT_BUDGET.chunk_elements
        )
    return errors, row


def nonfinite_reference(p: np.ndarray, c: np.ndarray, atol: float, rtol: float) -> dict:
    """errors_reference with NaN and Inf as docs/numeric.md defines them (p and c float64
    ``[tokens, elements]``): NaN against NaN and an Inf against the same Inf agree; a NaN or
    an Inf on one side only (against a number, a NaN or the opposite Inf) is an infinite
    error, over tolerance, out of the squares, and makes the token's relative error
    infinite."""
    agree = (np.isnan(p) & np.isnan(c)) | (p == c)
    one_sided = ~agree & ((np.isnan(p) != np.isnan(c)) | np.isinf(p) | np.isinf(c))
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.where(agree, 0.0, np.where(one_sided, np.inf, np.abs(c - p)))
        rel = np.where(err == 0, 0.0, err / np.abs(p))
    rel = np.nan_to_num(rel, nan=0.0, posinf=np.inf)
    rel = np.where(one_sided.any(axis=1, keepdims=True), np.inf, rel)
    per_token = err.max(axis=1)
    order = sorted(range(len(per_token)), key=lambda t: (-per_token[t], t))
    with np.errstate(invalid="ignore"):
        over = one_sided | (err > atol + rtol * np.abs(p))
    return {
        "max_abs_error": err.max(),
        "max_rel_error": rel.max(),
        "sum_squares": float(np.sum(np.where(one_sided, 0.0, err) ** 2)),
        "over_tolerance": int(over.sum()),
        "nonfinite": int(one_sided.sum()),
        "worst": [int(t) for t in order[:5] if per_token[t] > 0],
    }


def assert_matches(
    errors: LayerErrors, p: np.ndarray, c: np.ndarray, tolerance: tuple[float, float]
) -> None:
    """Every head of one batch (p and c float64 ``[heads, tokens, elements]``, all held)
    against the reference."""
    for head in range(p.shape[0]):
        want = nonfinite_reference(p[head], c[head], *tolerance)
        assert errors.max_abs[head] == want["max_abs_error"], head
        assert errors.max_rel[head] == pytest.approx(want["max_rel_error"], rel=1e-6), head
        assert errors.sum_squares[head] == pytest.approx(want["sum_squares"], rel=1e-9), head
        assert errors.over[head] == want["over_tolerance"], head
        assert errors.nonfinite[head] == want["nonfinite"], head
        assert errors.tokens[head] == p.shape[1]
        found = [int(t) for t, e in zip(errors.worst_position[head], errors.worst_error[head]) if e]
        assert found == want["worst"], head
        magnitude = np.abs(p[head])
        # A NaN has no magnitude: the largest |p| of the numbers (0 when there are none).
        numbers = magnitude[~np.isnan(magnitude)]
        assert errors.max_producer[head] == (numbers.max() if numbers.size else 0.0)


def plain(dtype: str, head_size: int, scales: SCALES = (None, None)) -> Side:
    return parse_dtype(dtype), head_size, scales


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tolerance", [(0.0, 0.05), (0.01, 0.05), (0.0, 0.0)])
def test_errors_match_the_reference_per_dtype(dtype: str, tolerance: tuple[float, float]) -> None:
    rng = np.random.default_rng(len(dtype))
    shape = (3, 11, 13)  # rows of 13 elements: one vector and a part
    p_bits = to_bits(rng.normal(0, 2, shape), dtype)
    c_bits = to_bits(from_bits(p_bits, dtype) * (1 + rng.normal(0, 0.05, shape)), dtype)
    c_bits[1, 4] = p_bits[1, 4]  # a token equal on both sides
    p, c = from_bits(p_bits, dtype), from_bits(c_bits, dtype)
    sides = (plain(dtype, 6), plain(dtype, 6))
    errors, row = native_errors((p_bits, c_bits), sides, tolerance)
    for head in range(3):
        want = errors_reference(p[head], c[head], *tolerance)
        assert errors.max_abs[head] == want["max_abs_error"]
        assert errors.max_rel[head] == pytest.approx(want["max_rel_error"], rel=1e-6)
        rms = np.sqrt(errors.sum_squares[head] / c[head].size)
        assert rms == pytest.approx(want["rms_error"], rel=1e-9)
        assert errors.over[head] == want["over_tolerance"]
        found = [int(t) for t in errors.worst_position[head] if t >= 0]
        assert found == want["worst"]
    scaled = (np.abs(c - p).max(axis=2) / np.abs(p).max(axis=2)).max(axis=0)
    np.testing.assert_allclose(row, scaled, rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_with_scales_against_bf16(dtype: str) -> None:
    """An fp8 consumer with K and V scales against the bf16 producer it was quantized from:
    powers of two, so the reference (float64) scales exactly as the extension does."""
    rng = np.random.default_rng(3)
    shape, head_size, scales = (2, 9, 16), 8, (0.25, 4.0)
    p_bits = to_bits(rng.normal(0, 1, shape), "bfloat16")
    p = from_bits(p_bits, "bfloat16")
    quantized = p.copy()
    quantized[..., :head_size] /= scales[0]
    quantized[..., head_size:] /= scales[1]
    c_bits = to_bits(quantized, dtype)
    c = from_bits(c_bits, dtype)
    c[..., :head_size] *= scales[0]
    c[..., head_size:] *= scales[1]
    sides = (plain("bfloat16", head_size), plain(dtype, head_size, scales))
    errors, _ = native_errors((p_bits, c_bits), sides, (0.0, 0.3))
    assert_matches(errors, p, c, (0.0, 0.3))
    assert errors.over.sum() == 0 < errors.max_abs.min()
    c_bits[1, 5, 3] ^= 0x40  # one corrupted element
    errors, _ = native_errors((p_bits, c_bits), sides, (0.0, 0.3))
    assert list(errors.over) == [0, 1]


def test_scales_round_as_the_numpy_path() -> None:
    """A scale that is no power of two: each side scaled in its own work type (float32
    for 16-bit and 8-bit dtypes), bit for bit as the numpy path does."""
    rng = np.random.default_rng(4)
    bits = tuple(to_bits(rng.normal(0, 1, (2, 7, 10)), d) for d in ("float8_e4m3fn", "float32"))
    sides = (plain("float8_e4m3fn", 4, (0.1, None)), plain("float32", 4, (None, 0.3)))
    ours, row = native_errors(bits, sides, (0.0, 0.01))
    theirs, want = numpy_errors(bits, sides, (0.0, 0.01))
    assert_same(ours, theirs, row, want)


SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.5]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e5m2"])
def test_nan_and_inf_on_one_side_and_on_both(dtype: str) -> None:
    """Every pair of NaN, +-Inf, +-0 and a number on one token each, beside ordinary
    differences."""
    pairs = [(a, b) for a in SPECIALS for b in SPECIALS]
    rng = np.random.default_rng(5)
    p = rng.normal(0, 1, (2, len(pairs), 9))
    c = p * 1.01
    for token, (a, b) in enumerate(pairs):
        p[token % 2, token, token % 9], c[token % 2, token, token % 9] = a, b
    p_bits, c_bits = to_bits(p, dtype), to_bits(c, dtype)
    p, c = from_bits(p_bits, dtype), from_bits(c_bits, dtype)
    sides = (plain(dtype, 4), plain(dtype, 4))
    errors, row = native_errors((p_bits, c_bits), sides, (0.001, 0.02))
    assert_matches(errors, p, c, (0.001, 0.02))
    assert errors.nonfinite.sum() > 0
    theirs, want = numpy_errors((p_bits, c_bits), sides, (0.001, 0.02))
    assert_same(errors, theirs, row, want)


def test_e4m3fn_nan_codes_on_one_side() -> None:
    """e4m3fn has no Inf: its NaN codes (0x7f, 0xff) against numbers and each other."""
    p_bits = np.array([[[0x7F, 0xFF, 0x38, 0x7F]]], dtype=np.uint8)
    c_bits = np.array([[[0xFF, 0x38, 0x7F, 0x38]]], dtype=np.uint8)
    sides = (plain("float8_e4m3fn", 2), plain("float8_e4m3fn", 2))
    errors, row = native_errors((p_bits, c_bits), sides, (0.0, 0.0))
    assert (errors.nonfinite[0], errors.over[0], errors.max_abs[0]) == (3, 3, np.inf)
    assert row[0] == np.inf and errors.max_producer[0] == 1.0  # 0x38; the NaNs have none


def test_opposite_infinities_and_overflow_as_the_numpy_path() -> None:
    """+Inf against -Inf (an Inf on one side only: each side's Inf is missing on the
    other) and finite values whose difference overflows float32 (an infinite error over
    tolerance, not a non-finite mismatch): as the numpy path counts them."""
    p = np.array([[[np.inf, 1.0, 3e38, 2.0], [-np.inf, 1.0, 1.0, 1.0]]])
    c = np.array([[[-np.inf, 1.0, -3e38, 2.0], [np.inf, 1.5, 1.0, 1.0]]])
    for dtype in ("bfloat16", "float32"):
        bits = (to_bits(p, dtype), to_bits(c, dtype))
        sides = (plain(dtype, 2), plain(dtype, 2))
        for tolerance in ((0.0, 0.1), (0.5, 0.1)):
            ours, row = native_errors(bits, sides, tolerance)
            theirs, want = numpy_errors(bits, sides, tolerance)
            assert_same(ours, theirs, row, want)
            assert ours.max_abs[0] == np.inf and ours.nonfinite[0] == 2
            # Both infinities and the overflow; 1.0 against 1.5 only without atol.
            assert ours.over[0] == (4 if tolerance[0] == 0 else 3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_denormals_and_signed_zeros(dtype: str) -> None:
    tiny = {"bfloat16": 1e-39, "float16": 3e-6, "float32": 1e-42, "float8_e4m3fn": 0.004}[dtype]
    p = np.array(
        [
            [[tiny, -tiny, 0.0, -0.0, 2 * tiny, 0.0], [-0.0, 0.0, tiny, 1.0, -0.0, 3.0]],
            [[-0.0, 0.0, 1.0, -0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
        ]
    )
    c = np.array(
        [
            [[2 * tiny, tiny, -0.0, 0.0, 2 * tiny, tiny], [0.0, -0.0, 0.0, 1.0, 0.0, 3.0]],
            [[0.0, -0.0, 1.0, 0.0, -0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
        ]
    )
    p_bits, c_bits = to_bits(p, dtype), to_bits(c, dtype)
    p, c = from_bits(p_bits, dtype), from_bits(c_bits, dtype)
    assert 0 < np.abs(p[0, 0, 0]) < np.finfo(np.float32).tiny or dtype != "float32"
    sides = (plain(dtype, 3), plain(dtype, 3))
    errors, row = native_errors((p_bits, c_bits), sides, (0.0, 0.5))
    assert_matches(errors, p, c, (0.0, 0.5))
    assert errors.max_rel[0] == np.inf  # tiny against 0
    assert errors.max_abs[1] == 0.0 and errors.worst_position[1, 0] == -1  # -0.0 against 0.0
    assert errors.max_producer[1] == 2.0 and row[1] == pytest.approx(abs(p[0, 1, 2]) / 3.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("atol", [0.0, 0.5])
def test_values_exactly_at_the_tolerance_pass(dtype: str, atol: float) -> None:
    """|c - p| == atol + rtol |p| exactly is not over; the next value up is."""
    rtol = 0.25
    p = np.array([2.0, -2.0, 4.0 if atol == 0 else 1.0])
    at = p + np.sign(p) * (atol + rtol * np.abs(p))
    p_bits = to_bits(p, dtype)[None, None]
    c_bits = to_bits(at, dtype)[None, None]
    np.testing.assert_array_equal(from_bits(c_bits, dtype)[0, 0], at)  # exact in the dtype
    sides = (plain(dtype, 1), plain(dtype, 1))
    errors, _ = native_errors((p_bits, c_bits), sides, (atol, rtol))
    assert errors.over[0] == 0
    further = c_bits + np.array(1, dtype=c_bits.dtype)  # one code further from 0
    errors, _ = native_errors((p_bits, further), sides, (atol, rtol))
    assert errors.over[0] == 3


def test_rows_not_held_and_ragged_rows() -> None:
    """Rows one side lacks are left out of every figure; a token no head holds is NaN in
    the token row; rows of 1 to 17 elements (whole vectors and parts)."""
    rng = np.random.default_rng(6)
    for elements in (1, 7, 8, 9, 17):
        p = rng.normal(0, 1, (3, 5, elements))
        c = p + rng.normal(0, 0.1, p.shape)
        held = rng.random((3, 5)) > 0.4
        held[:, 2] = False
        bits = (to_bits(p, "float16"), to_bits(c, "float16"))
        sides = (plain("float16", elements // 2), plain("float16", elements // 2))
        ours, row = native_errors(bits, sides, (0.0, 0.05), held)
        theirs, want = numpy_errors(bits, sides, (0.0, 0.05), held)
        assert_same(ours, theirs, row, want)
        assert np.isnan(row[2]) and list(ours.tokens) == list(held.sum(axis=1))
        values = [from_bits(b, "float16") for b in bits]
        for head in range(3):
            kept = held[head]
            if kept.any():
                want_head = errors_reference(values[0][head][kept], values[1][head][kept], 0, 0.05)
                assert ours.max_abs[head] == want_head["max_abs_error"]
                assert ours.over[head] == want_head["over_tolerance"]


def assert_same(ours: LayerErrors, theirs: LayerErrors, row: np.ndarray, want: np.ndarray) -> None:
    """The extension's figures equal the numpy path's: bit for bit, but for the sums of
    squares (float64 throughout here; float32 per token there)."""
    for name in ("max_abs", "max_rel", "max_producer", "worst_error"):
        np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name), name)
    for name in ("tokens", "over", "nonfinite", "worst_position"):
        np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name), name)
    np.testing.assert_array_equal(row, want)
    finite = np.isfinite(theirs.sum_squares)  # float32 squares overflow there, not here
    np.testing.assert_allclose(ours.sum_squares[finite], theirs.sum_squares[finite], rtol=1e-5)


NARROW = ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]


@st.composite
def batches(draw: st.DrawFn, whole_vectors: bool = False) -> tuple:
    """Both sides' bits (random bit patterns, or values and values close to them), dtypes,
    head sizes, scales, tolerance, rows held, in two batches. whole_vectors: both sides of
    one narrow dtype, rows and head sizes in whole vectors of 8 elements (the rows the C
    loop decodes in place of a row buffer)."""
    if whole_vectors:
        kinds = (draw(st.sampled_from(NARROW)),) * 2
    else:
        kinds = (draw(st.sampled_from([*NARROW, "float32"])), draw(st.sampled_from(DTYPES)))
    heads, tokens = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    elements = 8 * draw(st.integers(1, 5)) if whole_vectors else draw(st.integers(1, 20))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (heads, 2 * tokens, elements)
    if draw(st.booleans()) and all(kind in NARROW for kind in kinds):
        bits = tuple(
            rng.integers(0, 256, (*shape, parse_dtype(k).itemsize), np.uint8) for k in kinds
        )
        bits = tuple(b.view(raw_dtype(parse_dtype(k)))[..., 0] for b, k in zip(bits, kinds))
    else:
        p = rng.normal(0, draw(st.sampled_from([1e-3, 1.0, 100.0])), shape)
        c = p * (1 + rng.normal(0, draw(st.sampled_from([0.0, 1e-3, 0.1])), shape))
        specials = rng.random(shape) < draw(st.sampled_from([0.0, 0.05]))
        c[specials] = rng.choice(SPECIALS, specials.sum())
        bits = (to_bits(p, kinds[0]), to_bits(c, kinds[1]))
    scales = st.sampled_from([None, 0.5, 0.1, 3.0])
    if whole_vectors:
        head_sizes = st.integers(0, elements // 8).map(lambda n: 8 * n)
    else:
        head_sizes = st.integers(0, elements)
    sides = tuple(plain(kind, draw(head_sizes), (draw(scales), draw(scales))) for kind in kinds)
    tolerance = (draw(st.sampled_from([0.0, 1e-3, 0.5])), draw(st.sampled_from([0.0, 0.01, 1.0])))
    held = rng.random(shape[:2]) > draw(st.sampled_from([0.0, 0.3]))
    return bits, sides, tolerance, held, tokens


@settings(max_examples=150, deadline=None)
@given(st.one_of(batches(), batches(whole_vectors=True)))
def test_equal_to_the_numpy_path(batch: tuple) -> None:
    """Random batches, and rows of whole vectors (decoded inside the C loop)."""
    bits, sides, tolerance, held, tokens = batch
    ours, theirs = LayerErrors(bits[0].shape[0]), LayerErrors(bits[0].shape[0])
    for lo in (0, tokens):  # two batches: maxima, sums and worst tokens carried over
        part = tuple(np.ascontiguousarray(b[:, lo : lo + tokens]) for b in bits)
        mask = held[:, lo : lo + tokens].copy()
        _, row = native_errors(part, sides, tolerance, mask, ours, lo)
        _, want = numpy_errors(part, sides, tolerance, mask, theirs, lo)
        assert_same(ours, theirs, row, want)


def test_worst_tokens_keep_the_earliest_on_ties() -> None:
    p = np.zeros((1, 8, 4))
    c = np.full((1, 8, 4), 0.5)
    c[0, 6, 1] = 1.0
    bits = (to_bits(p, "bfloat16"), to_bits(c, "bfloat16"))
    sides = (plain("bfloat16", 2), plain("bfloat16", 2))
    errors, _ = native_errors(tuple(b[:, :4].copy() for b in bits), sides, (0.0, 0.0))
    native_errors(tuple(b[:, 4:].copy() for b in bits), sides, (0.0, 0.0), None, errors, 4)
    assert list(errors.worst_position[0]) == [6, 0, 1, 2, 3]
    assert list(errors.worst_error[0]) == [1.0, 0.5, 0.5, 0.5, 0.5]


def test_bad_buffers_are_refused() -> None:
    bits = np.zeros((2, 3, 4), dtype=np.uint16)
    sides = (plain("bfloat16", 2), plain("bfloat16", 2))
    errors = LayerErrors(2)
    with pytest.raises(ValueError, match="holds"):
        add_raw_batch(
            NATIVE, errors, 0, (bits, bits[:1].copy()), np.ones((2, 3), bool), sides, Tolerance()
        )
    with pytest.raises(ValueError, match="cannot compare int8"):
        NATIVE.compare(
            bits, bits, np.ones(6, np.uint8), (2, 3, 4), ("int8", 2, 1.0, 1.0),
            ("bfloat16", 2, 1.0, 1.0), (0.0, 0.0), 0, errors.figures, errors.counts,
            errors.worst_error, errors.worst_position, np.empty(3),
        )  # fmt: skip


def test_layers_on_threads_at_once() -> None:
    """The GIL is released: several threads compare layers at once, each as alone."""
    rng = np.random.default_rng(7)
    shape = (8, 64, 256)
    layers = [
        (to_bits(rng.normal(0, 1, shape), "bfloat16"), to_bits(rng.normal(0, 1, shape), "bfloat16"))
        for _ in range(4)
    ]
    sides = (plain("bfloat16", 128), plain("bfloat16", 128))
    alone = [native_errors(bits, sides, (0.0, 0.01)) for bits in layers]
    together: list = [None] * 4

    def run(index: int) -> None:
        together[index] = native_errors(layers[index], sides, (0.0, 0.01))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (ours, row), (theirs, want) in zip(together, alone):
        np.testing.assert_array_equal(ours.figures, theirs.figures)
        np.testing.assert_array_equal(ours.counts, theirs.counts)
        np.testing.assert_array_equal(row, want)
