"""SGLang workers' pools served to ``live:`` clients (``kvaudit.integrations.sglang.
sglang_agent``): a TP=2 prefill and a TP=1 decode, each worker an agent on its own socket
answering on its own thread, compared by the ``kvaudit`` command as two running engines.

The pools, allocators and request rows are SGLang 0.5.23's own classes on the CPU
(``helpers.sglang_worlds``); the agents are kvaudit's. What the diff must find follows
from the cell the test changes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.sglang_worlds import (
    NAME,
    ORDER_DECODE,
    ORDER_PREFILL,
    PAGE,
    TOKENS,
    Worker,
    mha_world,
)

from kvaudit.cli import main
from kvaudit.integrations.sglang import sglang_agent
from kvaudit.live import socket_path


def serve(workers: list[Worker], root: Path, engine: str, role: str) -> list:
    """An agent per worker under ``root/engine``, answering on its own thread."""
    agents = []
    for worker in workers:
        rows = dict(worker.rows)
        agents.append(
            sglang_agent(
                socket_path(engine, worker.pp_rank, worker.tp_rank, str(root)),
                worker.pool,
                worker.req_to_token,
                lambda rows=rows: {rid: (row, TOKENS[rid]) for rid, row in rows.items()},
                tp_rank=worker.tp_rank,
                tp_size=worker.tp_size,
                total_kv_heads=worker.total_kv_heads,
                pp_rank=worker.pp_rank,
                pp_size=worker.pp_size,
                role=role,
                engine=engine,
                lock=threading.Lock(),
            )
        )
    return agents


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[Path, list[Worker]]]:
    root = tmp_path / "run"
    prefill = mha_world(2, 1, 8, ORDER_PREFILL, junk=1)
    decode = mha_world(1, 1, 8, ORDER_DECODE, junk=4)
    agents = serve(prefill, root, "prefill", "producer") + serve(decode, root, "decode", "consumer")
    try:
        yield root, decode
    finally:
        for agent in agents:
            agent.close()


def diff(root: Path, *extra: str) -> tuple[int, dict]:
    result = CliRunner().invoke(
        main,
        [
            *("diff", f"live:{root / 'prefill'}", f"live:{root / 'decode'}"),
            *("--format", "json", "--device", "cpu", *extra),
        ],
    )
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def test_a_tp2_prefill_and_a_tp1_decode_served_live_agree(engines) -> None:
    root, _ = engines
    status, report = diff(root)
    assert status == 0 and report["ok"] is True
    assert set(report["requests"]) == set(TOKENS)
    for rid, request in report["requests"].items():
        assert request["num_tokens"] == {"producer": TOKENS[rid], "consumer": TOKENS[rid]}
        assert request["groups"]["0"]["compared"] == -(-TOKENS[rid] // PAGE)
    status, one = diff(root, "--request", "req-b")
    assert status == 0 and list(one["requests"]) == ["req-b"]


def test_a_cell_changed_in_the_decode_pool_is_found_and_located(engines) -> None:
    root, (decode,) = engines
    # req-c token 41, layer 3, global head 6: one element of its K row in the decode pool.
    slot = int(decode.req_to_token.req_to_token[decode.rows["req-c"], 41])
    decode.pool.k_buffer[3][slot, 6, 2] += torch.tensor(1.0, dtype=decode.pool.dtype)
    status, report = diff(root)
    assert status == 1 and report["ok"] is False
    groups = {rid: r["groups"]["0"] for rid, r in report["requests"].items()}
    assert {rid: g["mismatched_positions"] for rid, g in groups.items()} == {
        "req-a": [],
        "req-b": [],
        "req-c": [41 // PAGE],
    }
    (entry,) = groups["req-c"]["located"]
    assert (entry["position"], entry["layer"], entry["head"], entry["tokens"]) == (
        41 // PAGE,
        NAME.format(i=3),
        6,
        [41],
    )
    assert report["diagnosis"][0]["request"] == "req-c"
