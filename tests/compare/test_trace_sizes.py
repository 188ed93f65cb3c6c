"""Stale blocks traced across block sizes: sides of 16- and 64-token blocks compared at 64.

A consumer block that holds another block's KV is traced whole at the compared size
first; when only part of it is stale (one 16-token block of a 64-token position), each
16-token block whose tokens differ is traced on its own. The expected sources are found
by scanning the requests' model KV (``kvbuild``'s global cells), not with kvaudit.
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
TOKENS = {"req-a": 150, "req-b": 70}
RANK = 1  # the consumer rank (TP=4, one KV head each: global head 1) holding stale KV
MODEL = kb.Model(
    (kb.GroupModel(0, tuple(kb.Attn(n, 4, 8) for n in LAYERS), block_size=16),),
    model_kv_heads=4,
)
REQUESTS = {
    rid: kb.make_request(MODEL, n, seed=i + 11) for i, (rid, n) in enumerate(TOKENS.items())
}


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def engine(block_size: int, tp_size: int, seed: int) -> list[kb.Worker]:
    return kb.build_engine(
        MODEL, REQUESTS, kb.Engine(tp_size, block_sizes={0: block_size}, seed=seed)
    )


def overwrite(
    worker: kb.Worker, block_size: int, target: tuple[str, int], source: tuple[str, int]
) -> None:
    """Copy, in every layer, the worker's cells of request tokens ``source[1] ..`` of
    ``source[0]`` over those of ``target``: 16 tokens, inside one block of each."""
    cells = {}
    for key, (rid, token) in (("to", target), ("from", source)):
        start, block_ids = worker.requests[rid][1][0]
        cells[key] = (block_ids[token // block_size - start], token % block_size)
    for name in LAYERS:
        tensor = worker.tensors[name]
        assert not isinstance(tensor, tuple) and tensor.shape[1] == block_size  # [N, T, H, C]
        (to_block, to_offset), (from_block, from_offset) = cells["to"], cells["from"]
        tensor[to_block, to_offset : to_offset + 16] = tensor[
            from_block, from_offset : from_offset + 16
        ].clone()


def holders(source: tuple[str, int], tokens: int) -> list[dict]:
    """``{request, group, position}`` of every block of ``tokens`` tokens (positions at
    that size) whose model KV of global head ``RANK`` equals that of ``source``'s tokens,
    in every layer."""
    rid, first = source
    want = {name: REQUESTS[rid].data[name][first : first + tokens, RANK] for name in LAYERS}
    found = []
    for other, n in TOKENS.items():
        for q in range(n // tokens):
            cells = {
                name: REQUESTS[other].data[name][q * tokens : (q + 1) * tokens, RANK]
                for name in LAYERS
            }
            if all(np.array_equal(cells[name], want[name]) for name in LAYERS):
                found.append({"request": other, "group": 0, "position": q})
    return found


def stale_sources(producer: Path, consumer: Path, rid: str) -> tuple[dict, str]:
    result = run("diff", producer, consumer, "--format", "json")
    assert result.exit_code == 1, result.output
    group = json.loads(result.stdout)["requests"][rid]["groups"]["0"]
    table = run("diff", producer, consumer)
    assert table.exit_code == 1
    return group, table.stdout


@pytest.mark.parametrize(("producer_size", "consumer_size"), [(64, 16), (16, 64)])
def test_one_stale_fine_block_is_traced(
    tmp_path: Path, producer_size: int, consumer_size: int
) -> None:
    """req-b's tokens 16..31 hold req-a's tokens 32..47: req-a position 2 at 16 tokens."""
    producer = kb.write_workers(engine(producer_size, 2, 1), tmp_path / "p", "producer")
    workers = engine(consumer_size, 4, 2)
    overwrite(workers[RANK], consumer_size, ("req-b", 16), ("req-a", 32))
    consumer = kb.write_workers(workers, tmp_path / "c", "consumer")
    group, table = stale_sources(producer, consumer, "req-b")
    assert group["mismatched_positions"] == [0]
    expected = holders(("req-a", 32), 16)
    assert expected == [{"request": "req-a", "group": 0, "position": 2}]
    want = [{**entry, "block_size": 16, "consumer_position": 1} for entry in expected]
    assert group["stale_sources"] == {"0": want}
    assert "0 tokens 16-31 hold req-a position 2 at block size 16" in " ".join(table.split())


def test_a_whole_stale_block_is_traced_at_the_compared_size(tmp_path: Path) -> None:
    """req-b's tokens 0..63 (four 16-token blocks) hold req-a's tokens 64..127: req-a
    position 1 at 64 tokens, named whole."""
    producer = kb.write_workers(engine(64, 2, 1), tmp_path / "p", "producer")
    workers = engine(16, 4, 2)
    for k in range(4):
        overwrite(workers[RANK], 16, ("req-b", 16 * k), ("req-a", 64 + 16 * k))
    consumer = kb.write_workers(workers, tmp_path / "c", "consumer")
    group, table = stale_sources(producer, consumer, "req-b")
    assert group["mismatched_positions"] == [0]
    expected = holders(("req-a", 64), 64)
    assert expected == [{"request": "req-a", "group": 0, "position": 1}]
    assert group["stale_sources"] == {"0": expected}
    assert "0 holds req-a position 1" in " ".join(table.split())
