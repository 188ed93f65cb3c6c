"""kvaudit's cache description of SGLang's real KV pools, and its checksums of requests
whose KV SGLang's own pools hold, agreeing across a TP=2 prefill, a PP=2 prefill and a
TP=1 decode (docs/sglang.md).

Every pool, allocator and request row is SGLang 0.5.23's own class on the CPU: pages come
from ``PagedTokenToKVPoolAllocator`` (in another order on each side, after other pages),
rows from ``ReqToTokenPool``, MHA KV is written by the pool's own ``set_kv_buffer``. The
expected values come from the global KV the test wrote, through ``tests/helpers/
reference.py`` (the spec in plain numpy), never from kvaudit's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from helpers.sglang_worlds import (
    DTYPE,
    HEAD_DIM,
    LAYERS,
    LORA,
    MHA_KV,
    NAME,
    ORDER_DECODE,
    ORDER_PREFILL,
    PAGE,
    REPLICATED_KV,
    ROPE,
    Worker,
    expected_mha,
    expected_mla,
    mha_world,
    mla_world,
    record_of,
    totals,
)
from sglang.srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from kvaudit.cli import main
from kvaudit.compare import compare_records
from kvaudit.description import load_description, parse_description
from kvaudit.dumps import write_dump
from kvaudit.integrations.sglang import (
    NotDescribable,
    describe_sglang_cache,
    request_blocks,
    sglang_kv_heads,
    sglang_layer_caches,
    write_cache_yaml,
)


@pytest.fixture(scope="module")
def engines() -> dict[str, list[Worker]]:
    return {
        "tp2": mha_world(2, 1, 8, ORDER_PREFILL, junk=1),
        "pp2": mha_world(1, 2, 8, ORDER_DECODE, junk=3),
        "decode": mha_world(1, 1, 8, ORDER_DECODE, junk=5, extra=1),
    }


def test_description_from_real_pools() -> None:
    (rank1,) = mha_world(2, 1, 8, ORDER_PREFILL, junk=0)[1:]
    description = rank1.description()
    assert description["num_blocks"] == 25  # 24 pages + padding page 0
    assert description["model_kv_heads"] == 8
    (group,) = description["groups"]
    assert group["spec"] == {
        "block_size": PAGE,
        "kernel_block_size": PAGE,
        "dtype": "bfloat16",
        "type": "full_attention",
        "num_kv_heads": 4,
        "head_size": HEAD_DIM,
        "head_size_v": HEAD_DIM,
        "layout": "NTHD",
    }
    assert group["layers"] == [NAME.format(i=i) for i in range(LAYERS)]
    parse_description(description, "sglang")
    # The tensors are views of SGLang's own buffers, page p = slots p*PAGE .. p*PAGE+15.
    caches = sglang_layer_caches(rank1.pool)
    k, v = caches[NAME.format(i=2)]
    assert k.shape == (25, PAGE, 4, HEAD_DIM)
    assert k.data_ptr() == rank1.pool.k_buffer[2].data_ptr()
    assert v.data_ptr() == rank1.pool.v_buffer[2].data_ptr()
    slot = int(rank1.req_to_token.req_to_token[rank1.rows["req-b"], 20])
    assert torch.equal(k[slot // PAGE, slot % PAGE], MHA_KV["req-b"][2][0][20, 4:8])

    # PP: the second stage's names carry the global layer ids from start_layer.
    stage1 = mha_world(1, 2, 8, ORDER_PREFILL, junk=0)[1]
    layers = stage1.description()["groups"][0]["layers"]
    assert layers == [NAME.format(i=2), NAME.format(i=3)]
    names = {2: "model.layers.2.attn", 3: "model.layers.3.attn"}
    named = describe_sglang_cache(stage1.pool, names=names)
    assert named["groups"][0]["layers"] == list(names.values())

    # Blocks are the pages of the row, in token order.
    row = rank1.req_to_token.req_to_token[rank1.rows["req-a"]]
    blocks = request_blocks(row, 37, PAGE)
    assert blocks.num_tokens == 37
    assert blocks.groups[0] == (0, [int(row[t]) // PAGE for t in (0, 16, 32)])


def test_heads_as_sglang_places_them() -> None:
    shard = sglang_kv_heads(1, 2, 8)
    assert (shard.first, shard.count, shard.replicas) == (4, 4, 1)
    # tp > heads: one head per rank, tp // heads ranks hold each.
    placed = [sglang_kv_heads(r, 4, 2) for r in range(4)]
    assert [(s.first, s.count, s.replicas) for s in placed] == [(0, 1, 2)] * 2 + [(1, 1, 2)] * 2
    with pytest.raises(NotDescribable, match="do not divide TP size 4"):
        sglang_kv_heads(0, 4, 3)
    pool = mha_world(2, 1, 8, ORDER_PREFILL, junk=0)[0].pool
    with pytest.raises(NotDescribable, match="SGLang places 2 on rank 0 of 4"):
        describe_sglang_cache(pool, tp_rank=0, tp_size=4, total_kv_heads=8)
    with pytest.raises(NotDescribable, match="total_kv_heads is needed"):
        describe_sglang_cache(pool, tp_rank=0, tp_size=2)


def test_other_layouts_and_pools_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")  # SGLang's switch to [pages, H, page, D]
    hnd = MHATokenToKVPool(
        size=PAGE * 4,
        page_size=PAGE,
        dtype=DTYPE,
        head_num=2,
        head_dim=HEAD_DIM,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    monkeypatch.delenv("SGLANG_USE_HND_KVCACHE")
    assert tuple(hnd.k_buffer[0].shape) == (5, 2, PAGE, HEAD_DIM)
    with pytest.raises(NotDescribable, match=r"^MHATokenToKVPool layout 'hnd' is not described"):
        describe_sglang_cache(hnd)
    swa = SWAKVPool(
        size=PAGE * 8,
        size_swa=PAGE * 4,
        page_size=PAGE,
        dtype=DTYPE,
        head_num=2,
        head_dim=HEAD_DIM,
        swa_attention_layer_ids=[0],
        full_attention_layer_ids=[1],
        device="cpu",
    )
    # Described with its window (tests/sglang/test_hybrid.py); never without it.
    with pytest.raises(NotDescribable, match="an SWAKVPool needs its sliding window"):
        describe_sglang_cache(swa)
    # Padding page 0 and slots out of their page's place are not a request's blocks.
    with pytest.raises(NotDescribable, match="padding page 0"):
        request_blocks(torch.zeros(20, dtype=torch.int32), 20, PAGE)
    with pytest.raises(NotDescribable, match="token 1 lies in slot 40"):
        request_blocks(torch.tensor([32, 40, 34]), 3, PAGE)


def test_tp2_pp2_prefill_and_tp1_decode_agree_with_the_spec(engines) -> None:
    expected = expected_mha(MHA_KV)
    assert [len(v) for v in expected.values()] == [3, 2, 4]
    tp2 = totals(record_of(engines["tp2"], "producer"))
    pp2 = totals(record_of(engines["pp2"], "producer"))
    decode = totals(record_of(engines["decode"], "consumer"))
    assert tp2 == expected
    assert pp2 == expected
    assert decode == expected
    # The sides really hold the requests in other pages.
    tp2_pages = engines["tp2"][0].blocks()["req-a"].groups[0][1]
    decode_pages = engines["decode"][0].blocks()["req-a"].groups[0][1]
    assert tp2_pages != decode_pages


def test_replicated_heads_tp4_prefill_agrees_with_tp1_decode() -> None:
    # 2 KV heads over 4 TP ranks: each head on 2 ranks; the producer sends replica 0.
    prefill = mha_world(4, 1, 2, ORDER_PREFILL, junk=2)
    assert [w.pool.head_num for w in prefill] == [1, 1, 1, 1]
    decode = mha_world(1, 1, 2, ORDER_DECODE, junk=4)
    expected = expected_mha(REPLICATED_KV)
    prefill_record = record_of(prefill, "producer")
    assert totals(prefill_record) == expected
    decode_record = record_of(decode, "consumer")
    assert totals(decode_record) == expected
    assert compare_records(prefill_record, decode_record).ok
    # As a consumer too, every replica column equals replica 0's.
    assert compare_records(decode_record, record_of(prefill, "consumer")).ok


def test_mla_tp2_prefill_agrees_with_tp1_decode() -> None:
    prefill = mla_world(2, ORDER_PREFILL, junk=1)
    decode = mla_world(1, ORDER_DECODE, junk=3)
    description = prefill[1].description()
    assert description["groups"][0]["spec"]["type"] == "mla"
    assert description["groups"][0]["spec"]["head_size"] == LORA + ROPE
    expected = expected_mla()
    assert totals(record_of(prefill, "producer")) == expected
    assert totals(record_of(decode, "consumer")) == expected


def test_planted_faults_are_found_at_their_block(engines) -> None:
    prefill = record_of(engines["tp2"], "producer")
    # One token's cell of one head of one layer on a fresh decode.
    decode = mha_world(1, 1, 8, ORDER_DECODE, junk=5)
    (worker,) = decode
    slot = int(worker.req_to_token.req_to_token[worker.rows["req-b"], 19])
    worker.pool.k_buffer[2][slot, 5, 0] += 1.0
    report = compare_records(prefill, record_of(decode, "consumer"))
    mismatched = {rid: list(g.mismatched_positions) for rid, _, g in report.groups()}
    assert mismatched == {"req-a": [], "req-b": [1], "req-c": []}  # token 19: page 1
    # A page of another request: req-a's third page holds req-c's first.
    decode = mha_world(1, 1, 8, ORDER_DECODE, junk=5)
    (worker,) = decode
    table = worker.req_to_token.req_to_token
    table[worker.rows["req-a"], 32:37] = table[worker.rows["req-c"], 0:5]
    report = compare_records(prefill, record_of(decode, "consumer"))
    mismatched = {rid: list(g.mismatched_positions) for rid, _, g in report.groups()}
    assert mismatched == {"req-a": [2], "req-b": [], "req-c": []}


def _dump(workers: list[Worker], folder: Path, role: str, engine: str, extra: int = 0) -> None:
    folder.mkdir()
    for worker in workers:
        description = parse_description(worker.description(), engine)
        write_dump(
            folder / f"tp{worker.tp_rank}-pp{worker.pp_rank}.safetensors",
            description,
            sglang_layer_caches(worker.pool),
            worker.blocks(extra),
            worker=worker.worker_info(role, engine),
        )


def test_dumps_from_pools_and_kvaudit_diff_locate_the_fault(engines, tmp_path: Path) -> None:
    _dump(engines["tp2"], tmp_path / "prefill", "producer", "SGLang prefill")
    _dump(engines["pp2"], tmp_path / "prefill_pp", "producer", "SGLang prefill")
    decode = mha_world(1, 1, 8, ORDER_DECODE, junk=5, extra=1)
    (worker,) = decode
    # The decode holds one decoded token past each prompt; the diff compares the prompt.
    _dump(decode, tmp_path / "decode", "consumer", "SGLang decode", extra=1)
    runner = CliRunner()

    def diff(producer: str, consumer: str) -> tuple[int, dict]:
        result = runner.invoke(
            main, ["diff", str(tmp_path / producer), str(tmp_path / consumer), "--format", "json"]
        )
        return result.exit_code, json.loads(result.output)

    for producer in ("prefill", "prefill_pp"):
        code, report = diff(producer, "decode")
        assert (code, report["ok"]) == (0, True), report
        assert report["requests"]["req-a"]["num_tokens"] == {"producer": 37, "consumer": 38}

    slot = int(worker.req_to_token.req_to_token[worker.rows["req-c"], 41])
    worker.pool.k_buffer[3][slot, 6, 2] += 2.0  # layer 3, global head 6, token 41
    _dump(decode, tmp_path / "decode_bad", "consumer", "SGLang decode", extra=1)
    code, report = diff("prefill", "decode_bad")
    assert code == 1 and not report["ok"]
    groups = {rid: r["groups"]["0"] for rid, r in report["requests"].items()}
    assert {rid: g["mismatched_positions"] for rid, g in groups.items()} == {
        "req-a": [],
        "req-b": [],
        "req-c": [2],
    }
    (located,) = groups["req-c"]["located"]
    assert (located["position"], located["layer"], located["head"], located["tokens"]) == (
        2,
        NAME.format(i=3),
        6,
        [41],
    )


def test_write_cache_yaml(tmp_path: Path) -> None:
    worker = mha_world(2, 1, 8, ORDER_PREFILL, junk=0)[1]
    path = tmp_path / "cache.yaml"
    raw = describe_sglang_cache(worker.pool, tp_rank=1, tp_size=2, total_kv_heads=8)
    written = write_cache_yaml(path, raw)
    assert yaml.safe_load(path.read_text()) == written
    loaded = load_description(path)
    assert loaded == parse_description(worker.description(), str(path))
    assert [entry.name for entry in loaded.groups[0].layers] == [
        NAME.format(i=i) for i in range(LAYERS)
    ]
    assert loaded.groups[0].spec.layout == "NTHD" and loaded.model_kv_heads == 8
