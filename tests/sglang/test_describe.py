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
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from helpers import reference as ref
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from kvaudit import RequestBlocks, WorkerInfo
from kvaudit.checksum.checksummer import Checksummer
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
from kvaudit.records.combining import combine_workers

PAGE = 16
LAYERS = 4
HEAD_DIM = 8
LORA, ROPE = 16, 8
DTYPE = torch.bfloat16
TOKENS = {"req-a": 37, "req-b": 21, "req-c": 50}  # none a multiple of the page size
NAME = "model.layers.{i}.self_attn.attn"


def _global_kv(heads: int, seed: int) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per request and global layer: K and V ``[tokens, global heads, head_dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        rid: {
            layer: tuple(torch.randn(n, heads, HEAD_DIM, generator=gen).to(DTYPE) for _ in range(2))
            for layer in range(LAYERS)
        }
        for rid, n in TOKENS.items()
    }


def _global_latent(seed: int) -> dict[str, dict[int, torch.Tensor]]:
    """Per request and global layer: the MLA latent ``[tokens, kv_lora_rank + rope]``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        rid: {
            layer: torch.randn(n, LORA + ROPE, generator=gen).to(DTYPE) for layer in range(LAYERS)
        }
        for rid, n in TOKENS.items()
    }


MHA_KV = _global_kv(8, seed=1)
REPLICATED_KV = _global_kv(2, seed=2)
LATENT = _global_latent(3)


@dataclass
class Worker:
    """One SGLang worker: its pool, allocator, request rows and ranks."""

    pool: MHATokenToKVPool | MLATokenToKVPool
    allocator: PagedTokenToKVPoolAllocator
    req_to_token: ReqToTokenPool
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    total_kv_heads: int | None = None
    rows: dict[str, int] = field(default_factory=dict)

    def blocks(self, extra: int = 0) -> dict[str, RequestBlocks]:
        """Each request's blocks from its req_to_token row (``extra`` decoded tokens)."""
        table = self.req_to_token.req_to_token
        return {
            rid: request_blocks(table[row], TOKENS[rid] + extra, PAGE)
            for rid, row in self.rows.items()
        }

    def description(self) -> dict:
        return describe_sglang_cache(
            self.pool,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            total_kv_heads=self.total_kv_heads,
        )

    def worker_info(self, role: str, engine: str) -> WorkerInfo:
        return WorkerInfo(self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, role, engine)


def _allocate(workers: list[Worker], order: list[str], junk_pages: int, extra: int) -> None:
    """Pages from each worker's own allocator: ``junk_pages`` first, then one page at a
    time round-robin over the requests in ``order`` (so a request's pages are apart), and
    a row of each worker's ReqToTokenPool per request."""
    for worker in workers:
        worker.allocator.alloc(junk_pages * PAGE)
        needed = {rid: -(-(TOKENS[rid] + extra) // PAGE) for rid in order}
        slots: dict[str, list[torch.Tensor]] = {rid: [] for rid in order}
        while any(len(slots[rid]) < needed[rid] for rid in order):
            for rid in order:
                if len(slots[rid]) < needed[rid]:
                    page = worker.allocator.alloc(PAGE)
                    assert page is not None
                    slots[rid].append(page)
        for rid in order:
            (row,) = worker.req_to_token.alloc_rows(1)
            loc = torch.cat(slots[rid])[: TOKENS[rid] + extra]
            worker.req_to_token.write((row, slice(0, loc.numel())), loc.to(torch.int32))
            worker.rows[rid] = row


def _mha_world(
    tp_size: int, pp_size: int, total_heads: int, order: list[str], junk: int, extra: int = 0
) -> list[Worker]:
    """The workers of one engine with MHA pools, KV written through ``set_kv_buffer``."""
    kv = MHA_KV if total_heads == 8 else REPLICATED_KV
    per_stage = LAYERS // pp_size
    workers = []
    for pp_rank in range(pp_size):
        for tp_rank in range(tp_size):
            shard = sglang_kv_heads(tp_rank, tp_size, total_heads)
            pool = MHATokenToKVPool(
                size=PAGE * 24,
                page_size=PAGE,
                dtype=DTYPE,
                head_num=shard.count,
                head_dim=HEAD_DIM,
                layer_num=per_stage,
                device="cpu",
                enable_memory_saver=False,
                start_layer=pp_rank * per_stage,
                end_layer=(pp_rank + 1) * per_stage,
            )
            allocator = PagedTokenToKVPoolAllocator(
                size=PAGE * 24,
                page_size=PAGE,
                dtype=DTYPE,
                device="cpu",
                kvcache=pool,
                need_sort=False,
            )
            r2t = ReqToTokenPool(
                size=8, max_context_len=128, device="cpu", enable_memory_saver=False
            )
            workers.append(
                Worker(pool, allocator, r2t, tp_rank, tp_size, pp_rank, pp_size, total_heads)
            )
    _allocate(workers, order, junk, extra)
    for worker in workers:
        heads = sglang_kv_heads(worker.tp_rank, tp_size, total_heads)
        for rid, row in worker.rows.items():
            n = TOKENS[rid]
            loc = worker.req_to_token.req_to_token[row, :n].long()
            for layer_id in range(worker.pool.start_layer, worker.pool.start_layer + per_stage):
                k, v = kv[rid][layer_id]
                part = slice(heads.first, heads.first + heads.count)
                worker.pool.set_kv_buffer(
                    SimpleNamespace(layer_id=layer_id), loc, k[:, part], v[:, part]
                )
                if extra:  # a decoded token after the prompt, never the prefill's
                    slot = worker.req_to_token.req_to_token[row, n : n + extra].long()
                    junk_kv = torch.full((extra, heads.count, HEAD_DIM), 7.0, dtype=DTYPE)
                    worker.pool.set_kv_buffer(
                        SimpleNamespace(layer_id=layer_id), slot, junk_kv, junk_kv
                    )
    return workers


def _mla_world(tp_size: int, order: list[str], junk: int) -> list[Worker]:
    """The workers of one engine with MLA pools (every rank the whole latent), written
    into ``kv_buffer`` directly (MLA ``set_kv_buffer`` is a Triton kernel)."""
    workers = []
    for tp_rank in range(tp_size):
        pool = MLATokenToKVPool(
            size=PAGE * 24,
            page_size=PAGE,
            dtype=DTYPE,
            kv_lora_rank=LORA,
            qk_rope_head_dim=ROPE,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        allocator = PagedTokenToKVPoolAllocator(
            size=PAGE * 24,
            page_size=PAGE,
            dtype=DTYPE,
            device="cpu",
            kvcache=pool,
            need_sort=False,
        )
        r2t = ReqToTokenPool(size=8, max_context_len=128, device="cpu", enable_memory_saver=False)
        workers.append(Worker(pool, allocator, r2t, tp_rank, tp_size))
    _allocate(workers, order, junk, 0)
    for worker in workers:
        for rid, row in worker.rows.items():
            loc = worker.req_to_token.req_to_token[row, : TOKENS[rid]].long()
            for layer_id in range(LAYERS):
                worker.pool.kv_buffer[layer_id][loc, 0] = LATENT[rid][layer_id]
    return workers


def _record(workers: list[Worker], role: str):
    """The engine's record: each worker checksummed by kvaudit, the workers combined."""
    records = []
    for worker in workers:
        description = parse_description(worker.description(), "sglang")
        checksummer = Checksummer(
            description,
            sglang_layer_caches(worker.pool),
            tp_rank=worker.tp_rank,
            tp_size=worker.tp_size,
            pp_rank=worker.pp_rank,
            pp_size=worker.pp_size,
            role=role,
        )
        assert checksummer.not_covered == {}
        records.append(checksummer.checksum(worker.blocks()))
    return combine_workers(records)


def _totals(record) -> dict[str, list[int]]:
    return {
        rid: [int(x) for x in request.groups[0].totals()]
        for rid, request in record.requests.items()
    }


def _cells(k: torch.Tensor, v: torch.Tensor | None = None) -> np.ndarray:
    """A layer's cells ``[tokens, heads, bytes]``: the K row then the V row of each head."""
    cell = k if v is None else torch.cat([k, v], dim=-1)
    return cell.contiguous().view(torch.uint8).numpy()


def _expected_mha(kv) -> dict[str, list[int]]:
    """The spec's block checksums over the global KV written (tests/helpers/reference)."""
    out = {}
    for rid, n in TOKENS.items():
        caches = tuple(
            ref.Layer(NAME.format(i=layer), _cells(*kv[rid][layer])) for layer in range(LAYERS)
        )
        out[rid] = [int(x) for x in ref.total(ref.block_checksums(ref.Group(PAGE, caches), n))]
    return out


def _expected_mla() -> dict[str, list[int]]:
    out = {}
    for rid, n in TOKENS.items():
        caches = tuple(
            ref.Layer(NAME.format(i=layer), _cells(LATENT[rid][layer][:, None, :]))
            for layer in range(LAYERS)
        )
        out[rid] = [int(x) for x in ref.total(ref.block_checksums(ref.Group(PAGE, caches), n))]
    return out


ORDER_PREFILL = ["req-a", "req-b", "req-c"]
ORDER_DECODE = ["req-c", "req-a", "req-b"]


@pytest.fixture(scope="module")
def engines() -> dict[str, list[Worker]]:
    return {
        "tp2": _mha_world(2, 1, 8, ORDER_PREFILL, junk=1),
        "pp2": _mha_world(1, 2, 8, ORDER_DECODE, junk=3),
        "decode": _mha_world(1, 1, 8, ORDER_DECODE, junk=5, extra=1),
    }


def test_description_from_real_pools() -> None:
    (rank1,) = _mha_world(2, 1, 8, ORDER_PREFILL, junk=0)[1:]
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
    stage1 = _mha_world(1, 2, 8, ORDER_PREFILL, junk=0)[1]
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
    pool = _mha_world(2, 1, 8, ORDER_PREFILL, junk=0)[0].pool
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
    with pytest.raises(NotDescribable, match="SWAKVPool is not described yet"):
        describe_sglang_cache(swa)
    # Padding page 0 and slots out of their page's place are not a request's blocks.
    with pytest.raises(NotDescribable, match="padding page 0"):
        request_blocks(torch.zeros(20, dtype=torch.int32), 20, PAGE)
    with pytest.raises(NotDescribable, match="token 1 lies in slot 40"):
        request_blocks(torch.tensor([32, 40, 34]), 3, PAGE)


def test_tp2_pp2_prefill_and_tp1_decode_agree_with_the_spec(engines) -> None:
    expected = _expected_mha(MHA_KV)
    assert [len(v) for v in expected.values()] == [3, 2, 4]
    tp2 = _totals(_record(engines["tp2"], "producer"))
    pp2 = _totals(_record(engines["pp2"], "producer"))
    decode = _totals(_record(engines["decode"], "consumer"))
    assert tp2 == expected
    assert pp2 == expected
    assert decode == expected
    # The sides really hold the requests in other pages.
    tp2_pages = engines["tp2"][0].blocks()["req-a"].groups[0][1]
    decode_pages = engines["decode"][0].blocks()["req-a"].groups[0][1]
    assert tp2_pages != decode_pages


def test_replicated_heads_tp4_prefill_agrees_with_tp1_decode() -> None:
    # 2 KV heads over 4 TP ranks: each head on 2 ranks; the producer sends replica 0.
    prefill = _mha_world(4, 1, 2, ORDER_PREFILL, junk=2)
    assert [w.pool.head_num for w in prefill] == [1, 1, 1, 1]
    decode = _mha_world(1, 1, 2, ORDER_DECODE, junk=4)
    expected = _expected_mha(REPLICATED_KV)
    prefill_record = _record(prefill, "producer")
    assert _totals(prefill_record) == expected
    decode_record = _record(decode, "consumer")
    assert _totals(decode_record) == expected
    assert compare_records(prefill_record, decode_record).ok
    # As a consumer too, every replica column equals replica 0's.
    assert compare_records(decode_record, _record(prefill, "consumer")).ok


def test_mla_tp2_prefill_agrees_with_tp1_decode() -> None:
    prefill = _mla_world(2, ORDER_PREFILL, junk=1)
    decode = _mla_world(1, ORDER_DECODE, junk=3)
    description = prefill[1].description()
    assert description["groups"][0]["spec"]["type"] == "mla"
    assert description["groups"][0]["spec"]["head_size"] == LORA + ROPE
    expected = _expected_mla()
    assert _totals(_record(prefill, "producer")) == expected
    assert _totals(_record(decode, "consumer")) == expected


def test_planted_faults_are_found_at_their_block(engines) -> None:
    prefill = _record(engines["tp2"], "producer")
    # One token's cell of one head of one layer on a fresh decode.
    decode = _mha_world(1, 1, 8, ORDER_DECODE, junk=5)
    (worker,) = decode
    slot = int(worker.req_to_token.req_to_token[worker.rows["req-b"], 19])
    worker.pool.k_buffer[2][slot, 5, 0] += 1.0
    report = compare_records(prefill, _record(decode, "consumer"))
    mismatched = {rid: list(g.mismatched_positions) for rid, _, g in report.groups()}
    assert mismatched == {"req-a": [], "req-b": [1], "req-c": []}  # token 19: page 1
    # A page of another request: req-a's third page holds req-c's first.
    decode = _mha_world(1, 1, 8, ORDER_DECODE, junk=5)
    (worker,) = decode
    table = worker.req_to_token.req_to_token
    table[worker.rows["req-a"], 32:37] = table[worker.rows["req-c"], 0:5]
    report = compare_records(prefill, _record(decode, "consumer"))
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
    decode = _mha_world(1, 1, 8, ORDER_DECODE, junk=5, extra=1)
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
    worker = _mha_world(2, 1, 8, ORDER_PREFILL, junk=0)[1]
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
