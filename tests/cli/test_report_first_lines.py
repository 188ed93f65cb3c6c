"""Every form of a report names the fault's kind and place in its first lines: the table's
second line (after the title), the JSON's ``diagnosis`` (right after ``ok``), the JUnit
failure message and the HTML page's list under the verdict.

The faults are planted in the example's consumer with ``kvaudit corrupt`` (a stale block,
a head swap, a partial reuse: the first tokens of a block from another request, a bit
flip), each on every consumer rank that holds the block, or drawn as values (a consumer
whose KV went through another kernel: every value off by rounding; a bf16 producer and an
fp16 consumer compared by value). What each must say follows from what was planted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers.example_module import example
from helpers.report_forms import reports
from helpers.valued_sets import ATTN, CONSUMER, PRODUCER, draw, dump, model

from kvaudit.cli import main

RANKS = 4  # the example consumer's TP size: each rank holds 2 of the 8 KV heads


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("example")
    example.make_example(root)
    return root


def planted(sets: Path, folder: Path, mode: str, *args: str, ranks: range) -> Path:
    """The example's consumer with ``mode`` planted in req-medium's block 2 on ``ranks``."""
    folder.mkdir()
    for rank in range(RANKS):
        name = f"rank{rank}.safetensors"
        if rank not in ranks:
            shutil.copy(sets / "consumer" / name, folder / name)
            continue
        result = CliRunner().invoke(
            main,
            [
                *("corrupt", str(sets / "consumer" / name), "-o", str(folder / name)),
                *("--request", "req-medium", "--group", "0", "--position", "2"),
                *("--mode", mode, "--seed", "1", *args),
            ],
        )
        assert result.exit_code == 0, result.output
    return folder


def check_first_lines(found: dict, kind: str, title: str, *place: str) -> None:
    """The fault's kind and place lead every form."""
    assert found["status"] == 1
    line = found["table"][1]
    assert line.startswith(f"req-medium group 0: {title}: "), line
    assert all(words in line for words in place), (line, place)
    data = found["json"]
    keys = list(data)
    assert keys.index("diagnosis") == keys.index("ok") + 1 <= 5
    first = data["diagnosis"][0]
    assert (first["request"], first["group"], first["kind"]) == ("req-medium", 0, kind)
    assert first["text"] == line.removeprefix("req-medium group 0: ")
    assert found["html"][0] == (kind, f"req-medium group 0: {first['text']}")
    if "junit" in found:
        assert found["junit"] == [first["text"] + found["junit"][0][len(first["text"]) :]]
        assert found["junit"][0].startswith(first["text"])


def test_the_example(sets: Path, tmp_path: Path) -> None:
    found = reports(sets / "producer", sets / "consumer-broken", tmp_path)
    place = ("position 4 (tokens 64-79) holds req-short position 0", "heads 2-3", "tp 1 pp 0")
    check_first_lines(found, "stale_block", "stale block", *place)
    assert len(found["json"]["diagnosis"]) == 1


def test_a_head_swap(sets: Path, tmp_path: Path) -> None:
    # Rank 1 (heads 2 and 3) swaps its two heads in layer 2 only.
    broken = planted(
        sets, tmp_path / "c", "swap-heads", "--layer", ATTN.format(2), ranks=range(1, 2)
    )
    found = reports(sets / "producer", broken, tmp_path / "r")
    place = ("consumer head 2 holds producer head 3, head 3 holds head 2", ATTN.format(2))
    check_first_lines(found, "heads_exchanged", "heads exchanged", *place, "at position 2")
    # One line for the swap; the two located rows are in the JSON, not the table.
    assert len(found["json"]["diagnosis"]) == 1
    assert "2 located differences named above (--all lists them)" in found["table"]


def test_a_partial_reuse(sets: Path, tmp_path: Path) -> None:
    # The first 6 tokens (32-37) of req-medium's block 2 hold another request's KV on
    # every rank: a slot reused while the write was in flight.
    broken = planted(sets, tmp_path / "c", "stale", "--token", "37", ranks=range(RANKS))
    found = reports(sets / "producer", broken, tmp_path / "r")
    source = found["json"]["requests"]["req-medium"]["groups"]["0"]["token_runs"][0]
    assert (source["first"], source["count"]) == (32, 6)
    rid, first = source["sources"][0]["request"], source["sources"][0]["first"]
    assert rid != "req-medium" and first % 16 == 0  # the start of one of its blocks
    place = (f"tokens 32-37 (position 2) hold {rid} tokens {first}-{first + 5}",)
    check_first_lines(found, "foreign_tokens", "tokens from elsewhere", *place, "heads 0-7")


def test_a_bit_flip(sets: Path, tmp_path: Path) -> None:
    broken = planted(
        sets, tmp_path / "c", "flip", "--token", "41", "--head", "5", ranks=range(2, 3)
    )
    found = reports(sets / "producer", broken, tmp_path / "r")
    check_first_lines(found, "bit_flip", "single bit", "head 5 token 41 (position 2)")


def test_a_consumer_off_by_rounding_everywhere(tmp_path: Path) -> None:
    # Another kernel's KV: every value 0.3% off, then rounded to bf16 like the producer's.
    bf16 = model("bfloat16", layers=3)
    values = draw(31, bf16, {"req-medium": 40})
    consumer = {rid: {k: v * 1.003 for k, v in layers.items()} for rid, layers in values.items()}
    left = dump(tmp_path / "p", bf16, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", bf16, consumer, CONSUMER, "consumer")
    found = reports(left, right, tmp_path / "r")
    check_first_lines(found, "drift", "small differences everywhere", "--numeric")
    # Compared by value within a tolerance wide enough for it, it passes, and says nothing.
    calm = reports(left, right, tmp_path / "n", "--numeric", "--rtol", "0.01")
    assert calm["status"] == 0 and calm["json"]["diagnosis"] == [] and calm["html"] == []


def test_bf16_against_fp16_by_value(tmp_path: Path) -> None:
    # An fp16 consumer of a bf16 producer's values: within rtol 0.01 but for one head of
    # one layer, scaled by 1.5 at tokens 10-19.
    bf16, fp16 = model("bfloat16", layers=3), model("float16", layers=3)
    values = draw(23, bf16, {"req-medium": 40})
    consumer = {rid: dict(layers) for rid, layers in values.items()}
    damaged = np.array(consumer["req-medium"][ATTN.format(1)])
    damaged[10:20, 3] *= 1.5
    consumer["req-medium"][ATTN.format(1)] = damaged
    left = dump(tmp_path / "p", bf16, values, PRODUCER, "producer")
    right = dump(tmp_path / "c", fp16, consumer, CONSUMER, "consumer")
    found = reports(left, right, tmp_path / "r", "--numeric", "--atol", "0.001", "--rtol", "0.01")
    place = (f"1 of 12 slices (head 3 of {ATTN.format(1)})", "x the tolerance")
    check_first_lines(found, "over_tolerance", "over the tolerance", *place)
    worst = found["json"]["diagnosis"][0]["tokens"]
    assert worst and set(worst) <= set(range(10, 20))
