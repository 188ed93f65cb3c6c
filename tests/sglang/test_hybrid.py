"""SGLang 0.5.23's hybrid pools described, checksummed and served ``live:`` by kvaudit
(docs/sglang.md, "Hybrid pools"): a real ``SWAKVPool`` (its window pool a group of its
own, in its own block space) and a real ``HybridLinearKVPool`` (its ``MambaPool``'s
states a state group, one block per state slot, rows split as SGLang slices them), built
by examples/sglang_cpu/pd_world.py; a TP=2 prefill's and a TP=1 decode's pools compared
by the ``kvaudit`` command as running engines, a planted fault located by group.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.sglang_expected import expected_group_sums
from pd_world import CONV_GROUPS, HEADS, REQUESTS, STATE_HEADS, WINDOW, World

from kvaudit.checksum.checksummer import Checksummer
from kvaudit.cli import main
from kvaudit.description import parse_description
from kvaudit.integrations.sglang import NotDescribable, describe_sglang_cache, sglang_agent
from kvaudit.integrations.sglang.describe import STATE_BLOCK_TOKENS, sglang_layer_caches
from kvaudit.integrations.sglang.pages import pool_request_blocks
from kvaudit.live import socket_path

ORDER = ["req-ok", "req-bad", "req-prefix"]


def world(kind: str, tp_rank: int, tp_size: int, junk: int, **faults: str) -> World:
    return World(tp_rank, tp_size, ORDER, junk, kind=kind, faults=faults)


def describe(w: World, tp_size: int, kind: str) -> dict:
    return describe_sglang_cache(
        w.pool,
        tp_rank=w.shard.first // w.shard.count if tp_size > 1 else 0,
        tp_size=tp_size,
        total_kv_heads=HEADS,
        sliding_window=WINDOW if kind == "swa" else None,
    )


def test_swa_pool_described_with_its_window_pool_as_a_group(tp1_decode) -> None:
    w = world("swa", 1, 2, 3)
    raw = describe(w, 2, "swa")
    full, window = raw["groups"]
    assert raw["num_blocks"] == 33 and window["num_blocks"] == 17  # size / page + padding
    assert (full["id"], full["spec"]["type"], full["layers"]) == (
        0,
        "full_attention",
        ["model.layers.0.self_attn.attn"],
    )
    assert (window["id"], window["spec"]["type"], window["spec"]["sliding_window"]) == (
        1,
        "sliding_window",
        WINDOW,
    )
    assert window["layers"] == ["model.layers.1.self_attn.attn"]
    assert window["spec"]["num_kv_heads"] == HEADS // 2
    with pytest.raises(NotDescribable, match="needs its sliding window"):
        describe_sglang_cache(w.pool, tp_rank=1, tp_size=2, total_kv_heads=HEADS)


def test_linear_pool_described_with_its_mamba_states_as_a_state_group(tp1_decode) -> None:
    w = world("linear", 0, 2, 3)
    raw = describe(w, 2, "linear")
    full, state = raw["groups"]
    assert full["layers"] == ["model.layers.0.self_attn.attn"]
    assert state["num_blocks"] == w.pool.mamba_pool.size + 1
    assert state["spec"]["type"] == "mamba"
    assert state["spec"]["block_size"] == STATE_BLOCK_TOKENS
    conv, temporal = state["layers"]
    assert conv["name"] == "model.layers.1.linear_attn.conv"
    assert conv["spec"]["state_splits"] == [
        {"axis": 0, "segments": [[rows // 2, 1] for rows in CONV_GROUPS]}
    ]
    assert temporal["name"] == "model.layers.1.linear_attn.temporal"
    assert temporal["spec"]["dtypes"] == ["float32"]
    assert temporal["spec"]["state_splits"] == [{"axis": 0, "segments": [[STATE_HEADS // 2, 1]]}]


@pytest.mark.parametrize("kind", ["swa", "linear"])
def test_tp2_ranks_sum_to_the_spec_per_group(kind, tp1_decode) -> None:
    """Each TP=2 rank's checksums of each group, summed, are the spec's (the reference's
    computation over the global KV and states), from the request's prefix on."""
    sums = {0: 0, 1: 0}
    for tp_rank in range(2):
        w = world(kind, tp_rank, 2, 2 + tp_rank)
        raw = describe(w, 2, kind)
        description = parse_description(raw, "sglang")
        checksummer = Checksummer(
            description, sglang_layer_caches(w.pool), tp_rank=tp_rank, tp_size=2
        )
        assert checksummer.not_covered == {}
        n, prefix = REQUESTS["req-prefix"]
        blocks = pool_request_blocks(
            w.pool,
            w.req_to_token,
            w.rows["req-prefix"],
            prefix,
            n,
            sliding_window=WINDOW,
        )
        record = checksummer.checksum({"req-prefix": blocks})
        for group, checksums in record.requests["req-prefix"].groups.items():
            sums[group] += int(checksums.values.sum(dtype="uint64")) % (1 << 64)
    expected = expected_group_sums("req-prefix", REQUESTS["req-prefix"][1], kind)
    assert {g: v % (1 << 64) for g, v in sums.items()} == expected


def serve(worlds: list[World], kind: str, root: Path, engine: str, role: str) -> list:
    tp_size = len(worlds)
    return [
        sglang_agent(
            socket_path(engine, 0, tp_rank, str(root)),
            w.pool,
            w.req_to_token,
            lambda w=w: {rid: (row, REQUESTS[rid][0]) for rid, row in w.rows.items()},
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_kv_heads=HEADS,
            role=role,
            engine=engine,
            sliding_window=WINDOW if kind == "swa" else None,
            lock=threading.Lock(),
        )
        for tp_rank, w in enumerate(worlds)
    ]


@pytest.mark.parametrize(
    ("kind", "fault", "position", "layer"),
    [
        ("swa", "stale-window", 1, "model.layers.1.self_attn.attn"),
        ("linear", "contiguous-state", 0, "model.layers.1.linear_attn.conv"),
    ],
)
def test_live_engines_locate_a_fault_by_group(kind, fault, position, layer, tp1_decode, tmp_path):
    """A TP=2 prefill and a TP=1 decode served ``live:``: the intact requests agree in
    both groups; the faulty one differs in group 1 only, located at its layer."""
    root = tmp_path / "run"
    prefill = [world(kind, r, 2, 1 + r) for r in range(2)]
    decode = [world(kind, 0, 1, 4, **{"req-bad": fault})]
    agents = serve(prefill, kind, root, "prefill", "producer")
    agents += serve(decode, kind, root, "decode", "consumer")
    try:
        result = CliRunner().invoke(
            main,
            [
                *("diff", f"live:{root / 'prefill'}", f"live:{root / 'decode'}"),
                *("--format", "json", "--device", "cpu"),
            ],
        )
    finally:
        for agent in agents:
            agent.close()
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    for rid, request in report["requests"].items():
        groups = request["groups"]
        assert groups["0"]["mismatched_positions"] == [], rid
        assert groups["1"]["mismatched_positions"] == ([position] if rid == "req-bad" else [])
    located = report["requests"]["req-bad"]["groups"]["1"]["located"]
    assert {entry["layer"] for entry in located} == {layer}
