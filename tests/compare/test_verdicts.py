"""Verdicts a user can trust (``diff`` and ``verify``): nothing unchecked passes.

Positions the consumer lacks are missing, a consumer that decoded further is neither
missing nor different (``diff`` and ``verify --received``, whose wire carries the
producer's token count and numbering), a run that compared nothing fails, differing
blocks are traced to the producer blocks whose KV they hold, swapped or identical sides
are warned about, several reports come out of one run, and a closed stdout pipe keeps the
verdict's exit status. Every expectation is computed by the test: positions from token
counts and block lists, checksums from ``tests/helpers/reference.py``, wire bytes with
``struct``, and the traced KV from the example's model KV and the dumps read with
safetensors.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from helpers import kvbuild as kb
from helpers import reference as ref
from helpers.example_module import example
from safetensors import safe_open

from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.cli import main
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import WorkerInfo

ROOT = Path(__file__).resolve().parents[2]
SEED = 0
BLOCK = 16
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
TOKENS = {"r1": 40, "r2": 21}


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def report_of(*args: object, status: int) -> dict:
    result = run(*args, "--format", "json")
    assert result.exit_code == status, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is (status == 0)
    return report


def missing(report: dict, rid: str, gid: str = "0") -> list[int]:
    return report["requests"][rid]["groups"][gid]["missing_positions"]


# Small engines whose block lists and token counts the tests change.


def model(window: int | None = None) -> kb.Model:
    kind = "full_attention" if window is None else "sliding_window"
    layers = tuple(kb.Attn(n, 4, 8, type=kind, sliding_window=window) for n in LAYERS)
    return kb.Model((kb.GroupModel(0, layers, block_size=BLOCK),), model_kv_heads=4)


@dataclass
class Engines:
    model: kb.Model
    requests: dict[str, kb.RequestKV]
    producer: list[kb.Worker]
    consumer: list[kb.Worker]


def engines(window: int | None = None) -> Engines:
    m = model(window)
    requests = {rid: kb.make_request(m, n, seed=i + 3) for i, (rid, n) in enumerate(TOKENS.items())}
    producer = kb.build_engine(m, requests, kb.Engine(tp_size=2, seed=1))
    consumer = kb.build_engine(m, requests, kb.Engine(tp_size=4, seed=2))
    return Engines(m, requests, producer, consumer)


@pytest.fixture(scope="module")
def small() -> Engines:
    return engines()


def listing(
    worker: kb.Worker, rid: str, *, tokens: int | None = None, keep: slice = slice(None)
) -> dict[str, RequestBlocks]:
    """The worker's requests, with ``rid`` cut to ``tokens`` and its blocks to ``keep``
    (the start moves with the first kept block)."""
    result = {}
    for request_id, (n, groups) in worker.requests.items():
        start, block_ids = groups[0]
        if request_id == rid:
            first = range(len(block_ids))[keep]
            start = start + (first[0] if len(first) else 0)
            block_ids = list(block_ids)[keep]
            n = n if tokens is None else tokens
        result[request_id] = RequestBlocks(n, {0: (start, list(block_ids))})
    return result


def write(
    workers: list[kb.Worker],
    folder: Path,
    role: str,
    change: dict | None = None,
    received: dict[str, bytes] | None = None,
) -> Path:
    """Each worker's dump in ``folder``, its listing changed by ``listing(**change)``."""
    folder.mkdir(parents=True, exist_ok=True)
    for w in workers:
        path = folder / f"pp{w.pp_rank}-tp{w.tp_rank}.safetensors"
        if change is None:
            blocks = {rid: RequestBlocks(n, dict(t)) for rid, (n, t) in w.requests.items()}
        else:
            blocks = listing(w, **change)
        info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, role, "test")
        description = parse_description(w.description, str(path))
        write_dump(path, description, w.tensors, blocks, worker=info, received=received)
    return folder


def expected_missing(producer_tokens: int, consumer_tokens: int, held: range) -> list[int]:
    """Positions with producer tokens whose tokens the consumer does not all hold."""
    return [
        q
        for q in range(-(-producer_tokens // BLOCK))
        if min((q + 1) * BLOCK, producer_tokens) > consumer_tokens or q not in held
    ]


# Missing positions.


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("stops early", {"rid": "r1", "keep": slice(0, 2)}),
        ("skips the first", {"rid": "r1", "keep": slice(1, None)}),
        ("fewer tokens", {"rid": "r1", "tokens": 35}),
        ("far fewer tokens", {"rid": "r1", "tokens": 12, "keep": slice(0, 1)}),
    ],
)
def test_a_consumer_that_lacks_positions_fails(
    small: Engines, tmp_path: Path, name: str, change: dict
) -> None:
    producer = write(small.producer, tmp_path / "producer", "producer")
    consumer = write(small.consumer, tmp_path / "consumer", "consumer", change)
    keep = range(3)[change.get("keep", slice(None))]
    want = expected_missing(40, change.get("tokens", 40), keep)
    assert want
    report = report_of("diff", producer, consumer, status=1)
    assert missing(report, "r1") == want and missing(report, "r2") == []
    group = report["requests"]["r1"]["groups"]["0"]
    assert group["mismatched_positions"] == [] and group["unverified"] is None
    assert report["requests"]["r1"]["num_tokens"] == {
        "producer": 40,
        "consumer": change.get("tokens", 40),
    }
    assert group["positions"]["producer"] == 3
    table = run("diff", producer, consumer)
    assert table.exit_code == 1 and "MISSING" in table.stdout
    assert f"{len(want)} position" in table.stdout
    junit = run("diff", producer, consumer, "--format", "junit")
    suite = ET.fromstring(junit.stdout.split("\n", 1)[1]).find("testsuite")
    assert suite is not None and suite.get("failures") == "1"
    failure = next(case for case in suite.iter("testcase") if case.find("failure") is not None)
    assert failure.get("classname") == "kvaudit.producer->consumer.r1"
    # A consumer that legitimately holds part of a request.
    allowed = report_of("diff", producer, consumer, "--allow-missing", status=0)
    assert missing(allowed, "r1") == want


def test_a_consumer_that_decoded_further_passes(small: Engines, tmp_path: Path) -> None:
    """Tokens 40..44 written after the transfer (in r1's last block) and a longer listing
    are neither missing nor different."""
    producer = write(small.producer, tmp_path / "producer", "producer")
    consumer = write(small.consumer, tmp_path / "consumer", "consumer", {"rid": "r1", "tokens": 45})
    report = report_of("diff", producer, consumer, status=0)
    assert missing(report, "r1") == [] and report["requests"]["r1"]["groups"]["0"]["compared"] == 3
    assert report["requests"]["r1"]["num_tokens"] == {"producer": 40, "consumer": 45}


def test_sliding_window_groups_expect_the_window_only(tmp_path: Path) -> None:
    """Window 10: after n tokens the next token reads tokens n - 9 .. n, so a side keeps
    the blocks from position (n - 9) // 16 on: the producer (40 tokens) from 1, a
    consumer that decoded to 45 tokens from 2. Only positions kept on both sides are
    expected."""
    built = engines(window=10)
    first = {n: (n - 9) // BLOCK for n in (40, 45)}
    assert first == {40: 1, 45: 2}
    producer = write(built.producer, tmp_path / "producer", "producer",
                     {"rid": "r1", "keep": slice(first[40], None)})  # fmt: skip
    decoded = write(built.consumer, tmp_path / "decoded", "consumer",
                    {"rid": "r1", "keep": slice(first[45], None), "tokens": 45})  # fmt: skip
    report = report_of("diff", producer, decoded, status=0)
    group = report["requests"]["r1"]["groups"]["0"]
    assert (group["missing_positions"], group["compared"]) == ([], 1)
    # At 40 tokens the consumer keeps position 1 too: without it, it is missing.
    dropped = write(built.consumer, tmp_path / "dropped", "consumer",
                    {"rid": "r1", "keep": slice(first[45], None)})  # fmt: skip
    assert missing(report_of("diff", producer, dropped, status=1), "r1") == [1]
    same = write(built.consumer, tmp_path / "same", "consumer",
                 {"rid": "r1", "keep": slice(first[40], None)})  # fmt: skip
    report = report_of("diff", producer, same, status=0)
    assert report["requests"]["r1"]["groups"]["0"]["compared"] == 2


# verify --received: the producer's tokens and numbering.


def totals(built: Engines, rid: str, positions: str = "request") -> list[int]:
    kv = built.requests[rid]
    group = kb.reference_group(built.model, 0, kv, 1)
    return [
        int(v) for v in ref.total(ref.block_checksums(group, kv.num_tokens, positions=positions))
    ]


def fingerprint() -> int:
    return ref.fingerprint([(name, "FullAttentionSpec", "torch.bfloat16") for name in LAYERS])


def wire(values: list[int], num_tokens: int, numbering: int = 0) -> bytes:
    """The spec's KVC2 bytes of one request's group 0."""
    header = b"KVC2" + struct.pack("<QBH", num_tokens, numbering, 1)
    group = struct.pack("<IQIII", 0, fingerprint(), BLOCK, 0, len(values))
    return header + group + struct.pack(f"<{len(values)}Q", *values)


@pytest.mark.parametrize(("numbering", "code"), [("request", 0), ("block", 1)])
def test_received_compares_the_producer_tokens_under_its_numbering(
    small: Engines, tmp_path: Path, numbering: str, code: int
) -> None:
    sent = {rid: wire(totals(small, rid, numbering), TOKENS[rid], code) for rid in TOKENS}
    further = write(small.consumer, tmp_path / "further", "consumer",
                    {"rid": "r1", "tokens": 45}, received=sent)  # fmt: skip
    report = report_of("verify", further, "--received", status=0)
    assert report["positions"] == numbering
    assert missing(report, "r1") == [] and report["requests"]["r1"]["groups"]["0"]["compared"] == 3
    assert report["requests"]["r1"]["num_tokens"] == {"producer": 40, "consumer": 45}
    # A consumer with fewer tokens than the producer sent: the rest is missing.
    fewer = write(small.consumer, tmp_path / "fewer", "consumer",
                  {"rid": "r1", "tokens": 30}, received=sent)  # fmt: skip
    report = report_of("verify", fewer, "--received", status=1)
    assert missing(report, "r1") == expected_missing(40, 30, range(3))
    assert report["requests"]["r1"]["groups"]["0"]["mismatched_positions"] == []
    assert report_of("verify", fewer, "--received", "--allow-missing", status=0)["ok"]


def test_received_totals_of_another_numbering_differ(small: Engines, tmp_path: Path) -> None:
    """Request-numbered totals sent as block-numbered: every position but 0 differs."""
    sent = {rid: wire(totals(small, rid), TOKENS[rid], 1) for rid in TOKENS}
    consumer = write(small.consumer, tmp_path / "c", "consumer", received=sent)
    report = report_of("verify", consumer, "--received", status=1)
    assert report["requests"]["r1"]["groups"]["0"]["mismatched_positions"] == [1, 2]
    assert report["untraced"] is not None


def test_received_under_two_numberings_is_bad_input(small: Engines, tmp_path: Path) -> None:
    sent = {"r1": wire(totals(small, "r1"), 40, 0), "r2": wire(totals(small, "r2", "block"), 21, 1)}
    consumer = write(small.consumer, tmp_path / "c", "consumer", received=sent)
    result = run("verify", consumer, "--received")
    assert result.exit_code == 2 and result.stdout == ""
    assert "numbered positions differently" in result.stderr and "--request" in result.stderr
    assert report_of("verify", consumer, "--received", "--request", "r2", status=0)["ok"]


# Nothing compared.


def test_nothing_compared_fails_unless_allowed(small: Engines, tmp_path: Path) -> None:
    producer = write(small.producer, tmp_path / "producer", "producer")
    record = tmp_path / "empty.json"
    assert run("checksum", producer, "--format", "json", "-o", record).exit_code == 0
    data = json.loads(record.read_text())
    data["requests"] = {}
    record.write_text(json.dumps(data))
    consumer = write(small.consumer, tmp_path / "consumer", "consumer")
    report = report_of("diff", record, consumer, status=1)
    assert report["unverified"] and report["only_in_consumer"] == ["r1", "r2"]
    table = run("diff", record, consumer)
    assert table.exit_code == 1 and "nothing was verified" in table.stdout
    assert report_of("diff", record, consumer, "--allow-empty", status=0)["unverified"] is None
    assert report_of("verify", consumer, "--against", record, status=1)["unverified"]


# Warnings.


def test_swapped_and_identical_sides_are_warned_about(small: Engines, tmp_path: Path) -> None:
    producer = write(small.producer, tmp_path / "producer", "producer")
    consumer = write(small.consumer, tmp_path / "consumer", "consumer")
    swapped = run("diff", consumer, producer, "--format", "json")
    assert swapped.exit_code == 0
    assert "warning" in swapped.stderr and "swapped" in swapped.stderr
    assert len(json.loads(swapped.stdout)["warnings"]) == 1
    itself = run("diff", producer, producer)
    assert "same files" in itself.stderr and "OK" in itself.stdout
    linked = tmp_path / "linked"
    linked.symlink_to(producer)
    assert "same files" in run("diff", producer, linked).stderr
    clean = run("diff", producer, consumer, "--format", "json")
    assert clean.stderr == "" and json.loads(clean.stdout)["warnings"] == []


# Several reports, and a closed pipe.


def test_json_and_junit_files_beside_the_table(small: Engines, tmp_path: Path) -> None:
    producer = write(small.producer, tmp_path / "producer", "producer")
    consumer = write(
        small.consumer, tmp_path / "consumer", "consumer", {"rid": "r2", "keep": slice(0, 1)}
    )
    out_json, out_junit = tmp_path / "r.json", tmp_path / "r.xml"
    result = run("diff", producer, consumer, "--json", out_json, "--junit", out_junit)
    assert result.exit_code == 1 and "MISSING" in result.stdout
    assert json.loads(out_json.read_text()) == report_of("diff", producer, consumer, status=1)
    assert out_junit.read_text() == run("diff", producer, consumer, "--format", "junit").stdout
    sent = {rid: wire(totals(small, rid), TOKENS[rid]) for rid in TOKENS}
    received = write(small.consumer, tmp_path / "received", "consumer", received=sent)
    # A report file never replaces an input.
    for option in ("--json", "--junit"):
        refused = run("diff", producer, consumer, option, producer / "pp0-tp0.safetensors")
        assert refused.exit_code == 2 and option in refused.stderr
    verified = run("verify", received, "--received", "--json", out_json, "--format", "junit")
    assert verified.exit_code == 0 and json.loads(out_json.read_text())["ok"] is True
    assert verified.stdout.startswith("<?xml")


@pytest.mark.parametrize("reader", ["true", "head -c 1"])
def test_a_closed_pipe_keeps_the_verdict(small: Engines, tmp_path: Path, reader: str) -> None:
    producer = write(small.producer, tmp_path / "producer", "producer")
    good = write(small.consumer, tmp_path / "good", "consumer")
    bad = write(small.consumer, tmp_path / "bad", "consumer", {"rid": "r1", "keep": slice(0, 2)})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for consumer, status in ((good, 0), (bad, 1)):
        for fmt in ("table", "json"):
            command = (
                f"{sys.executable} -m kvaudit diff {producer} {consumer} -q --format {fmt} "
                f"| {reader} >/dev/null; exit ${{PIPESTATUS[0]}}"
            )
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                  env=env, check=False)  # fmt: skip
            assert done.returncode == status, done.stderr
            assert "Traceback" not in done.stderr and "Error" not in done.stderr


# Stale blocks traced.


def model_block(kv: dict, rid: str, position: int, layer: int, head: int) -> bytes:
    """The model's bytes of one slice of one block (K then V per token)."""
    tokens = kv[rid][layer, position * BLOCK : (position + 1) * BLOCK, head]
    return tokens.contiguous().view(torch.uint8).numpy().tobytes()


def consumer_block(path: Path, rid: str, position: int, layer: int, head: int) -> bytes:
    """One slice of a block of the example consumer's KNHTD dump, via safetensors."""
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        tensor = file.get_tensor(example.LAYERS[layer])
    rows = {block: row for row, block in enumerate(json.loads(metadata["kvaudit.blocks"]))}
    request = json.loads(metadata["kvaudit.requests"])[rid]
    start, block_ids = request["groups"]["0"]
    row = rows[block_ids[position - start]]
    local = head % (example.KV_HEADS // json.loads(metadata["kvaudit.worker"])["tp_size"])
    cells = tensor[:, row, local].permute(1, 0, 2)  # [tokens, K/V, head_size]
    return cells.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def example_sets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("example")
    example.make_example(root, seed=SEED)
    return root


def test_a_stale_block_is_traced(example_sets: Path, tmp_path: Path) -> None:
    report = report_of(
        "diff", example_sets / "producer", example_sets / "consumer-broken", status=1
    )
    group = report["requests"]["req-medium"]["groups"]["0"]
    assert group["mismatched_positions"] == [4]
    # The broken rank's differing slices hold which model blocks? Read from the files.
    kv = example.model_kv(SEED)
    path = example_sets / "consumer-broken" / f"rank{example.BROKEN_RANK}.safetensors"
    slices = {(entry["layer"], entry["head"]) for entry in group["located"]}
    assert {entry["file"] for entry in group["located"]} == {str(path)}
    held = {
        (layer, head): consumer_block(path, "req-medium", 4, example.LAYERS.index(layer), head)
        for layer, head in slices
    }
    expected = [
        {"request": rid, "group": 0, "position": q}
        for rid, n in example.REQUESTS.items()
        for q in range(n // BLOCK)
        if all(
            model_block(kv, rid, q, example.LAYERS.index(layer), head) == data
            for (layer, head), data in held.items()
        )
    ]
    assert expected and group["stale_sources"] == {"4": expected}
    table = run("diff", example_sets / "producer", example_sets / "consumer-broken")
    first = expected[0]
    assert f"holds {first['request']} position {first['position']}" in table.stdout
    # A record on one side: traced by checksums only. Only one rank's slices are stale,
    # so no producer block holds the whole block, and request-numbered checksums could
    # not have matched another position anyway: the report says so.
    record = tmp_path / "producer.json"
    run("checksum", example_sets / "producer", "--format", "json", "-o", record)
    report = report_of("diff", record, example_sets / "consumer-broken", status=1)
    assert report["requests"]["req-medium"]["groups"]["0"]["stale_sources"] == {"4": []}
    assert report["untraced"].startswith("traced by checksums only")
    table = run("diff", record, example_sets / "consumer-broken").stdout
    assert "stale sources: traced by checksums only" in table


def test_zeroed_block_traces_to_nothing(example_sets: Path, tmp_path: Path) -> None:
    broken = tmp_path / "consumer"
    broken.mkdir()
    for rank in range(4):
        (broken / f"rank{rank}.safetensors").symlink_to(
            example_sets / "consumer" / f"rank{rank}.safetensors"
        )
    target = broken / "rank2.safetensors"
    target.unlink()
    args = ["--request", "req-long", "--group", "0", "--position", "3", "--mode", "zero"]
    result = run("corrupt", example_sets / "consumer" / "rank2.safetensors", "-o", target, *args)
    assert result.exit_code == 0, result.output
    report = report_of("diff", example_sets / "producer", broken, status=1)
    assert report["requests"]["req-long"]["groups"]["0"]["stale_sources"] == {"3": []}
    assert np.all(np.frombuffer(consumer_block(target, "req-long", 3, 0, 4), np.uint8) == 0)


# Workers of one set that disagree on a request.


def without(workers: list[kb.Worker], folder: Path, role: str, tp: int, rid: str) -> Path:
    """The set's dumps, worker ``tp`` not listing request ``rid`` (a worker that answered
    at another step, a rank whose dump lost it)."""
    write(workers, folder, role)
    w = workers[tp]
    path = folder / f"pp{w.pp_rank}-tp{w.tp_rank}.safetensors"
    blocks = {r: RequestBlocks(n, dict(t)) for r, (n, t) in w.requests.items() if r != rid}
    info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, role, "test")
    write_dump(path, parse_description(w.description, str(path)), w.tensors, blocks, worker=info)
    return folder


def test_a_request_some_workers_lack_is_never_compared_as_whole(
    small: Engines, tmp_path: Path
) -> None:
    # Both sides lack the same rank's part: their partial sums agree, but that rank's
    # heads were never compared.
    producer = without(small.producer, tmp_path / "producer", "producer", 1, "r2")
    consumer = without(small.consumer, tmp_path / "consumer", "consumer", 1, "r2")
    report = report_of("diff", producer, consumer, status=1)
    group = report["requests"]["r2"]["groups"]["0"]
    assert group["mismatched_positions"] == [] and group["compared"] == 0
    assert "the producer's checksums are partial sums" in group["unverified"]
    assert "the consumer's checksums are partial sums" in group["unverified"]
    assert "pp0-tp1.safetensors does not hold it" in group["unverified"]
    assert report["requests"]["r1"]["groups"]["0"]["unverified"] is None

    result = run("checksum", consumer, "--format", "json")
    assert result.exit_code == 1
    assert "kvaudit: request r2 group 0: partial sums:" in result.stderr
    record = json.loads(result.stdout)
    assert record["complete"] is True
    assert "does not hold it" in record["requests"]["r2"]["groups"]["0"]["partial"]
    assert "partial" not in record["requests"]["r1"]["groups"]["0"]
    # The record keeps it: compared from the record, the group is still unverified.
    saved = tmp_path / "consumer.json"
    saved.write_text(result.stdout)
    again = report_of(
        "diff", write(small.producer, tmp_path / "whole", "producer"), saved, status=1
    )
    assert (
        "the consumer's checksums are partial sums"
        in again["requests"]["r2"]["groups"]["0"]["unverified"]
    )
