"""``diff --numeric``: element errors per request, layer and head against an independent
numpy computation, for every dtype, across TP sizes, layouts and block ids; fp8 against
its bf16 source; a head swap's stripe; the exit status and the JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import kvbuild as kb
from helpers.valued_sets import (
    ATTN,
    CONSUMER,
    HEAD_SIZE,
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

from kvaudit.cli import main
from kvaudit.core.elements import FP8_E4M3FN, FP8_E5M2
from kvaudit.core.errors import DescriptionError, KvauditError
from kvaudit.description import parse_description
from kvaudit.formats.heatmaps import layer_head_errors, layer_token_errors
from kvaudit.numeric.scheduling import numeric_diff
from kvaudit.sources import open_source


def run_numeric(producer: Path, consumer: Path, *args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(
        main,
        ["diff", str(producer), str(consumer), "--numeric", "--format", "json", "-q", *args],
        catch_exceptions=False,
    )
    return result.exit_code, json.loads(result.output) if result.output.startswith("{") else {}


def slices_of(data: dict, rid: str) -> dict[tuple[str, int], dict]:
    request = next(r for r in data["requests"] if r["request"] == rid)
    return {(s["layer"], s["head"]): s for s in request["groups"][0]["slices"]}


def test_fp8_tables_match_torch() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    for table, dtype in ((FP8_E4M3FN, torch.float8_e4m3fn), (FP8_E5M2, torch.float8_e5m2)):
        expected = codes.view(dtype).to(torch.float32).numpy()
        np.testing.assert_array_equal(table, expected)


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [
        ("bfloat16", 0.01),
        ("bfloat16", 0.0),  # rtol alone: the relative-error path of the tolerance
        ("float16", 0.01),
        ("float32", 0.01),
        ("float8_e4m3fn", 0.01),
        ("float8_e5m2", 0.01),
    ],
)
def test_errors_match_numpy_per_dtype(dtype: str, atol: float, tmp_path: Path) -> None:
    the_model = model(dtype)
    produced = draw(1, the_model)
    rng = np.random.default_rng(2)
    consumed = {
        rid: {name: v * (1 + rng.normal(0, 0.05, v.shape)) for name, v in layers.items()}
        for rid, layers in produced.items()
    }
    # The consumer decoded 5 tokens further: only the shared tokens are compared.
    consumed = {
        rid: {
            name: np.concatenate([v, rng.normal(0, 2, (5, *v.shape[1:]))]).astype(np.float32)
            for name, v in layers.items()
        }
        for rid, layers in consumed.items()
    }
    left = dump(tmp_path / "p", the_model, produced, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, consumed, CONSUMER, "consumer")
    rtol = 0.05
    status, data = run_numeric(left, right, "--atol", str(atol), "--rtol", str(rtol))
    failed = 0
    for rid, n in TOKENS.items():
        got = slices_of(data, rid)
        assert len(got) == 3 * HEADS
        for name in produced[rid]:
            p = cell_values(to_cells(produced[rid][name], dtype), dtype)
            c = cell_values(to_cells(consumed[rid][name][:n], dtype), dtype)
            for head in range(HEADS):
                want = errors_reference(p[:, head], c[:, head], atol, rtol)
                item = got[name, head]
                assert item["tokens"] == n and item["elements"] == n * 2 * HEAD_SIZE
                for key in ("max_abs_error", "max_rel_error", "rms_error"):
                    assert item[key] == pytest.approx(want[key], rel=1e-5), (name, head, key)
                assert item["over_tolerance"] == want["over_tolerance"]
                assert [w["position"] for w in item["worst_tokens"]] == want["worst"]
                assert item["max_abs_producer"] == pytest.approx(np.abs(p[:, head]).max())
                assert item["scaled_error"] == pytest.approx(
                    want["max_abs_error"] / np.abs(p[:, head]).max(), rel=1e-5
                )
                failed += item["over_tolerance"] > 0
            # The layers x tokens picture: per token, the worst head's max |c - p| / max |p|.
            group = next(r for r in data["requests"] if r["request"] == rid)["groups"][0]
            row = group["layer_token_scaled_error"][group["layers"].index(name)]
            scaled = (np.abs(c - p).max(axis=2) / np.abs(p).max(axis=2)).max(axis=1)
            assert group["token_bin"] == 1
            np.testing.assert_allclose(np.array(row, dtype=float), scaled, rtol=1e-5)
    assert data["failed_slices"] == failed
    assert status == (1 if failed else 0)


def test_identical_sides_pass_with_zero_tolerance(tmp_path: Path) -> None:
    the_model = model("bfloat16")
    values = draw(3, the_model)
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, values, CONSUMER, "consumer")
    status, data = run_numeric(left, right)
    assert status == 0 and data["ok"] and data["failed_slices"] == 0
    for rid in TOKENS:
        assert all(s["max_abs_error"] == 0 for s in slices_of(data, rid).values())


def test_head_swap_is_a_stripe(tmp_path: Path) -> None:
    the_model = model("bfloat16", layers=4)
    values = draw(4, the_model)
    swapped = {rid: dict(layers) for rid, layers in values.items()}
    for rid in swapped:
        layer = swapped[rid][ATTN.format(2)].copy()
        layer[:, [1, 2]] = layer[:, [2, 1]]
        swapped[rid][ATTN.format(2)] = layer
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, swapped, CONSUMER, "consumer")
    sources = [open_source([str(path)], None) for path in (left, right)]
    report = numeric_diff(sources[0].raw_kv(), sources[1].raw_kv(), TOKENS, atol=1e-3, rtol=1e-2)
    assert not report.ok
    group = report.requests["req-a"].groups[0]
    by_head = layer_head_errors(group)
    assert by_head.rows == [ATTN.format(i) for i in range(4)]
    stripe = by_head.values > 0
    expected = np.zeros((4, HEADS), dtype=bool)
    expected[2, [1, 2]] = True
    np.testing.assert_array_equal(stripe, expected)
    by_token = layer_token_errors(group)
    assert (by_token.values[2] > 0).all()
    assert (by_token.values[[0, 1, 3]] == 0).all()


def test_fp8_against_its_bf16_source(tmp_path: Path) -> None:
    bf16, fp8 = model("bfloat16"), model("float8_e4m3fn")
    values = draw(5, bf16)
    scale = 0.25
    # The fp8 cache holds values / scale; its description's scale brings them back.
    quantized = {
        rid: {name: v / scale for name, v in layers.items()} for rid, layers in values.items()
    }
    left = dump(tmp_path / "p", bf16, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", fp8, quantized, CONSUMER, "consumer", scale=scale)
    status, data = run_numeric(left, right, "--atol", "0.002", "--rtol", "0.07")
    assert status == 0, data["failed_slices"]
    # Not bitwise equal (fp8 rounds), but within e4m3's half step (2**-4) plus atol.
    assert all(s["max_abs_error"] > 0 for s in slices_of(data, "req-a").values())
    assert all(s["over_tolerance"] == 0 for s in slices_of(data, "req-b").values())
    # One corrupted element: layer 1, head 3, token 9, element 5 of the fp8 cache.
    corrupt = {rid: dict(layers) for rid, layers in quantized.items()}
    layer = corrupt["req-a"][ATTN.format(1)].copy()
    layer[9, 3, 5] = layer[9, 3, 5] + 40.0
    corrupt["req-a"][ATTN.format(1)] = layer
    broken = dump(tmp_path / "b", fp8, corrupt, CONSUMER, "consumer", scale=scale)
    status, data = run_numeric(left, broken, "--atol", "0.002", "--rtol", "0.07")
    assert status == 1 and data["failed_slices"] == 1
    item = slices_of(data, "req-a")[ATTN.format(1), 3]
    assert item["over_tolerance"] == 1
    assert item["worst_tokens"][0]["position"] == 9


def test_nan_on_one_side_only_fails(tmp_path: Path) -> None:
    the_model = model("float16")
    values = draw(6, the_model)
    both = {rid: {n: v.copy() for n, v in layers.items()} for rid, layers in values.items()}
    both["req-b"][ATTN.format(0)][3, 0, 0] = np.nan
    one = {rid: {n: v.copy() for n, v in layers.items()} for rid, layers in both.items()}
    one["req-a"][ATTN.format(2)][7, 1, 2] = np.inf
    left = dump(tmp_path / "p", the_model, both, PRODUCER, "producer")
    same = dump(tmp_path / "s", the_model, both, CONSUMER, "consumer")
    other = dump(tmp_path / "o", the_model, one, CONSUMER, "consumer")
    assert run_numeric(left, same, "--rtol", "1")[0] == 0
    status, data = run_numeric(left, other, "--rtol", "1")
    assert status == 1
    item = slices_of(data, "req-a")[ATTN.format(2), 1]
    assert item["nonfinite_mismatches"] == 1 and item["max_abs_error"] == "inf"
    assert item["worst_tokens"][0] == {"position": 7, "abs_error": "inf"}


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_nan_both_sides_hold_leaves_the_heads_scale(
    tmp_path: Path, native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NaN against NaN agrees; the head's largest |p| and scaled error are over its numbers.
    monkeypatch.setenv("KVAUDIT_NATIVE", native)
    the_model = model("float32")
    values = draw(5, the_model)
    producer = {rid: {n: v.copy() for n, v in layers.items()} for rid, layers in values.items()}
    layer = ATTN.format(1)
    producer["req-a"][layer][2, 0, 1] = np.nan
    consumer = {rid: {n: v.copy() for n, v in layers.items()} for rid, layers in producer.items()}
    consumer["req-a"][layer][5, 0, 3] += 0.25
    left = dump(tmp_path / "p", the_model, producer, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, consumer, CONSUMER, "consumer")
    status, data = run_numeric(left, right, "--atol", "1")
    assert status == 0
    item = slices_of(data, "req-a")[layer, 0]
    largest = float(np.nanmax(np.abs(producer["req-a"][layer][:, 0])))
    assert item["max_abs_producer"] == pytest.approx(largest)
    assert item["scaled_error"] == pytest.approx(item["max_abs_error"] / largest)
    assert item["max_abs_error"] == pytest.approx(0.25, rel=1e-6)


def test_opposite_infinities_fail(tmp_path: Path) -> None:
    """+Inf where the producer holds -Inf: an Inf on one side only, whatever the
    tolerance (docs/numeric.md), not an agreement of two infinities."""
    the_model = model("bfloat16")
    values = draw(6, the_model)
    producer = {rid: {n: v.copy() for n, v in layers.items()} for rid, layers in values.items()}
    producer["req-a"][ATTN.format(1)][4, 2, 3] = -np.inf
    consumer = {rid: {n: v.copy() for n, v in layers.items()} for rid, layers in producer.items()}
    consumer["req-a"][ATTN.format(1)][4, 2, 3] = np.inf
    left = dump(tmp_path / "p", the_model, producer, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, consumer, CONSUMER, "consumer")
    assert (
        run_numeric(left, dump(tmp_path / "s", the_model, producer, CONSUMER, "consumer"))[0] == 0
    )
    status, data = run_numeric(left, right, "--rtol", "1")
    assert status == 1
    item = slices_of(data, "req-a")[ATTN.format(1), 2]
    assert item["nonfinite_mismatches"] == 1 and item["over_tolerance"] == 1
    assert item["worst_tokens"][0] == {"position": 4, "abs_error": "inf"}


def test_numeric_needs_raw_kv_on_both_sides(tmp_path: Path) -> None:
    the_model = model("bfloat16")
    values = draw(7, the_model)
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    record = tmp_path / "record.json"
    runner = CliRunner()
    runner.invoke(main, ["checksum", str(left), "--format", "json", "-o", str(record), "-q"])
    result = runner.invoke(main, ["diff", str(record), str(left), "--numeric", "-q"])
    assert result.exit_code == 2
    assert "--numeric needs the raw KV on both sides" in result.output
    result = runner.invoke(main, ["diff", str(left), str(left), "--atol", "1", "-q"])
    assert result.exit_code == 2 and "--atol and --rtol go with --numeric" in result.output
    result = runner.invoke(main, ["diff", str(left), str(left), "--numeric", "--no-locate"])
    assert result.exit_code == 2 and "--locate and --no-locate go without" in result.output
    result = runner.invoke(
        main, ["diff", str(left), str(left), "--numeric", "--junit", str(tmp_path / "j.xml")]
    )
    assert result.exit_code == 2 and not (tmp_path / "j.xml").exists()


def test_json_file_beside_the_table(tmp_path: Path) -> None:
    the_model = model("bfloat16")
    values = draw(8, the_model)
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, values, CONSUMER, "consumer")
    saved = tmp_path / "numeric.json"
    result = CliRunner().invoke(
        main, ["diff", str(left), str(right), "--numeric", "--json", str(saved), "-q"]
    )
    assert result.exit_code == 0 and "OK: every element within" in result.output
    assert run_numeric(left, right)[1] == json.loads(saved.read_text(encoding="utf-8"))


def test_scale_in_the_description() -> None:
    spec = {
        "type": "full_attention",
        "block_size": 4,
        "num_kv_heads": 1,
        "head_size": 8,
        "dtype": "fp8_e4m3",
        "layout": "NTHC",
    }
    layers = [ATTN.format(0), {"name": ATTN.format(1), "spec": {"v_scale": 0.5}}]
    raw = {
        "kvaudit": 1,
        "num_blocks": 2,
        "groups": [{"spec": {**spec, "scale": 2}, "layers": layers}],
    }
    parsed = parse_description(raw, "cache.yaml")
    specs = [entry.spec for entry in parsed.groups[0].layers]
    assert [(s.k_scale, s.v_scale) for s in specs] == [(2.0, 2.0), (2.0, 0.5)]
    for bad in (0, -1.5, "x", True, float("inf")):
        raw["groups"][0]["spec"]["scale"] = bad
        with pytest.raises(DescriptionError, match=r"cache.yaml: groups\[0\].spec.scale"):
            parse_description(raw, "cache.yaml")


def test_what_a_diff_must_never_pass_fails_by_value_too(tmp_path: Path) -> None:
    # docs/cli.md, "What a diff must never pass": tokens the consumer lacks, a consumer
    # copy of replicated heads that differs, a worker missing, nothing compared.
    the_model = model("bfloat16")
    values = draw(11, the_model)
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    short = {rid: {n: v[:20] for n, v in layers.items()} for rid, layers in values.items()}
    status, data = run_numeric(
        left, dump(tmp_path / "short", the_model, short, CONSUMER, "consumer")
    )
    assert status == 1 and not data["ok"] and data["failed_slices"] == 0
    assert data["missing"] == [
        {
            "request": "req-a",
            "group": None,
            "what": "tokens 20..36: the consumer holds 20 of the producer's 37 tokens",
        }
    ]
    assert run_numeric(left, tmp_path / "short", "--allow-missing")[0] == 0

    # TP 8 over 4 heads: every head on two ranks; copy 1 of head 0 (rank 1) zeroed.
    replicated = kb.Engine(tp_size=8, block_sizes={0: 4}, layouts={0: "KNTHD"}, seed=5)
    copies = dump(tmp_path / "copies", the_model, values, replicated, "consumer")
    assert run_numeric(left, copies)[0] == 0
    broken = tmp_path / "broken"
    shutil.copytree(copies, broken)
    result = CliRunner().invoke(
        main,
        [
            "corrupt",
            str(copies / "tp1.safetensors"),
            "-o",
            str(broken / "tp1.safetensors"),
            "--request",
            "req-b",
            "--group",
            "0",
            "--position",
            "2",
            "--mode",
            "zero",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    status, data = run_numeric(left, broken)
    assert status == 1 and data["failed_slices"] == 0
    # Positions in the coarser block size of the two sides (16 tokens): tokens 8..11.
    assert data["copies_differing"] == [
        {"request": "req-b", "group": 0, "copies": [{"position": 0, "replicas": 2, "replica": 1}]}
    ]
    (broken / "tp1.safetensors").unlink()
    status, data = run_numeric(left, broken)
    assert status == 1 and data["failed_slices"] == 0
    assert data["incomplete"] == [
        "the consumer set lacks workers pp 0 tp 1: its values are compared in part"
    ]

    status, data = run_numeric(
        dump(tmp_path / "none-p", the_model, {}, PRODUCER, "producer"),
        dump(tmp_path / "none-c", the_model, {}, CONSUMER, "consumer"),
    )
    assert status == 1 and data["empty"] == "the two sides have no request in common"
    assert run_numeric(tmp_path / "none-p", tmp_path / "none-c", "--allow-empty")[0] == 0


def test_numeric_warns_of_swapped_roles(tmp_path: Path) -> None:
    the_model = model("bfloat16")
    values = draw(12, the_model)
    left = dump(tmp_path / "p", the_model, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", the_model, values, CONSUMER, "consumer")
    result = CliRunner().invoke(main, ["diff", str(right), str(left), "--numeric", "-q"])
    assert result.exit_code == 0
    assert "kvaudit: warning: the roles look swapped" in result.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_tolerances_must_be_finite(tmp_path: Path, value: str) -> None:
    the_model = model("bfloat16")
    left = dump(tmp_path / "p", the_model, draw(13, the_model), PRODUCER, "producer")
    result = CliRunner().invoke(main, ["diff", str(left), str(left), "--numeric", "--atol", value])
    assert result.exit_code == 2 and "Traceback" not in result.output
    with pytest.raises(KvauditError, match="rtol: expected a finite number"):
        numeric_diff([], [], {}, rtol=float(value))


def test_a_group_with_a_layer_not_compared_is_failed(tmp_path: Path) -> None:
    wide, narrow = model("bfloat16", layers=3), model("bfloat16", layers=2)
    values = draw(14, wide)
    fewer = {
        rid: {n: v for n, v in layers.items() if n != ATTN.format(2)}
        for rid, layers in values.items()
    }
    left = dump(tmp_path / "p", wide, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", narrow, fewer, CONSUMER, "consumer")
    status, data = run_numeric(left, right)
    assert status == 1 and data["failed_slices"] == 0
    group = data["requests"][0]["groups"][0]
    assert group["failed"] is True
    assert {item["reason"] for item in data["not_compared"]} == {
        f"layer {ATTN.format(2)} is not on the consumer"
    }
