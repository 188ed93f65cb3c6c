"""The ``kvaudit`` command line on the bundled example's dump sets.

The example writes one model KV as a producer set (TP=2, NTHC) and a consumer set (TP=4,
KNHTD, other block ids, other junk). The checks: the command's record agrees with the
tests' numpy reference computed from the model KV, the two sets' totals agree, the
output forms (JSON, CSV, files) hold what they say, and bad input ends in one line and
exit status 2.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from helpers import reference as ref
from helpers.example_module import example

from kvaudit.checksum import checksum_dump_set
from kvaudit.cli import main
from kvaudit.dumps import open_dump_set
from kvaudit.formats import record_to_json

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "make_example.py"
SEED = 3


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's producer and consumer dump sets."""
    root = tmp_path_factory.mktemp("example")
    example.make_example(root, seed=SEED)
    return root


@pytest.fixture(scope="module")
def expected() -> dict[str, dict[str, list[str]]]:
    """Per request, the reference's totals under each position numbering, from the
    model KV alone."""
    result: dict[str, dict[str, list[str]]] = {}
    for request_id, kv in example.model_kv(SEED).items():
        num_tokens = kv.shape[1]
        caches = tuple(
            ref.Layer(
                name,
                # [tokens, heads, K and V rows] as bytes: each cell is K then V.
                kv[number].contiguous().view(torch.uint8).numpy().reshape(num_tokens, 8, -1),
            )
            for number, name in enumerate(example.LAYERS)
        )
        group = ref.Group(example.BLOCK_SIZE, caches)
        result[request_id] = {
            positions: [
                f"{int(v):016x}"
                for v in ref.total(ref.block_checksums(group, num_tokens, positions=positions))
            ]
            for positions in ("request", "block")
        }
    return result


def run(*args: str) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def record_of(*args: str) -> dict:
    result = run("checksum", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def totals(record: dict) -> dict[tuple[str, str], list[str]]:
    return {
        (request_id, gid): group["totals"]
        for request_id, request in record["requests"].items()
        for gid, group in request["groups"].items()
    }


def fingerprints(record: dict) -> set[str]:
    return {g["fingerprint"] for r in record["requests"].values() for g in r["groups"].values()}


def assert_one_line_error(result: Result, *names: str) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvaudit: error: "), result.stderr
    for name in names:
        assert name in lines[0]
    assert "Traceback" not in result.output


# Checksums.


def test_checksum_matches_reference_and_library(sets: Path, expected: dict) -> None:
    record = record_of(sets / "producer")
    assert record["format"] == "kvaudit.record/1"
    assert record["positions"] == "request"
    assert record["complete"] is True
    assert [w["tp_rank"] for w in record["workers"]] == [0, 1]
    for request_id, num_tokens in example.REQUESTS.items():
        request = record["requests"][request_id]
        assert request["num_tokens"] == num_tokens
        group = request["groups"]["0"]
        assert group["start"] == 0 and group["block_size"] == 16
        assert group["replica_keys"] == [[1, 0]]
        assert group["totals"] == expected[request_id]["request"]
        assert [row[0] for row in group["values"]] == group["totals"]
    library = checksum_dump_set(open_dump_set([sets / "producer"]), backend="torch")
    assert record == json.loads(json.dumps(record_to_json(library)))


def test_producer_and_consumer_totals_agree(sets: Path, expected: dict) -> None:
    """Other TP size, layout, block ids and junk past the last token: same totals."""
    producer = record_of(sets / "producer")
    consumer = record_of(sets / "consumer")
    assert [w["role"] for w in consumer["workers"]] == ["consumer"] * 4
    assert totals(consumer) == totals(producer)
    for request_id in example.REQUESTS:
        assert totals(consumer)[request_id, "0"] == expected[request_id]["request"]
    # The fingerprint identifies the same layers whatever the TP size.
    assert fingerprints(consumer) == fingerprints(producer)
    assert len(fingerprints(consumer)) == 1


def test_block_positions(sets: Path, expected: dict) -> None:
    by_block = record_of(sets / "consumer", "--positions", "block")
    by_request = record_of(sets / "consumer")
    assert by_block["positions"] == "block"
    for request_id in example.REQUESTS:
        block_totals = by_block["requests"][request_id]["groups"]["0"]["totals"]
        request_totals = by_request["requests"][request_id]["groups"]["0"]["totals"]
        assert block_totals == expected[request_id]["block"]
        # Position 0 starts at token 0 under both numberings; every later one differs.
        assert block_totals[0] == request_totals[0]
        assert all(a != b for a, b in zip(block_totals[1:], request_totals[1:], strict=True))


def test_csv_rows(sets: Path) -> None:
    record = record_of(sets / "producer")
    result = run("checksum", sets / "producer", "--format", "csv")
    assert result.exit_code == 0
    rows = list(csv.reader(io.StringIO(result.stdout)))
    assert rows[0] == ["request", "group", "position", "replica_key", "value"]
    expected_rows = []
    for request_id, request in record["requests"].items():
        group = request["groups"]["0"]
        for position, (value, total) in enumerate(
            zip(group["values"], group["totals"], strict=True)
        ):
            expected_rows.append([request_id, "0", str(position), "1:0", value[0]])
            expected_rows.append([request_id, "0", str(position), "total", total])
    assert rows[1:] == expected_rows
    blocks = sum(-(-n // 16) for n in example.REQUESTS.values())
    assert len(rows) == 1 + 2 * blocks


def test_output_file(sets: Path, tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    result = run("checksum", sets / "producer", "--format", "json", "-o", out)
    assert result.exit_code == 0
    assert result.stdout == ""
    assert json.loads(out.read_text()) == record_of(sets / "producer")
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]

    table = tmp_path / "table.txt"
    assert run("checksum", sets / "producer", "-o", table).exit_code == 0
    assert "req-long" in table.read_text() and "\x1b[" not in table.read_text()


def test_failed_run_leaves_output_untouched(sets: Path, tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    out.write_text("previous\n")
    result = run("checksum", sets / "producer", "--request", "nope", "--format", "json", "-o", out)
    assert_one_line_error(result, "nope")
    assert out.read_text() == "previous\n"
    result = run("checksum", sets / "producer", "-o", tmp_path / "missing" / "x.json")
    assert_one_line_error(result, "x.json")
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_request_filter(sets: Path, expected: dict) -> None:
    record = record_of(sets / "consumer", "--request", "req-short", "--request", "req-long")
    assert list(record["requests"]) == ["req-short", "req-long"]
    assert totals(record)["req-short", "0"] == expected["req-short"]["request"]
    assert_one_line_error(
        run("checksum", sets / "consumer", "--request", "req-short", "--request", "req-x"),
        "req-x",
    )


def test_checksum_table(sets: Path) -> None:
    record = record_of(sets / "producer", "--request", "req-short")
    result = run("checksum", sets / "producer", "--request", "req-short")
    assert result.exit_code == 0
    text = result.stdout
    assert "req-short (40 tokens), group 0" in text and "complete" in text
    assert "req-long" not in text
    for value in record["requests"]["req-short"]["groups"]["0"]["totals"]:
        assert value in text


def test_record_as_source(sets: Path, tmp_path: Path) -> None:
    saved = tmp_path / "producer.json"
    assert run("checksum", sets / "producer", "--format", "json", "-o", saved).exit_code == 0
    again = record_of(saved)
    assert again == json.loads(saved.read_text())
    short = record_of(saved, "--request", "req-short")
    assert list(short["requests"]) == ["req-short"]
    assert_one_line_error(run("checksum", saved, "--positions", "block"), "producer.json")


def test_live_source(sets: Path, tmp_path: Path) -> None:
    """Two live workers of the producer's geometry, with their own block ids."""
    for rank in (0, 1):
        (tmp_path / f"live{rank}.py").write_text(
            f"""
import importlib.util
import sys

import numpy as np

spec = importlib.util.spec_from_file_location("ex", {str(EXAMPLE)!r})
ex = sys.modules["ex"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)


def kvaudit_live():
    rng = np.random.default_rng(99)
    tables = ex.block_tables(ex.PRODUCER, rng)
    tensors = ex.worker_cache(ex.PRODUCER, {rank}, ex.model_kv({SEED}), tables, rng)
    requests = {{
        rid: {{"num_tokens": n, "groups": {{0: [0, tables[rid]]}}}}
        for rid, n in ex.REQUESTS.items()
    }}
    return ex.description(ex.PRODUCER), tensors, {{"tp_rank": {rank}, "tp_size": 2}}, requests
"""
        )
    handles = [f"py:{tmp_path / f'live{rank}.py'}" for rank in (0, 1)]
    live = record_of(*handles)
    assert totals(live) == totals(record_of(sets / "producer"))
    result = run("checksum", handles[0], "--format", "json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["complete"] is False
    assert_one_line_error(run("checksum", f"py:{tmp_path / 'none.py'}"), "none.py")


# Inspect.


def test_inspect_json(sets: Path) -> None:
    result = run("inspect", sets / "consumer", "--format", "json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["complete"] is True and data["missing_workers"] == []
    workers = data["workers"]
    assert [(w["tp_rank"], w["tp_size"], w["role"]) for w in workers] == [
        (rank, 4, "consumer") for rank in range(4)
    ]
    blocks = sum(-(-n // 16) for n in example.REQUESTS.values())
    for worker in workers:
        group = worker["groups"]["0"]
        assert group["covered"] is True and group["reason"] is None
        assert (group["type"], group["block_size"], group["layout"], group["layers"]) == (
            "full_attention",
            16,
            "KNHTD",
            4,
        )
        # Each rank dumps 2 heads x (K + V) x 128 bf16 per token of each dumped block.
        assert worker["rows"] == blocks
        assert group["bytes"] == blocks * 16 * 4 * 2 * 2 * 128 * 2
    assert len({w["groups"]["0"]["fingerprint"] for w in workers}) == 1
    for request_id, num_tokens in example.REQUESTS.items():
        request = data["requests"][request_id]
        assert request["num_tokens"] == num_tokens
        assert request["groups"]["0"] == list(range(-(-num_tokens // 16)))


def test_inspect_table(sets: Path) -> None:
    result = run("inspect", sets / "producer")
    assert result.exit_code == 0
    text = result.stdout
    for word in ("complete", "full_attention", "NTHC", "producer", "req-long", "17 (0-16)"):
        assert word in text
    assert "rank1.safetensors" in text


# Incomplete sets and bad input.


def test_incomplete_set(sets: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for rank in (0, 2, 3):
        shutil.copy(sets / "consumer" / f"rank{rank}.safetensors", partial)
    result = run("checksum", partial, "--format", "json")
    assert result.exit_code == 1
    record = json.loads(result.stdout)
    assert record["complete"] is False
    assert "tp_rank 1" in result.stderr
    table = run("checksum", partial)
    assert table.exit_code == 1 and "INCOMPLETE" in table.stdout
    inspect = run("inspect", partial, "--format", "json")
    assert inspect.exit_code == 1
    assert json.loads(inspect.stdout)["missing_workers"] == [{"pp_rank": 0, "tp_rank": 1}]


def test_bad_inputs(sets: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nothing.safetensors"
    assert_one_line_error(run("checksum", missing), "nothing.safetensors")
    assert_one_line_error(run("inspect", missing), "nothing.safetensors")

    truncated = tmp_path / "truncated.safetensors"
    data = (sets / "producer" / "rank0.safetensors").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run("checksum", truncated), "truncated.safetensors")

    config = tmp_path / "cache.yaml"
    config.write_text("kvaudit: 1\ngroups: [\n  {id: 0\n")
    assert_one_line_error(run("checksum", "-c", config, sets / "producer"), "cache.yaml")
    assert_one_line_error(run("inspect", "--config", config, sets / "producer"), "cache.yaml")

    not_a_record = tmp_path / "record.json"
    not_a_record.write_text('{"format": "something else"}')
    assert_one_line_error(run("checksum", not_a_record), "record.json")

    assert_one_line_error(run("checksum", sets / "producer", "--format", "xml"), "--format")
    assert_one_line_error(run("checksum"), "SOURCE")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_a_gpu(sets: Path) -> None:
    assert_one_line_error(run("checksum", sets / "producer", "--device", "cuda"), "cuda")


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0 and result.stdout.startswith("kvaudit, version ")


def test_python_m_kvaudit(sets: Path) -> None:
    """The real command in a process of its own: the consumer's record, then an error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "kvaudit", "checksum"]
    done = subprocess.run(
        [*command, str(sets / "consumer"), "--format", "json", "-q"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert totals(json.loads(done.stdout)) == totals(record_of(sets / "producer"))

    failed = subprocess.run(
        [*command, str(sets / "absent")], capture_output=True, text=True, env=env, check=False
    )
    assert failed.returncode == 2
    assert failed.stdout == ""
    assert failed.stderr.startswith("kvaudit: error: ") and "absent" in failed.stderr
    assert len(failed.stderr.splitlines()) == 1


def test_reference_sanity() -> None:
    """The reference's view of the model KV: a cell is 128 K then 128 V bfloat16 values."""
    kv = example.model_kv(SEED)["req-short"]
    cells = kv[0].contiguous().view(torch.uint8).numpy().reshape(40, 8, -1)
    assert cells.shape == (40, 8, 512)
    first_v = np.frombuffer(cells[0, 0, 256:258].tobytes(), dtype=np.uint16)[0]
    assert first_v == kv[0, 0, 0, 1, 0].view(torch.uint16).item()


# The example's broken consumer and the end-to-end script.


def test_broken_consumer_differs_in_one_rank(sets: Path) -> None:
    """consumer-broken is the consumer with one block of one rank replaced."""
    for rank in range(4):
        name = f"rank{rank}.safetensors"
        same = (sets / "consumer" / name).read_bytes() == (
            sets / "consumer-broken" / name
        ).read_bytes()
        assert same == (rank != example.BROKEN_RANK)
    result = run("diff", sets / "producer", sets / "consumer-broken", "--format", "json")
    assert result.exit_code == 1
    groups = {rid: r["groups"]["0"] for rid, r in json.loads(result.stdout)["requests"].items()}
    assert {rid for rid, g in groups.items() if g["mismatched_positions"]} == {"req-medium"}
    assert run("diff", sets / "producer", sets / "consumer").exit_code == 0


def write_tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def run_script(tmp_path: Path, kvaudit_body: str) -> subprocess.CompletedProcess:
    """``examples/run_example.sh`` with ``python`` and a ``kvaudit`` of our own on PATH."""
    tools = tmp_path / "bin"
    tools.mkdir()
    write_tool(tools, "python", f'exec {sys.executable} "$@"')
    write_tool(tools, "kvaudit", kvaudit_body)
    env = {
        **os.environ,
        "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        ["bash", str(ROOT / "examples" / "run_example.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )


def test_run_example_script(tmp_path: Path) -> None:
    done = run_script(tmp_path, f'exec {sys.executable} -m kvaudit "$@"')
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run_example: OK" in done.stdout
    assert "OK: 3 requests, 27 blocks compared, all match" in done.stdout
    assert "MISMATCH: 1 of 27 blocks compared differ" in done.stdout
    assert (tmp_path / "out" / "consumer-broken" / "rank1.safetensors").is_file()


def test_run_example_script_checks_the_status(tmp_path: Path) -> None:
    # A kvaudit that misses the fault (always status 0) fails the script, saying why.
    done = run_script(tmp_path, "exit 0")
    assert done.returncode != 0
    assert "broken consumer exited with status 0, expected 1" in done.stderr
    assert "run_example: OK" not in done.stdout
