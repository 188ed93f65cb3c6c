"""The trace at scale: its work grows with the differing blocks plus the producer's
blocks, never their product; content that many places hold lists the first
``MAX_SOURCES`` of them and says how many; zeros are never a source.

The expected sources are found by scanning the requests' model KV (``kvbuild``'s global
cells) with numpy, not with kvaudit. The work is counted (calls), never timed; the times
are in ``bench/trace_scale.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from helpers import kvbuild as kb

import kvaudit.compare.trace_blocks as trace_blocks
import kvaudit.compare.trace_runs as trace_runs
from kvaudit.cli import main
from kvaudit.compare.model import MAX_SOURCES

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
MODEL = kb.Model(
    (kb.GroupModel(0, tuple(kb.Attn(name, 2, 4) for name in LAYERS), block_size=16),),
    model_kv_heads=2,
)


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def cells(request: kb.RequestKV, name: str) -> np.ndarray:
    data = request.data[name]
    assert isinstance(data, np.ndarray)
    return data


def write(
    folder: Path, producer: dict[str, kb.RequestKV], consumer: dict[str, kb.RequestKV]
) -> tuple[Path, Path]:
    """Both sides' dumps: one TP rank each, the same block tables."""
    engine = kb.Engine(1, seed=3)
    return (
        kb.write_workers(kb.build_engine(MODEL, producer, engine), folder / "p", "producer"),
        kb.write_workers(kb.build_engine(MODEL, consumer, engine), folder / "c", "consumer"),
    )


def diff_json(producer: Path, consumer: Path, *options: str) -> tuple[dict, int]:
    result = run("diff", producer, consumer, "--format", "json", *options)
    assert result.exit_code == 1, result.output
    return json.loads(result.stdout), len(result.stdout.encode())


def block_holders(requests: dict[str, kb.RequestKV], want: dict[str, np.ndarray]) -> list:
    """``{request, group, position}`` of every 16-token block whose model KV (every head)
    equals ``want`` in every layer, in request order."""
    found = []
    for rid, request in requests.items():
        for q in range(request.num_tokens // 16):
            held = {name: cells(request, name)[16 * q : 16 * q + 16] for name in LAYERS}
            if all(np.array_equal(held[name], want[name]) for name in LAYERS):
                found.append({"request": rid, "group": 0, "position": q})
    return found


def token_holders(
    requests: dict[str, kb.RequestKV], want: dict[str, np.ndarray], skip: tuple[str, int]
) -> list[dict]:
    """``{request, first}`` of every place whose tokens hold ``want`` (``[count, heads,
    cell]`` per layer) in every layer, in request order, ``skip`` (the run itself) aside."""
    found = []
    for rid, request in requests.items():
        count = len(want[LAYERS[0]])
        ok = np.ones(request.num_tokens - count + 1, dtype=bool)
        for name in LAYERS:
            data = cells(request, name)
            for j in range(count):
                ok &= (data[j : len(ok) + j] == want[name][j]).all(axis=(1, 2))
        found += [{"request": rid, "first": int(t)} for t in np.flatnonzero(ok) if (rid, t) != skip]
    return found


SHARED = 24
"""Requests whose first block is one shared prompt."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """24 requests of 4 blocks whose position 0 is one shared prompt; in the consumer,
    every request's position 1 holds that prompt (stale) and positions 2-3 a changed
    byte each: 72 differing blocks, 96 producer blocks."""
    producer = {f"req-{k:02}": kb.make_request(MODEL, 64, seed=k) for k in range(SHARED)}
    prompt = {name: cells(producer["req-00"], name)[:16].copy() for name in LAYERS}
    for request in producer.values():
        for name in LAYERS:
            cells(request, name)[:16] = prompt[name]
    consumer = copy.deepcopy(producer)
    for request in consumer.values():
        for name in LAYERS:
            cells(request, name)[16:32] = prompt[name]
        cells(request, LAYERS[0])[[35, 60], 1, :3] ^= np.uint8(0x5A)
    folder = tmp_path_factory.mktemp("shared")
    return *write(folder, producer, consumer), block_holders(producer, prompt)


def test_the_trace_work_grows_with_the_blocks_not_their_product(
    shared: tuple[Path, Path, list], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted: a trace that weighed every producer block for every differing block
    would ask each pair's valid tokens (72 x 96 = 6912 times); an index by content asks
    once per differing block and per producer request."""
    calls = [0]
    real = trace_blocks.valid_tokens

    def counted(*args: object) -> np.ndarray:
        calls[0] += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(trace_blocks, "valid_tokens", counted)
    report, _ = diff_json(*shared[:2])
    differing = sum(len(g["mismatched_positions"]) for g in groups(report))
    assert differing == 3 * SHARED
    assert 0 < calls[0] <= 2 * (differing + 4 * SHARED)


def groups(report: dict) -> list[dict]:
    return [g for r in report["requests"].values() for g in r["groups"].values()]


def test_a_block_many_places_hold_lists_the_first_and_says_how_many(
    shared: tuple[Path, Path, list],
) -> None:
    producer, consumer, expected = shared
    assert len(expected) == SHARED > MAX_SOURCES == 8
    report, _ = diff_json(producer, consumer)
    for rid, request in report["requests"].items():
        group = request["groups"]["0"]
        assert group["stale_sources"] == {"1": expected[:MAX_SOURCES], "2": [], "3": []}, rid
        assert group["stale_matches"] == {"1": SHARED}
    table = run("diff", producer, consumer).stdout
    listed = ", ".join(f"{e['request']} position 0" for e in expected[:MAX_SOURCES])
    cell = f"3: 1-3 (1 holds {listed} (matches {SHARED} places, first 8 shown))"
    assert [cell_text(table, rid, 5) for rid in report["requests"]] == [cell] * SHARED
    assert (
        "req-05 group 0: stale block: position 1 (tokens 16-31) holds req-00 position 0 or "
        f"req-01 position 0 (matches {SHARED} places, first 2 shown) (heads 0-1"
    ) in table
    junit = run("diff", producer, consumer, "--format", "junit")
    assert (
        "position 1 holds req-00 position 0, req-01 position 0, req-02 position 0 "
        f"(matches {SHARED} places, first 3 shown)"
    ) in junit.stdout


def cell_text(table: str, request: str, column: int) -> str:
    """The text of a request's cell in a column of the diff table (the request's is
    column 1), its lines joined."""
    parts: list[str] = []
    for line in table.splitlines():
        cells = line.split("│")
        if len(cells) <= column:
            continue
        if cells[1].strip() == request or (parts and not cells[1].strip()):
            parts.append(cells[column].strip())
        elif parts:
            break
    return " ".join(part for part in parts if part)


def long_request(
    tokens: int, count: int, seed: int, at: int = 86
) -> tuple[dict, dict, dict[str, np.ndarray]]:
    """A request whose every 4th token (and, for a run of 2, the token after it) holds
    the same cells in every slice, and a short one holding them at token 9; the
    consumer holds those cells at token ``at`` (and the next) of the long request, where
    no producer block holds its block. Both sides and the cells."""
    requests = {
        "short": kb.make_request(MODEL, 40, seed=seed),
        "long": kb.make_request(MODEL, tokens, seed=seed + 1),
    }
    for name in LAYERS:
        data = cells(requests["long"], name)
        for j in range(count):
            data[j::4] = data[j]
        cells(requests["short"], name)[9 : 9 + count] = data[:count]
    changed = copy.deepcopy(requests)
    for name in LAYERS:
        cells(changed["long"], name)[at : at + count] = cells(requests["long"], name)[:count]
    return requests, changed, {name: cells(requests["long"], name)[:count] for name in LAYERS}


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize(("chunk", "few"), [(4096, 16), (100, 16), (7, 10**6), (64, 0)])
def test_a_run_many_places_hold_lists_the_first_and_says_how_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int, chunk: int, few: int
) -> None:
    """A run of tokens half a request's places hold: the first 8 places listed, in the
    producer's order, with how many; the JSON stays small. Read in parts of ``chunk``
    tokens, checking ``few`` candidates one by one (else a part at once): the same."""
    monkeypatch.setattr(trace_runs, "RUN_CHUNK", chunk)
    monkeypatch.setattr(trace_runs, "FEW_CANDIDATES", few)
    producer, consumer, want = long_request(2048, count, seed=20 + count)
    expected = token_holders(producer, want, ("long", 86))
    assert len(expected) > 500 and expected[0] == {"request": "short", "first": 9}
    report, size = diff_json(*write(tmp_path, producer, consumer))
    group = report["requests"]["long"]["groups"]["0"]
    assert group["stale_sources"] == {"5": []}
    assert group["token_runs"] == [
        {
            "position": 5,
            "first": 86,
            "count": count,
            "traced": True,
            "sources": expected[:MAX_SOURCES],
            "matches": len(expected),
        }
    ]
    # Every place listed would take more than 30 bytes each.
    assert size < 12_000 < 30 * len(expected)
    (finding,) = [f for f in report["diagnosis"] if f["kind"] == "foreign_tokens"]
    said = (
        "token 86 (position 5) holds short token 9 or long token 0"
        if count == 1
        else "tokens 86-87 (position 5) hold short tokens 9-10 or long tokens 0-1"
    )
    assert f"{said} (matches {len(expected)} places, first 2 shown)" in finding["text"]


def test_a_run_few_places_hold_lists_them_all(tmp_path: Path) -> None:
    """Under the bound nothing changes: every place listed, no ``matches``."""
    producer, consumer, want = long_request(24, 1, seed=30, at=17)
    expected = token_holders(producer, want, ("long", 17))
    assert 1 < len(expected) <= MAX_SOURCES
    report, _ = diff_json(*write(tmp_path, producer, consumer))
    (run_json,) = report["requests"]["long"]["groups"]["0"]["token_runs"]
    assert run_json == {"position": 1, "first": 17, "count": 1, "traced": True, "sources": expected}


@pytest.mark.parametrize("how", ["raw", "no-locate"])
def test_zeros_are_never_a_stale_source(tmp_path: Path, how: str) -> None:
    """A tail never written (zeros) matches the zeros of a padding request byte for byte
    (and by checksums, which sum zeros to 0): no source; the tail is named as one."""
    producer = {
        "req": kb.make_request(MODEL, 64, seed=1),
        "pad": kb.make_request(MODEL, 32, seed=2),
    }
    for name in LAYERS:
        cells(producer["pad"], name)[:] = 0
    consumer = copy.deepcopy(producer)
    for name in LAYERS:
        cells(consumer["req"], name)[32:] = 0
    assert block_holders(producer, {name: cells(consumer["req"], name)[32:48] for name in LAYERS})
    options = ["--no-locate"] if how == "no-locate" else []
    report, _ = diff_json(*write(tmp_path, producer, consumer), *options)
    group = report["requests"]["req"]["groups"]["0"]
    assert group["mismatched_positions"] == [2, 3]
    assert group["stale_sources"] == {"2": [], "3": []}
    assert report["untraced"] is None
    kinds = [f["kind"] for f in report["diagnosis"]]
    assert "stale_block" not in kinds
    if how == "raw":
        assert kinds == ["tail_not_written"]
