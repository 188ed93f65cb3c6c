"""``diff --numeric`` reading both sides' dumps in place (``kvaudit.numeric.mapped_rows`` and the C
extension's ``compare_mapped``): the same report, bit for bit, as rows read with
``pread`` and staged, and the same as the numpy path (but the sums of squares' last
digits) and the independent reference, over dumps of several layouts (NHTC with kernel
blocks, HNTC, K and V planes, K and V apart), TP sizes, block sizes and block ids on the
two sides, requests ending inside a block, fp8 with scales against bf16, pieces and
chunks of any size. Skipped where the extension did not build, unless
``KVAUDIT_REQUIRE_NATIVE=1``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import kvbuild as kb
from helpers.native_builds import built, skip_unless_built
from helpers.valued_sets import (
    CONSUMER,
    HEADS,
    PRODUCER,
    TOKENS,
    cell_values,
    draw,
    dump,
    errors_reference,
    model,
    to_cells,
)

import kvaudit.numeric.layers
import kvaudit.numeric.mapped_rows
import kvaudit.numeric.scheduling
from kvaudit.numeric.budget import DEFAULT_BUDGET, NumericBudget
from kvaudit.numeric.model import NumericReport
from kvaudit.numeric.scheduling import numeric_diff
from kvaudit.sources import open_source

NAME = "kvaudit._native._element_errors"
pytestmark = skip_unless_built(built(NAME), NAME, "diff --numeric reads rows in numpy")

ENGINES = {
    "NHTC kernel blocks, TP 2 / KNTHD, TP 4": (PRODUCER, CONSUMER),
    "HNTC, TP 1 / NTHD (K and V apart), TP 2": (
        kb.Engine(tp_size=1, block_sizes={0: 8}, layouts={0: "HNTC"}, seed=5),
        kb.Engine(tp_size=2, block_sizes={0: 16}, layouts={0: "NTHD"}, seed=6),
    ),
    "NKTHD, TP 4 / NTHC kernel blocks, TP 1": (
        kb.Engine(tp_size=4, block_sizes={0: 4}, layouts={0: "NKTHD"}, seed=7),
        kb.Engine(
            tp_size=1, block_sizes={0: 32}, kernel_block_sizes={0: 16}, layouts={0: "NTHC"}, seed=8
        ),
    ),
    "KNHTD, TP 2 / HNTD (K and V apart), TP 4": (
        kb.Engine(tp_size=2, block_sizes={0: 12}, layouts={0: "KNHTD"}, seed=9),
        kb.Engine(tp_size=4, block_sizes={0: 8}, layouts={0: "HNTD"}, seed=10),
    ),
}


def compare(
    left: Path, right: Path, rtol: float, budget: NumericBudget = DEFAULT_BUDGET
) -> NumericReport:
    sources = [open_source([str(path)], None) for path in (left, right)]
    return numeric_diff(sources[0].raw_kv(), sources[1].raw_kv(), TOKENS, rtol=rtol, budget=budget)


def three_ways(
    left: Path, right: Path, monkeypatch: pytest.MonkeyPatch, rtol: float
) -> tuple[NumericReport, NumericReport, NumericReport]:
    """The report with rows read in place (checked to be the only path taken, the short
    requests compared together: a call per layer), read with pread and staged, and by
    the numpy path."""
    calls = []
    in_place = kvaudit.numeric.mapped_rows.add_mapped_batch

    def counted(*args: object, **kwargs: object) -> np.ndarray:
        calls.append(kwargs.get("by_head", False))
        return in_place(*args, **kwargs)  # type: ignore[arg-type]

    def staged_read(*_: object) -> int:
        raise AssertionError("a row was staged")

    with monkeypatch.context() as patch:
        patch.setattr(kvaudit.numeric.mapped_rows, "add_mapped_batch", counted)
        patch.setattr(kvaudit.numeric.layers, "decode_layer", staged_read)
        mapped = compare(left, right, rtol)
    assert calls, "the rows were not read in place"
    assert calls == [True] * len(calls), "the requests were compared one by one"
    with monkeypatch.context() as patch:
        patch.setattr(kvaudit.numeric.mapped_rows.MappedRows, "add", lambda *_: None)
        staged = compare(left, right, rtol)
    with monkeypatch.context() as patch:
        patch.setenv("KVAUDIT_NATIVE", "0")
        numpy = compare(left, right, rtol)
    return mapped, staged, numpy


def assert_same(ours: NumericReport, theirs: NumericReport, *, exact: bool) -> None:
    """Every slice and token bin the same; ``exact``: the sums of squares too (else to
    float32's precision, as the numpy path sums them)."""
    for rid in TOKENS:
        mine, other = ours.requests[rid].groups[0], theirs.requests[rid].groups[0]
        np.testing.assert_array_equal(mine.layer_tokens, other.layer_tokens)
        np.testing.assert_array_equal(mine.layer_token_ratios, other.layer_token_ratios)
        assert len(mine.slices) == len(other.slices) == 3 * HEADS
        for item, that in zip(mine.slices, other.slices):
            if not exact:
                assert item.rms_error == pytest.approx(that.rms_error, rel=1e-6)
                that.sum_squares = item.sum_squares
            assert item == that


def assert_reference(
    report: NumericReport, produced: dict, consumed: dict, dtypes: tuple[str, str], scale: float
) -> None:
    """Every (layer, head) against the float64 reference (the consumer's values times
    ``scale``)."""
    for rid, n in TOKENS.items():
        got = {(s.layer, s.head): s for s in report.requests[rid].groups[0].slices}
        for name in produced[rid]:
            p = cell_values(to_cells(produced[rid][name], dtypes[0]), dtypes[0])
            c = cell_values(to_cells(consumed[rid][name][:n], dtypes[1]), dtypes[1]) * scale
            for head in range(HEADS):
                want = errors_reference(p[:, head], c[:, head], 0.0, 0.05)
                item = got[name, head]
                assert item.max_abs_error == pytest.approx(want["max_abs_error"], rel=1e-6)
                assert item.rms_error == pytest.approx(want["rms_error"], rel=1e-6)
                assert item.over_tolerance == want["over_tolerance"]
                assert [position for position, _ in item.worst] == want["worst"]


@pytest.mark.parametrize("engines", list(ENGINES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_in_place_equals_staged_and_numpy(
    engines: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, consumer = ENGINES[engines]
    the_model = model(dtype)
    produced = draw(21, the_model)
    rng = np.random.default_rng(22)
    consumed = {
        rid: {n: v * (1 + rng.normal(0, 0.02, v.shape)) for n, v in layers.items()}
        for rid, layers in produced.items()
    }
    left = dump(tmp_path / "p", the_model, produced, producer, "producer")
    right = dump(tmp_path / "c", the_model, consumed, consumer, "consumer")
    mapped, staged, numpy = three_ways(left, right, monkeypatch, 0.05)
    assert_same(mapped, staged, exact=True)
    assert_same(mapped, numpy, exact=False)
    assert_reference(mapped, produced, consumed, (dtype, dtype), 1.0)


def test_fp8_with_scales_against_bf16_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    produced = draw(23, model("bfloat16"))
    consumed = {rid: {n: v / 0.5 for n, v in layers.items()} for rid, layers in produced.items()}
    consumed["req-a"]["model.layers.1.self_attn.attn"][9, 1, 3] += 40.0  # one corrupted element
    left = dump(tmp_path / "p", model("bfloat16"), produced, PRODUCER, "producer")
    right = dump(tmp_path / "c", model("float8_e4m3fn"), consumed, CONSUMER, "consumer", 0.5)
    mapped, staged, numpy = three_ways(left, right, monkeypatch, 0.05)
    assert_same(mapped, staged, exact=True)
    assert_same(mapped, numpy, exact=False)
    assert_reference(mapped, produced, consumed, ("bfloat16", "float8_e4m3fn"), 0.5)
    slices = {(s.layer, s.head): s for s in mapped.requests["req-a"].groups[0].slices}
    assert slices["model.layers.1.self_attn.attn", 1].worst[0][0] == 9


def test_pieces_and_chunks_of_any_size_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    the_model = model("float16")
    produced = draw(24, the_model)
    rng = np.random.default_rng(25)
    consumed = {
        rid: {n: v + rng.normal(0, 0.05, v.shape) for n, v in layers.items()}
        for rid, layers in produced.items()
    }
    consumed["req-b"]["model.layers.2.self_attn.attn"][3, 0, 1] = np.inf  # one side only
    producer, consumer = ENGINES["HNTC, TP 1 / NTHD (K and V apart), TP 2"]
    left = dump(tmp_path / "p", the_model, produced, producer, "producer")
    right = dump(tmp_path / "c", the_model, consumed, consumer, "consumer")
    whole = compare(left, right, 0.05)
    # Mapped pages released after each chunk of one token.
    tiny = NumericBudget(mapped_piece_elements=1, chunk_tokens=1, mapped_bytes=1)
    small = compare(left, right, 0.05, budget=tiny)
    assert whole.requests["req-b"].groups[0].slices[8].nonfinite_mismatches == 1
    for rid in TOKENS:
        for item, that in zip(
            whole.requests[rid].groups[0].slices, small.requests[rid].groups[0].slices
        ):
            # Pieces add their sums of squares in another order.
            assert item.rms_error == pytest.approx(that.rms_error, rel=1e-12)
            that.sum_squares = item.sum_squares
            assert item == that


MANY = {f"req-{i:02}": n for i, n in enumerate([10, 12, 9, 20, 15, 8, 11, 70, 5, 6])}
"""Requests that a piece of 72 tokens stacks as 3, 3, 1, 1 and 2: stacks left running while
the next one is gathered, and requests alone between them."""


@pytest.mark.parametrize("tokens", ["two", "many, small pieces"])
def test_requests_compared_together_or_one_by_one_agree(
    tokens: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short requests compared together (a call per layer) give the very report that
    comparing them one by one gives: every figure, token bin and note in order."""
    counts = TOKENS if tokens == "two" else MANY
    budget = DEFAULT_BUDGET
    if tokens != "two":
        budget = NumericBudget(mapped_piece_elements=72 * HEADS * 16)
    the_model = model("bfloat16")
    produced = draw(26, the_model, counts)
    rng = np.random.default_rng(27)
    consumed = {
        rid: {n: v + rng.normal(0, 0.05, v.shape) for n, v in layers.items()}
        for rid, layers in produced.items()
    }
    producer, consumer = ENGINES["KNHTD, TP 2 / HNTD (K and V apart), TP 4"]
    left = dump(tmp_path / "p", the_model, produced, producer, "producer")
    right = dump(tmp_path / "c", the_model, consumed, consumer, "consumer")
    sources = [open_source([str(path)], None) for path in (left, right)]
    calls: list[int] = []
    in_place = kvaudit.numeric.mapped_rows.add_mapped_batch

    def counted(*args: object, **kwargs: object) -> np.ndarray:
        calls.append(args[5].shape[0])  # type: ignore[attr-defined]
        return in_place(*args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as patch:
        patch.setattr(kvaudit.numeric.mapped_rows, "add_mapped_batch", counted)
        together = numeric_diff(
            sources[0].raw_kv(), sources[1].raw_kv(), counts, rtol=0.05, budget=budget
        )
    stacks = [3, 3, 1, 1, 2] if tokens != "two" else [2]
    assert calls == [HEADS * size for size in stacks for _ in range(3)]  # 3 layers
    monkeypatch.setattr(kvaudit.numeric.scheduling._GroupPlan, "stackable", lambda *_: False)
    alone = numeric_diff(sources[0].raw_kv(), sources[1].raw_kv(), counts, rtol=0.05, budget=budget)
    assert together.not_compared == alone.not_compared
    assert list(together.requests) == list(alone.requests) == sorted(counts)
    for rid in counts:
        mine, other = together.requests[rid].groups[0], alone.requests[rid].groups[0]
        np.testing.assert_array_equal(mine.layer_tokens, other.layer_tokens)
        np.testing.assert_array_equal(mine.layer_token_ratios, other.layer_token_ratios)
        assert mine.slices == other.slices
