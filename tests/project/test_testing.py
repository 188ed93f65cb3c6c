"""``kvaudit.testing``: the assertion connector tests call, and the bundled CI example.

Every kind of side (dump paths, a list of dump files, ``DumpSet``, ``Record``, live
``Checksummer``s with and without tensors) is checked on the example's producer, consumer
and consumer with a planted fault: the clean pair passes, the broken pair raises an
``AssertionError`` whose message is the ``kvaudit diff`` table, plain.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from helpers.example_module import example

from kvaudit.checksum import checksum_dump_set
from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.dumps import open_dump_set
from kvaudit.testing import LiveSide, assert_kv_equal, diff_kv

ROOT = Path(__file__).resolve().parents[2]
CI_TEST = ROOT / "examples" / "ci" / "test_kv_transfer.py"
SEED = 6


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("example")
    example.make_example(root, seed=SEED)
    return root


def failure(producer: object, consumer: object, **options: object) -> str:
    with pytest.raises(AssertionError) as raised:
        assert_kv_equal(producer, consumer, **options)
    return str(raised.value)


def located_rows(text: str) -> set[tuple[str, ...]]:
    """The located table's rows: (request, position, layer, head, tokens)."""
    rows = set()
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) >= 9 and "self_attn" in cells[3]:
            rows.add((cells[0], cells[2], cells[3], cells[4], cells[5]))
    return rows


PLANTED = {
    ("req-medium", "4", f"model.layers.{layer}.self_attn.attn", str(head), "64-79")
    for layer in range(4)
    for head in (2, 3)
}
"""The example's planted fault: rank 1 of the TP=4 consumer holds heads 2 and 3."""


def test_dump_paths(sets: Path) -> None:
    report = assert_kv_equal(sets / "producer", str(sets / "consumer"))
    assert report.ok and sum(g.compared for _, _, g in report.groups()) == 27
    message = failure(sets / "producer", sets / "consumer-broken")
    assert "MISMATCH: 1 of 27 blocks compared differ, in 1 of 3 requests" in message
    assert located_rows(message) == PLANTED
    assert "\x1b[" not in message


def test_message_is_the_command_table(sets: Path) -> None:
    message = failure(sets / "producer", sets / "consumer-broken")
    result = CliRunner().invoke(
        main, ["diff", str(sets / "producer"), str(sets / "consumer-broken"), "--all"]
    )
    assert result.exit_code == 1
    # The same diagnosis, table, verdict and located differences (every one, as --all
    # lists them); only the title line differs.
    assert message.strip().splitlines()[1:] == result.stdout.strip().splitlines()[1:]


def test_dump_files_and_dump_sets(sets: Path) -> None:
    files = sorted(str(p) for p in (sets / "consumer-broken").glob("*.safetensors"))
    assert located_rows(failure(sets / "producer", files)) == PLANTED
    producer = open_dump_set([sets / "producer"])
    assert_kv_equal(producer, open_dump_set([sets / "consumer"]))
    broken = open_dump_set([sets / "consumer-broken"])
    assert located_rows(failure(producer, broken)) == PLANTED


def test_records(sets: Path) -> None:
    producer = checksum_dump_set(open_dump_set([sets / "producer"]), backend="torch")
    consumer = checksum_dump_set(open_dump_set([sets / "consumer"]), backend="torch")
    broken = checksum_dump_set(open_dump_set([sets / "consumer-broken"]), backend="torch")
    assert_kv_equal(producer, consumer)
    message = failure(producer, broken)
    assert "MISMATCH" in message and "req-medium" in message
    assert "Located" not in message  # records hold no KV to narrow down
    message = failure(sets / "producer", broken)
    assert "Located" not in message


def live(engine: example.Engine, broken: bool, tensors: bool) -> LiveSide:
    """The example's engine as live workers (their own block ids), optionally with the
    planted fault written into rank 1's tensors."""
    rng = np.random.default_rng([SEED, 9])
    tables = example.block_tables(engine, rng)
    kv = example.model_kv(SEED)
    description = parse_description(example.description(engine), engine.name)
    requests = {rid: RequestBlocks(n, {0: (0, tables[rid])}) for rid, n in example.REQUESTS.items()}
    workers = []
    for rank in range(engine.tp_size):
        cache = example.worker_cache(engine, rank, kv, tables, rng)
        if broken and rank == 1:
            # req-medium's block 4 holds another request's block: req-long's block 2.
            block, other = tables["req-medium"][4], tables["req-long"][2]
            for tensor in cache.values():
                tensor[:, block] = tensor[:, other]
        workers.append(cache)
    summers = [
        Checksummer(description, cache, tp_rank=rank, tp_size=engine.tp_size, role=engine.role)
        for rank, cache in enumerate(workers)
    ]
    return LiveSide(summers, requests, workers if tensors else None, name=engine.name)


def test_live_sides(sets: Path) -> None:
    assert_kv_equal(live(example.PRODUCER, False, True), live(example.CONSUMER, False, True))
    # Live against dumps, and live with tensors on both sides: located down to the byte.
    assert_kv_equal(sets / "producer", live(example.CONSUMER, False, False))
    message = failure(live(example.PRODUCER, False, True), live(example.CONSUMER, True, True))
    assert located_rows(message) == {
        (rid, position, layer, head, "64-79") for rid, position, layer, head, _ in PLANTED
    }
    inventory = live(example.CONSUMER, False, False).source().inventory()
    assert inventory.complete and len(inventory.workers) == 4
    assert {rid: r.num_tokens for rid, r in inventory.requests.items()} == example.REQUESTS
    report = diff_kv(live(example.PRODUCER, False, False), live(example.CONSUMER, True, False))
    assert not report.ok
    assert report.requests["req-medium"][0].mismatched_positions == [4]
    assert report.requests["req-medium"][0].located == []


def test_options(sets: Path, tmp_path: Path) -> None:
    assert_kv_equal(sets / "producer", sets / "consumer-broken", request_ids=["req-short"])
    message = failure(sets / "producer", sets / "consumer-broken", locate=False)
    assert "MISMATCH" in message and "Located" not in message
    # One description for both sides (same engine): the dumps' own, from a YAML file.
    config = tmp_path / "consumer.yaml"
    config.write_text(yaml.safe_dump(example.description(example.CONSUMER)))
    assert located_rows(failure(sets / "consumer", sets / "consumer-broken", config=config)) == (
        PLANTED
    )


def test_bad_input_is_not_an_assertion(sets: Path, tmp_path: Path) -> None:
    with pytest.raises(KvauditError, match="absent"):
        assert_kv_equal(sets / "producer", tmp_path / "absent")
    with pytest.raises(KvauditError, match="req-x"):
        assert_kv_equal(sets / "producer", sets / "consumer", request_ids=["req-x"])
    with pytest.raises(KvauditError, match="LiveSide"):
        assert_kv_equal(sets / "producer", 42)  # type: ignore[arg-type]


def run_ci_example(dumps: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVAUDIT_DUMPS": str(dumps)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CI_TEST)],
        capture_output=True,
        text=True,
        env=env,
        cwd=dumps,
        check=False,
    )


def test_ci_example(sets: Path, tmp_path: Path) -> None:
    """The bundled CI check on the example: the intact consumer passes, the broken one
    fails with the located report; no dumps at all fails too."""
    done = run_ci_example(sets)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 2 passed" in done.stdout
    assert "consumer-broken" in done.stdout and "MISMATCH" in done.stdout
    assert "model.layers.3.self_attn.attn" in done.stdout

    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_ci_example(empty)
    assert done.returncode == 1
    assert "no producer/consumer dump directories" in done.stdout
