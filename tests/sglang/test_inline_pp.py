"""kvaudit's inline verification of a transfer from a PP=2 prefill (docs/sglang.md, "PP"),
through SGLang's real classes and methods as in test_inline.py (its docstring lists what
stands in): two prefill processes, one PP stage each (one layer each, TP=1), each sending
its own checksum row, as SGLang's transfer backends send one from every stage.

A decode with PP=1 receives both stages' rows into one slot and keeps the last to arrive:
kvaudit verifies that stage's layers and counts the request as partial (never as
verified); its output folder still holds the decode's checksums of every layer, which
``kvaudit diff`` compares with the prefill's. A decode whose TP ranks kept different
stages' rows checks both and verifies the whole request; a decode with the prefill's PP
stages verifies each stage. SGLang's own check admits every one of these PP=1 transfers
unverified (another layout signature).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.sglang_expected import expected_moments
from pd_world import (
    CHANGED,
    LAYERS,
    REQUESTS,
    Decode,
    decode_process,
    row_words,
    run_prefill,
    stage_layers,
)

from kvaudit.cli import main
from kvaudit.core.scheme import STRONG_PRIME
from kvaudit.integrations.sglang import carried, inline


@pytest.fixture(scope="module")
def prefill_pp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Both stages' results (stage 0 first) and the prefill's output folder."""
    out = tmp_path_factory.mktemp("prefill_pp")
    folder = out / "kvaudit"
    return folder, run_prefill(out, tp_size=1, pp_size=2, output=str(folder))


@pytest.fixture
def decode_context(tp1_decode, monkeypatch, tmp_path):
    """The decode's published context (TP=1, PP=1) and its output folder."""
    monkeypatch.setenv("KVAUDIT_SGLANG_OUTPUT", str(tmp_path / "decode"))
    monkeypatch.setenv("KVAUDIT_SGLANG_MAX_DUMP_BYTES", str(10**8))
    return tp1_decode, monkeypatch, tmp_path / "decode"


def test_each_stage_carries_its_own_layers(prefill_pp) -> None:
    _, stages = prefill_pp
    for rid in ("req-ok", "req-bad", "req-prefix"):
        first = REQUESTS[rid][1]
        for pp_rank, stage in enumerate(stages):
            words = row_words(stages, rid, pp_rank)
            span = stage_layers(pp_rank, 2)
            assert words[carried.SLOT_MARKER] >> 48 == carried.STRONG_TAG
            assert moments(words) == expected_moments(rid, first, span)
            assert carried.split_layer_word(words[carried.SLOT_LAYERS])[0] == span
            assert stage["stats"]["written"] == 3 and stage["stats"]["not_written"] == 0
        # the two stages' moments add up (modulo the strong lane's prime) to the request's
        stage_moments = [moments(row_words(stages, rid, s)) for s in range(2)]
        total = tuple(sum(m) % STRONG_PRIME for m in zip(*stage_moments, strict=True))
        assert total == expected_moments(rid, first)


def moments(words: list[int]) -> tuple[int, ...]:
    """The strong lane's moments a version 3 row carries."""
    return tuple(words[carried.SLOT_SUMS : carried.SLOT_SUMS + 3])


def test_decode_pp1_verifies_the_stage_that_arrived_last(prefill_pp, decode_context) -> None:
    group, monkeypatch, folder = decode_context
    prefill_folder, stages = prefill_pp
    decode = Decode(group, monkeypatch.setattr)
    assert decode.queue._kv_checksum_comparable(stages[0]["signature"]) is False  # SGLang's
    ok = decode.receive("req-ok", stages, index=2)  # stage 1's row lands last
    bad = decode.receive("req-bad", stages, index=4)
    assert decode.verify([ok, bad]) == [ok]  # the change is in layer 1, stage 1's
    stats = inline.inline_stats()
    assert (stats["verified"], stats["partial"], stats["mismatched"]) == (0, 1, 1)
    (reason,) = stats["reasons"]
    assert reason.startswith("verified on layers 1..1 of 0..1 only")
    assert decode.aborts == ["req-bad"] and decode.failed == [1]
    # Located from the two stages' rotating dumps and the decode's dump of the failure.
    rid, layer, head, token = CHANGED
    result = CliRunner().invoke(
        main,
        ["diff", str(prefill_folder / "dumps" / rid), str(folder / "dumps" / rid), "--format",
         "json"],
    )  # fmt: skip
    assert result.exit_code == 1
    (entry,) = json.loads(result.stdout)["requests"][rid]["groups"]["0"]["located"]
    assert (entry["layer"], entry["head"], entry["tokens"]) == (
        f"model.layers.{layer}.self_attn.attn",
        head,
        [token],
    )


def test_a_fault_in_the_overwritten_stage_is_caught_by_the_output_folders(
    prefill_pp, decode_context
) -> None:
    group, monkeypatch, folder = decode_context
    prefill_folder, stages = prefill_pp
    decode = Decode(group, monkeypatch.setattr)
    bad = decode.receive("req-bad", stages[::-1], index=4)  # stage 0's row lands last
    assert decode.verify([bad]) == [bad]  # layer 0 agrees; layer 1 is not carried
    stats = inline.inline_stats()
    assert (stats["verified"], stats["partial"], stats["mismatched"]) == (0, 1, 0)
    result = CliRunner().invoke(
        main,
        ["diff", str(prefill_folder), str(folder), "--request", "req-bad", "--format", "json"],
    )
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["requests"]["req-bad"]["groups"]["0"]["mismatched_positions"] == [
        CHANGED[3] // 16
    ]


def test_decode_with_the_prefills_stages_verifies_each(prefill_pp, decode_context) -> None:
    # Equal layouts (TP=1, one layer a stage): SGLang's own check compares here too, and it
    # runs first: the changed request is aborted by SGLang's check, kvaudit verifies the
    # rest, every stage its own layers.
    group, monkeypatch, _ = decode_context
    _, stages = prefill_pp
    kept, aborts = {}, {}
    for pp_rank in range(2):
        decode = Decode(group, monkeypatch.setattr, layers=stage_layers(pp_rank, 2))
        assert decode.queue._kv_checksum_comparable(stages[pp_rank]["signature"]) is True
        senders = [stages[pp_rank]]  # equal PP sizes: stage s pulls from stage s
        ok = decode.receive("req-ok", senders, index=2)
        bad = decode.receive("req-bad", senders, index=4)
        kept[pp_rank] = [req.rid for req in decode.verify([ok, bad])]
        aborts[pp_rank] = decode.aborts
    assert kept == {0: ["req-ok", "req-bad"], 1: ["req-ok"]}
    assert aborts == {0: [], 1: ["req-bad"]}
    stats = inline.inline_stats()
    assert (stats["verified"], stats["partial"], stats["mismatched"]) == (3, 0, 0)
    assert LAYERS == 2 and CHANGED[1] == 1  # the change lies in stage 1's layer


def pp_decode_rank(rank: int, init_file: str, out_dir: str, stages: list[dict]) -> None:
    """One rank of a TP=2 decode (a spawned process): rank 0 keeps stage 0's row of each
    request, rank 1 stage 1's."""
    with decode_process(rank, init_file) as group:
        decode = Decode(group, setattr, tp_rank=rank, tp_size=2)
        senders = [stages[1 - rank], stages[rank]]  # the last one is kept
        ok = decode.receive("req-ok", senders, index=2)
        bad = decode.receive("req-bad", senders, index=4)
        out = {
            "kept": [req.rid for req in decode.verify([ok, bad])],
            "aborts": decode.aborts,
            "stats": inline.inline_stats(),
        }
    Path(out_dir, f"decode{rank}.json").write_text(json.dumps(out))


def test_decode_ranks_that_kept_different_stages_verify_both(prefill_pp, tmp_path) -> None:
    import torch.multiprocessing as mp

    _, stages = prefill_pp
    mp.spawn(pp_decode_rank, args=(str(tmp_path / "init"), str(tmp_path), stages), nprocs=2)
    for rank in range(2):
        out = json.loads((tmp_path / f"decode{rank}.json").read_text())
        assert out["kept"] == ["req-ok"] and out["aborts"] == ["req-bad"], rank
        stats = out["stats"]
        assert (stats["verified"], stats["partial"], stats["mismatched"]) == (1, 0, 1)
