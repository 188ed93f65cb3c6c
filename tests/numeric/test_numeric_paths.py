"""``diff --numeric``'s shortcuts give the same errors as the independent numpy
computation: sides equal bit for bit (the errors skipped), a single differing element,
NaN and Inf on both sides beside a difference, many small batches, tokens one side lacks,
dumps' rows read in place, from their files, through their mappings or as torch
tensors, a file that shrinks while read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.valued_sets import (
    ATTN,
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
import kvaudit.numeric.reads
import kvaudit.numeric.value_errors
from kvaudit.core.errors import KvauditError
from kvaudit.numeric.budget import NumericBudget
from kvaudit.numeric.model import NumericReport, SliceErrors
from kvaudit.numeric.scheduling import numeric_diff
from kvaudit.numeric.value_errors import counts
from kvaudit.sources import open_source


def compare(left: Path, right: Path, **options: Any) -> NumericReport:
    sources = [open_source([str(path)], None) for path in (left, right)]
    return numeric_diff(sources[0].raw_kv(), sources[1].raw_kv(), TOKENS, **options)


def by_slice(report: NumericReport, rid: str) -> dict[tuple[str, int], SliceErrors]:
    return {(s.layer, s.head): s for s in report.requests[rid].groups[0].slices}


def assert_matches_reference(
    report: NumericReport, produced: dict, consumed: dict, dtype: str, atol: float, rtol: float
) -> None:
    """Every (layer, head) of every request against the float64 reference."""
    for rid, n in TOKENS.items():
        got = by_slice(report, rid)
        for name in produced[rid]:
            p = cell_values(to_cells(produced[rid][name], dtype), dtype)
            c = cell_values(to_cells(consumed[rid][name][:n], dtype), dtype)
            for head in range(HEADS):
                want = errors_reference(p[:, head], c[:, head], atol, rtol)
                item = got[name, head]
                assert item.max_abs_error == pytest.approx(want["max_abs_error"], rel=1e-6)
                assert item.max_rel_error == pytest.approx(want["max_rel_error"], rel=1e-6)
                assert item.rms_error == pytest.approx(want["rms_error"], rel=1e-6)
                assert item.over_tolerance == want["over_tolerance"]
                assert [position for position, _ in item.worst] == want["worst"]
                assert item.max_producer == np.abs(p[:, head]).max()
                assert item.nonfinite_mismatches == 0


def test_equal_sides_and_one_differing_element(tmp_path: Path) -> None:
    the_model = model("bfloat16")
    produced = draw(11, the_model)
    consumed = {rid: {n: v.copy() for n, v in layers.items()} for rid, layers in produced.items()}
    consumed["req-a"][ATTN.format(1)][30, 2, 3] += 0.5
    left = dump(tmp_path / "p", the_model, produced, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, consumed, CONSUMER, "consumer")
    # One batch, and batches of the least tokens (every slice spans several).
    for batch_bytes in (8 << 20, 1):
        report = compare(left, right, rtol=1e-3, budget=NumericBudget(batch_bytes=batch_bytes))
        assert_matches_reference(report, produced, consumed, "bfloat16", 0.0, 1e-3)
        assert report.failed_slices == 1
        item = by_slice(report, "req-a")[ATTN.format(1), 2]
        assert item.over_tolerance == 1 and item.worst[0][0] == 30 and len(item.worst) == 1
        same = by_slice(report, "req-b")[ATTN.format(1), 2]
        assert (same.max_abs_error, same.rms_error, same.worst) == (0.0, 0.0, [])
    identical = compare(left, dump(tmp_path / "s", the_model, produced, CONSUMER, "consumer"))
    assert identical.ok
    assert_matches_reference(identical, produced, produced, "bfloat16", 0.0, 0.0)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float8_e4m3fn"])
def test_many_small_batches_match_one(dtype: str, tmp_path: Path) -> None:
    the_model = model(dtype)
    produced = draw(12, the_model)
    rng = np.random.default_rng(5)
    consumed = {
        rid: {n: v * (1 + rng.normal(0, 0.02, v.shape)) for n, v in layers.items()}
        for rid, layers in produced.items()
    }
    left = dump(tmp_path / "p", the_model, produced, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, consumed, CONSUMER, "consumer")
    whole, small = (
        compare(left, right, atol=1e-3, rtol=0.01, budget=NumericBudget(batch_bytes=b))
        for b in (8 << 20, 1)
    )
    assert_matches_reference(small, produced, consumed, dtype, 1e-3, 0.01)
    for rid in TOKENS:
        for key, item in by_slice(whole, rid).items():
            other = by_slice(small, rid)[key]
            assert other.rms_error == pytest.approx(item.rms_error, rel=1e-12)
            other.sum_squares = item.sum_squares
            assert other == item
        np.testing.assert_array_equal(
            whole.requests[rid].groups[0].layer_tokens, small.requests[rid].groups[0].layer_tokens
        )


def test_one_head_at_a_time_in_small_pieces_agrees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    the_model = model("float16")
    produced = draw(17, the_model)
    rng = np.random.default_rng(8)
    consumed = {
        rid: {n: v * (1 + rng.normal(0, 0.01, v.shape)) for n, v in layers.items()}
        for rid, layers in produced.items()
    }
    consumed["req-a"][ATTN.format(1)][6, 2, 4] = np.nan  # on one side: the exact way
    left = dump(tmp_path / "p", the_model, produced, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, consumed, CONSUMER, "consumer")
    whole = compare(left, right, rtol=0.01)
    tiny = NumericBudget(
        chunk_elements=1, piece_elements=1, native_piece_elements=1, mapped_piece_elements=1
    )
    chunked = compare(left, right, rtol=0.01, budget=tiny)
    assert by_slice(chunked, "req-a")[ATTN.format(1), 2].nonfinite_mismatches == 1
    for rid in TOKENS:
        for key, item in by_slice(whole, rid).items():
            other = by_slice(chunked, rid)[key]
            assert other.rms_error == pytest.approx(item.rms_error, rel=1e-12)
            other.sum_squares = item.sum_squares
            assert other == item
        np.testing.assert_array_equal(
            whole.requests[rid].groups[0].layer_tokens,
            chunked.requests[rid].groups[0].layer_tokens,
        )


def test_nan_and_inf_on_both_sides_beside_a_difference(tmp_path: Path) -> None:
    the_model = model("float16")
    produced = draw(13, the_model)
    layer = produced["req-a"][ATTN.format(0)]
    layer[3, 0, 0], layer[4, 0, 1], layer[5, 0, 2] = np.nan, np.inf, -np.inf
    consumed = {rid: {n: v.copy() for n, v in layers.items()} for rid, layers in produced.items()}
    consumed["req-a"][ATTN.format(0)][10, 0, 2] += 1.0
    left = dump(tmp_path / "p", the_model, produced, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, consumed, CONSUMER, "consumer")
    report = compare(left, right, rtol=0.01)
    item = by_slice(report, "req-a")[ATTN.format(0), 0]
    p = cell_values(to_cells(produced["req-a"][ATTN.format(0)], "float16"), "float16")
    c = cell_values(to_cells(consumed["req-a"][ATTN.format(0)], "float16"), "float16")
    assert item.nonfinite_mismatches == 0 and item.over_tolerance == 1
    assert item.max_abs_error == abs(c[10, 0, 2] - p[10, 0, 2])
    assert [position for position, _ in item.worst] == [10]
    assert report.failed_slices == 1


def test_tokens_one_side_lacks_are_left_out(tmp_path: Path) -> None:
    the_model = model("bfloat16")
    produced = draw(16, the_model)
    rng = np.random.default_rng(7)
    consumed = {
        rid: {n: v + rng.normal(0, 0.1, v.shape) for n, v in layers.items()}
        for rid, layers in produced.items()
    }
    left = dump(tmp_path / "p", the_model, produced, PRODUCER, "producer")
    # The consumer lists req-a's blocks from position 2 on (block size 4: tokens 8 on).
    first = 8
    right = dump(
        tmp_path / "c", the_model, consumed, CONSUMER, "consumer", positions={"req-a": {0: (2, 8)}}
    )
    report = compare(left, right, rtol=0.05)
    n = TOKENS["req-a"]
    got = by_slice(report, "req-a")
    for name in produced["req-a"]:
        p = cell_values(to_cells(produced["req-a"][name][first:n], "bfloat16"), "bfloat16")
        c = cell_values(to_cells(consumed["req-a"][name][first:n], "bfloat16"), "bfloat16")
        for head in range(HEADS):
            want = errors_reference(p[:, head], c[:, head], 0.0, 0.05)
            item = got[name, head]
            assert item.tokens == n - first
            assert item.max_abs_error == pytest.approx(want["max_abs_error"], rel=1e-6)
            assert item.rms_error == pytest.approx(want["rms_error"], rel=1e-6)
            assert item.over_tolerance == want["over_tolerance"]
            assert [position - first for position, _ in item.worst] == want["worst"]
            assert item.max_producer == np.abs(p[:, head]).max()
    row = report.requests["req-a"].groups[0].layer_tokens[0]
    assert np.isnan(row[:first]).all() and not np.isnan(row[first:n]).any()


def test_rows_read_from_files_mappings_or_tensors_agree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    the_model = model("bfloat16")
    produced = draw(14, the_model)
    rng = np.random.default_rng(6)
    consumed = {
        rid: {n: v + rng.normal(0, 0.1, v.shape) for n, v in layers.items()}
        for rid, layers in produced.items()
    }
    left = dump(tmp_path / "p", the_model, produced, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, consumed, CONSUMER, "consumer")
    in_place = compare(left, right, rtol=0.05)
    # Staged: rows read with pread (the C extension's, else numpy's), or from the mappings.
    monkeypatch.setattr(kvaudit.numeric.mapped_rows.MappedRows, "add", lambda *_: None)
    from_files = compare(left, right, rtol=0.05)
    # Torch tensors over the same mappings (as live workers hold them): rows gathered.
    raw = [open_source([str(path)], None).raw_kv() for path in (left, right)]
    for worker in raw[0] + raw[1]:
        worker.__dict__["array_views"] = worker.group_views
    gathered = numeric_diff(raw[0], raw[1], TOKENS, rtol=0.05)
    monkeypatch.setattr(kvaudit.numeric.reads.RowFiles, "layout", lambda *_: None)
    mapped = compare(left, right, rtol=0.05)
    assert not from_files.ok
    for other in (mapped, gathered, in_place):
        for rid in TOKENS:
            ours, theirs = from_files.requests[rid].groups[0], other.requests[rid].groups[0]
            assert ours.slices == theirs.slices
            np.testing.assert_array_equal(ours.layer_tokens, theirs.layer_tokens)
    assert_matches_reference(mapped, produced, consumed, "bfloat16", 0.0, 0.05)


def test_a_file_that_shrinks_while_read_is_an_error(tmp_path: Path) -> None:
    the_model = model("bfloat16")
    values = draw(15, the_model)
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, values, CONSUMER, "consumer")
    sources = [open_source([str(path)], None) for path in (left, right)]
    raw = [source.raw_kv() for source in sources]
    victim = right / "tp0.safetensors"
    os.truncate(victim, os.path.getsize(victim) // 2)
    with pytest.raises(KvauditError, match="changed while reading") as caught:
        numeric_diff(raw[0], raw[1], TOKENS)
    assert str(victim) in str(caught.value)


@pytest.mark.parametrize(
    "shape",
    # (1, 2, 4), (3, 2, 4): each head's flags are whole words, its last axis is not
    [(4, 8, 16), (3, 5, 7), (1, 1, 1), (2, 3, 8), (1, 2, 4), (3, 2, 4)],
)
def test_flag_counts_per_head(shape: tuple[int, ...]) -> None:
    flags = np.random.default_rng(sum(shape)).random(shape) > 0.3
    np.testing.assert_array_equal(counts(flags), flags.reshape(shape[0], -1).sum(axis=1))
