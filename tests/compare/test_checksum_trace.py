"""Stale blocks traced by their checksums where the raw KV is not read (docs/cli.md: "Stale
blocks are traced"): a producer record on one side, ``--no-locate``, ``verify --against``.

The consumer (TP=4, other block ids) holds, on every rank, another block's KV at one
position. The expected sources are found by scanning the requests' model KV (every layer
and head of ``kvbuild``'s global cells), not with kvaudit; under request numbering only a
source at the same position can be found, and the report says so where none is.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from helpers import kvbuild as kb

from kvaudit.cli import main

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
BLOCK = 16
TOKENS = {"req-a": 100, "req-b": 70}
MODEL = kb.Model(
    (kb.GroupModel(0, tuple(kb.Attn(n, 4, 8) for n in LAYERS), block_size=BLOCK),),
    model_kv_heads=4,
)
REQUESTS = {rid: kb.make_request(MODEL, n, seed=i + 5) for i, (rid, n) in enumerate(TOKENS.items())}
PARTIAL = "traced by checksums only"


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def engine(tp_size: int, seed: int) -> list[kb.Worker]:
    return kb.build_engine(MODEL, REQUESTS, kb.Engine(tp_size, block_sizes={0: BLOCK}, seed=seed))


def overwrite(workers: list[kb.Worker], target: tuple[str, int], source: tuple[str, int]) -> None:
    """Copy, on each of ``workers`` and in every layer, block position ``source[1]`` of
    request ``source[0]`` over position ``target[1]`` of ``target[0]``."""
    for worker in workers:
        rows = []
        for rid, position in (target, source):
            start, block_ids = worker.requests[rid][1][0]
            rows.append(block_ids[position - start])
        for name in LAYERS:
            tensor = worker.tensors[name]
            assert not isinstance(tensor, tuple) and tensor.shape[1] == BLOCK  # [N, T, H, C]
            tensor[rows[0]] = tensor[rows[1]].clone()


def holders(source: tuple[str, int], at: int | None = None) -> list[dict]:
    """``{request, group, position}`` of every full block whose model KV (every layer and
    head) equals that of ``source``; with ``at``, only blocks at that position."""
    rid, first = source

    def block(request: str, position: int) -> list[np.ndarray]:
        cells = slice(position * BLOCK, (position + 1) * BLOCK)
        return [REQUESTS[request].data[name][cells] for name in LAYERS]

    want = block(rid, first)
    return [
        {"request": other, "group": 0, "position": q}
        for other, n in TOKENS.items()
        for q in range(n // BLOCK)
        if at in (None, q)
        and all(np.array_equal(x, y) for x, y in zip(block(other, q), want, strict=True))
    ]


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kb.write_workers(engine(2, 1), tmp_path_factory.mktemp("trace") / "p", "producer")


def record(producer: Path, folder: Path, positions: str) -> Path:
    path = folder / f"producer-{positions}.json"
    done = run("checksum", producer, "--positions", positions, "--format", "json", "-o", path)
    assert done.exit_code == 0, done.output
    return path


def diff(*args: object) -> tuple[dict, dict, str]:
    """The diff report's JSON, req-b's group 0 in it, and the table."""
    result = run("diff", *args, "--format", "json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    table = run("diff", *args)
    assert table.exit_code == 1
    return data, data["requests"]["req-b"]["groups"]["0"], " ".join(table.stdout.split())


def test_block_numbered_record_traces_any_position(producer: Path, tmp_path: Path) -> None:
    """req-b position 1 holds req-a position 3: found through a block-numbered record."""
    workers = engine(4, 2)
    overwrite(workers, ("req-b", 1), ("req-a", 3))
    consumer = kb.write_workers(workers, tmp_path / "c", "consumer")
    expected = holders(("req-a", 3))
    assert expected == [{"request": "req-a", "group": 0, "position": 3}]
    saved = record(producer, tmp_path, "block")
    data, group, table = diff(saved, consumer)
    assert group["mismatched_positions"] == [1]
    assert group["stale_sources"] == {"1": expected}
    assert data["untraced"] is None
    assert "1 holds req-a position 3" in table
    # verify --against the same record traces it the same way.
    verified = run("verify", consumer, "--against", saved, "--format", "json")
    assert verified.exit_code == 1, verified.output
    report = json.loads(verified.stdout)
    assert report["requests"]["req-b"]["groups"]["0"]["stale_sources"] == {"1": expected}
    assert report["untraced"] is None


@pytest.mark.parametrize("how", ["record", "no-locate"])
def test_request_numbering_traces_the_same_position(
    producer: Path, tmp_path: Path, how: str
) -> None:
    """req-b position 1 holds req-a position 1 (a slot of another request at the same
    position): found under request numbering, by a record or by dumps with --no-locate."""
    workers = engine(4, 2)
    overwrite(workers, ("req-b", 1), ("req-a", 1))
    consumer = kb.write_workers(workers, tmp_path / "c", "consumer")
    expected = holders(("req-a", 1), at=1)
    assert expected == [{"request": "req-a", "group": 0, "position": 1}]
    side = record(producer, tmp_path, "request") if how == "record" else producer
    extra = ["--no-locate"] if how == "no-locate" else []
    data, group, table = diff(side, consumer, *extra)
    assert group["stale_sources"] == {"1": expected}
    assert data["untraced"] is None
    assert "1 holds req-a position 1" in table


def test_request_numbering_says_what_it_cannot_see(producer: Path, tmp_path: Path) -> None:
    """req-b position 1 holds req-a position 3: request-numbered checksums cannot match
    another position, so the source list is empty and the report says why."""
    workers = engine(4, 2)
    overwrite(workers, ("req-b", 1), ("req-a", 3))
    consumer = kb.write_workers(workers, tmp_path / "c", "consumer")
    assert holders(("req-a", 3), at=1) == []
    saved = record(producer, tmp_path, "request")
    data, group, table = diff(saved, consumer)
    assert group["stale_sources"] == {"1": []}
    assert data["untraced"].startswith(f"{PARTIAL} ({saved} is a record")
    assert "--positions block" in data["untraced"]
    assert f"stale sources: {PARTIAL}" in table
    # The bytes of both sides' raw KV find it wherever it came from.
    located = run("diff", producer, consumer, "--format", "json")
    assert located.exit_code == 1
    report = json.loads(located.stdout)
    assert report["untraced"] is None
    sources = report["requests"]["req-b"]["groups"]["0"]["stale_sources"]
    assert sources == {"1": holders(("req-a", 3))}


def test_a_block_stale_on_one_rank_only_has_no_whole_source(producer: Path, tmp_path: Path) -> None:
    """Only rank 2 delivered req-a position 3 at req-b position 1: no producer block holds
    the consumer block's whole content, which a block-numbered trace reports as none."""
    workers = engine(4, 2)
    overwrite(workers[2:3], ("req-b", 1), ("req-a", 3))
    consumer = kb.write_workers(workers, tmp_path / "c", "consumer")
    data, group, table = diff(record(producer, tmp_path, "block"), consumer)
    assert group["mismatched_positions"] == [1]
    assert group["stale_sources"] == {"1": []}
    assert data["untraced"] is None
    assert "holds" not in table
