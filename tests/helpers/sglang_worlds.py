"""SGLang engines built from SGLang 0.5.23's own classes on the CPU, for the SGLang stage's
tests (tests/sglang): real ``MHATokenToKVPool``/``MLATokenToKVPool`` pools, pages from the
real ``PagedTokenToKVPoolAllocator`` (another order on each side, after other pages), rows
from ``ReqToTokenPool``, MHA KV written by the pool's own ``set_kv_buffer``; and the spec's
checksums of the KV written (``reference``), which the tests expect. Imports SGLang: only
the SGLang stage imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)

from helpers import reference as ref
from kvaudit import RequestBlocks, WorkerInfo
from kvaudit.checksum.checksummer import Checksummer
from kvaudit.description import parse_description
from kvaudit.integrations.sglang import (
    describe_sglang_cache,
    request_blocks,
    sglang_kv_heads,
    sglang_layer_caches,
)
from kvaudit.records.combining import combine_workers

PAGE = 16
LAYERS = 4
HEAD_DIM = 8
LORA, ROPE = 16, 8
DTYPE = torch.bfloat16
TOKENS = {"req-a": 37, "req-b": 21, "req-c": 50}  # none a multiple of the page size
NAME = "model.layers.{i}.self_attn.attn"


def global_kv(heads: int, seed: int) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per request and global layer: K and V ``[tokens, global heads, head_dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        rid: {
            layer: tuple(torch.randn(n, heads, HEAD_DIM, generator=gen).to(DTYPE) for _ in range(2))
            for layer in range(LAYERS)
        }
        for rid, n in TOKENS.items()
    }


def global_latent(seed: int) -> dict[str, dict[int, torch.Tensor]]:
    """Per request and global layer: the MLA latent ``[tokens, kv_lora_rank + rope]``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        rid: {
            layer: torch.randn(n, LORA + ROPE, generator=gen).to(DTYPE) for layer in range(LAYERS)
        }
        for rid, n in TOKENS.items()
    }


MHA_KV = global_kv(8, seed=1)
REPLICATED_KV = global_kv(2, seed=2)
LATENT = global_latent(3)


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


def allocate(workers: list[Worker], order: list[str], junk_pages: int, extra: int) -> None:
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


def mha_world(
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
    allocate(workers, order, junk, extra)
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


def mla_world(tp_size: int, order: list[str], junk: int) -> list[Worker]:
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
    allocate(workers, order, junk, 0)
    for worker in workers:
        for rid, row in worker.rows.items():
            loc = worker.req_to_token.req_to_token[row, : TOKENS[rid]].long()
            for layer_id in range(LAYERS):
                worker.pool.kv_buffer[layer_id][loc, 0] = LATENT[rid][layer_id]
    return workers


def record_of(workers: list[Worker], role: str):
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


def totals(record) -> dict[str, list[int]]:
    return {
        rid: [int(x) for x in request.groups[0].totals()]
        for rid, request in record.requests.items()
    }


def cells(k: torch.Tensor, v: torch.Tensor | None = None) -> np.ndarray:
    """A layer's cells ``[tokens, heads, bytes]``: the K row then the V row of each head."""
    cell = k if v is None else torch.cat([k, v], dim=-1)
    return cell.contiguous().view(torch.uint8).numpy()


def expected_mha(kv) -> dict[str, list[int]]:
    """The spec's block checksums over the global KV written (tests/helpers/reference)."""
    out = {}
    for rid, n in TOKENS.items():
        caches = tuple(
            ref.Layer(NAME.format(i=layer), cells(*kv[rid][layer])) for layer in range(LAYERS)
        )
        out[rid] = [int(x) for x in ref.total(ref.block_checksums(ref.Group(PAGE, caches), n))]
    return out


def expected_mla() -> dict[str, list[int]]:
    out = {}
    for rid, n in TOKENS.items():
        caches = tuple(
            ref.Layer(NAME.format(i=layer), cells(LATENT[rid][layer][:, None, :]))
            for layer in range(LAYERS)
        )
        out[rid] = [int(x) for x in ref.total(ref.block_checksums(ref.Group(PAGE, caches), n))]
    return out


ORDER_PREFILL = ["req-a", "req-b", "req-c"]
ORDER_DECODE = ["req-c", "req-a", "req-b"]
