"""A prefill/decode transfer through SGLang 0.5.23's own disaggregation code on the CPU,
for docs/sglang.md's walk-through (``walkthrough.py``) and the SGLang stage's inline tests
(tests/sglang/test_inline*.py), which drive it: each rank's real pool,
allocator, request rows and metadata buffers (``World``), a prefill rank's real
``send_kv_chunk`` of every request's last chunk (``prefill_rank``, a spawned process), the
aux rows moved as a transfer backend moves them (``aux_rows``, ``receive_aux``), and a
decode rank's real ``DecodeTransferQueue`` and checks (``Decode``). A whole SGLang
scheduler does not run on the CPU: the scheduler is a plain object holding what these
real methods read, SGLang's CUDA Adler-32 digest is zlib's, and the metadata rows are
copied as Mooncake's ``send_aux`` copies them (tests/sglang/test_inline.py's docstring
lists every stand-in). Imports SGLang: run it in the SGLang environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import zlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import MethodType, SimpleNamespace

import numpy as np
import torch
from sglang.srt.disaggregation import decode as sglang_decode
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.decode import (
    DecodeRequest,
    DecodeTransferQueue,
    SchedulerDisaggregationDecodeMixin,
)
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
from sglang.srt.disaggregation.utils import (
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    kv_layout_signature,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    HybridReqToTokenPool,
    KVWriteLoc,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.plugins.hook_registry import HookRegistry

from kvaudit.integrations.sglang import inline, plugin, sglang_kv_heads

PAGE = 16
LAYERS = 2
HEADS = 4  # model KV heads; 2 per prefill rank
HEAD_DIM = 8
DTYPE = torch.bfloat16
NAME = "model.layers.{i}.self_attn.attn"
LORA, ROPE = 16, 8  # an MLA pool's latent row: kv_lora_rank + qk_rope_head_dim
# rid: (tokens, decode prefix). None a multiple of the page size.
REQUESTS = {
    "req-plain": (21, 0),  # sent first, before the hooks are installed: no kvaudit
    "req-ok": (37, 0),
    "req-bad": (40, 0),
    "req-prefix": (50, 16),
    "HEALTH_CHECK_1": (17, 0),
}
CHANGED = ("req-bad", 1, 2, 33)  # the decode's corrupted cell: layer 1, head 2, token 33
HOOKED = {"send_kv_chunk", "_commit_transfer_to_req", "_verify_kv_checksums"}
HYBRID = ("swa", "linear")
"""Hybrid pool kinds: ``swa`` (an ``SWAKVPool``: layer 0 full attention, layer 1 a
``WINDOW``-token window in its own pool) and ``linear`` (a ``HybridLinearKVPool``: layer 0
full attention, layer 1 a GatedDeltaNet-like Mamba layer whose states live in the
``HybridReqToTokenPool``'s ``MambaPool``, one slot per request)."""
WINDOW = 20
# The Mamba layer: conv state cat(q, k, v) of 16 + 16 + 32 rows (each sub-block sharded on
# its own across TP), 3 taps; temporal state [4 heads, 8, 8].
KEY_DIM, VALUE_DIM, CONV_TAPS, STATE_HEADS, STATE_DIM = 16, 32, 3, 4, 8
CONV_GROUPS = (KEY_DIM, KEY_DIM, VALUE_DIM)
STATE_NAME = "model.layers.{i}.linear_attn.{state}"


def state_of(rid: str, temporal_dtype: torch.dtype = torch.float32):
    """The request's global Mamba state after its prompt: conv ``[64, 3]`` (bf16) and
    temporal ``[4, 8, 8]``."""
    gen = torch.Generator().manual_seed(200 + sorted(REQUESTS).index(rid))
    conv = torch.randn(sum(CONV_GROUPS), CONV_TAPS, generator=gen).to(DTYPE)
    temporal = torch.randn(STATE_HEADS, STATE_DIM, STATE_DIM, generator=gen).to(temporal_dtype)
    return conv, temporal


def rank_state(state, tp_rank: int, tp_size: int, contiguous: bool = False):
    """TP rank ``tp_rank``'s part of a global state, as SGLang shards it: each q/k/v
    sub-block of the conv state on its own (``contiguous``: one contiguous slice instead,
    the fault of a transfer that ignores ``conv_shard_groups``)."""
    conv, temporal = state
    if contiguous:
        rows = conv.shape[0] // tp_size
        part = conv[tp_rank * rows : (tp_rank + 1) * rows]
    else:
        parts, first = [], 0
        for size in CONV_GROUPS:
            local = size // tp_size
            parts.append(conv[first + tp_rank * local : first + (tp_rank + 1) * local])
            first += size
        part = torch.cat(parts)
    heads = STATE_HEADS // tp_size
    return part, temporal[tp_rank * heads : (tp_rank + 1) * heads]


def hybrid_pools(kind: str, tp_size: int, heads: int, page: int, temporal_dtype: torch.dtype):
    """A hybrid kind's real pool, allocator and request rows on the CPU."""
    from sglang.srt.configs.mamba_utils import (
        Mamba2CacheParams,
        Mamba2StateDType,
        Mamba2StateShape,
    )
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if kind == "swa":
        pool = SWAKVPool(
            size=page * 32,
            size_swa=page * 16,
            page_size=page,
            dtype=DTYPE,
            head_num=heads,
            head_dim=HEAD_DIM,
            swa_attention_layer_ids=[1],
            full_attention_layer_ids=[0],
            device="cpu",
        )
        allocator = SWATokenToKVPoolAllocator(
            size=page * 32,
            size_swa=page * 16,
            page_size=page,
            dtype=DTYPE,
            device="cpu",
            kvcache=pool,
            need_sort=False,
        )
        r2t = ReqToTokenPool(size=8, max_context_len=128, device="cpu", enable_memory_saver=False)
        return pool, allocator, r2t
    shape = Mamba2StateShape.create(
        tp_world_size=tp_size,
        intermediate_size=VALUE_DIM,
        n_groups=KEY_DIM // STATE_DIM,
        num_heads=STATE_HEADS,
        head_dim=STATE_DIM,
        state_size=STATE_DIM,
        conv_kernel=CONV_TAPS + 1,
        conv_shard_groups=list(CONV_GROUPS),
    )
    params = Mamba2CacheParams(
        shape=shape,
        layers=[1],
        dtype=Mamba2StateDType(conv=DTYPE, temporal=temporal_dtype),
    )
    r2t = HybridReqToTokenPool(
        size=8,
        mamba_size=8,
        mamba_spec_state_size=8,
        max_context_len=128,
        device="cpu",
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=[1],
        enable_mamba_extra_buffer=False,
    )
    pool = HybridLinearKVPool(
        size=page * 32,
        dtype=DTYPE,
        page_size=page,
        head_num=heads,
        head_dim=HEAD_DIM,
        full_attention_layer_ids=[0],
        device="cpu",
        mamba_pool=r2t.mamba_pool,
    )
    allocator = PagedTokenToKVPoolAllocator(
        size=page * 32, page_size=page, dtype=DTYPE, device="cpu", kvcache=pool, need_sort=False
    )
    return pool, allocator, r2t


def register_inline() -> None:
    """kvaudit's plug-in entry point with inline verification turned on, as a user turns
    it on (``KVAUDIT_SGLANG_INLINE=1``)."""
    os.environ["KVAUDIT_SGLANG_INLINE"] = "1"
    try:
        plugin.register()
    finally:
        del os.environ["KVAUDIT_SGLANG_INLINE"]


def kv_of(rid: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The request's global K and V ``[tokens, HEADS, HEAD_DIM]`` per layer."""
    gen = torch.Generator().manual_seed(sorted(REQUESTS).index(rid) + 1)
    n = REQUESTS[rid][0]
    return {
        layer: tuple(torch.randn(n, HEADS, HEAD_DIM, generator=gen).to(DTYPE) for _ in range(2))
        for layer in range(LAYERS)
    }


def latent_of(rid: str) -> dict[int, torch.Tensor]:
    """The request's MLA latent rows ``[tokens, LORA + ROPE]`` per layer."""
    gen = torch.Generator().manual_seed(100 + sorted(REQUESTS).index(rid))
    n = REQUESTS[rid][0]
    return {layer: torch.randn(n, LORA + ROPE, generator=gen).to(DTYPE) for layer in range(LAYERS)}


class World:
    """One rank's real pool, allocator, request rows and metadata buffers, the requests'
    KV written through the pool's own ``set_kv_buffer`` (this rank's heads only); with
    ``kind="mla"`` an ``MLATokenToKVPool`` whose latent rows (every rank all of them) are
    written into ``kv_buffer`` directly (MLA ``set_kv_buffer`` is a Triton kernel)."""

    def __init__(
        self,
        tp_rank: int,
        tp_size: int,
        order: list[str],
        junk: int,
        page: int = PAGE,
        layers: tuple[int, int] = (0, LAYERS),
        kind: str = "mha",
        faults: dict[str, str] | None = None,
        temporal_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.shard = sglang_kv_heads(tp_rank, tp_size, HEADS)
        self.layers = layers
        self.kind = kind
        if kind in HYBRID:
            self._hybrid(tp_rank, tp_size, order, junk, page, faults or {}, temporal_dtype)
            return
        common = dict(
            size=page * 32,
            page_size=page,
            dtype=DTYPE,
            layer_num=layers[1] - layers[0],
            device="cpu",
            enable_memory_saver=False,
            start_layer=layers[0],
            end_layer=layers[1],
        )
        if kind == "mla":
            self.pool = MLATokenToKVPool(kv_lora_rank=LORA, qk_rope_head_dim=ROPE, **common)
        else:
            self.pool = MHATokenToKVPool(head_num=self.shard.count, head_dim=HEAD_DIM, **common)
        self.allocator = PagedTokenToKVPoolAllocator(
            size=page * 32,
            page_size=page,
            dtype=DTYPE,
            device="cpu",
            kvcache=self.pool,
            need_sort=False,
        )
        self.req_to_token = ReqToTokenPool(
            size=8, max_context_len=128, device="cpu", enable_memory_saver=False
        )
        self.metadata = MetadataBuffers(
            size=8,
            hidden_size=16,
            hidden_states_dtype=DTYPE,
            max_sampling_mask_tokens=16,
            kv_checksum_enabled=True,
        )
        self.rows: dict[str, int] = {}
        self.allocator.alloc(junk * page)
        for rid in order:
            n = REQUESTS[rid][0]
            loc = self.allocator.alloc(-(-n // page) * page)[:n]
            (row,) = self.req_to_token.alloc_rows(1)
            self.req_to_token.write((row, slice(0, n)), loc.to(torch.int32))
            self.rows[rid] = row
            if kind == "mla":
                for layer, latent in latent_of(rid).items():
                    if layers[0] <= layer < layers[1]:
                        self.pool.kv_buffer[layer - layers[0]][loc.long(), 0] = latent
                continue
            part = slice(self.shard.first, self.shard.first + self.shard.count)
            for layer, (k, v) in kv_of(rid).items():
                if not layers[0] <= layer < layers[1]:
                    continue
                self.pool.set_kv_buffer(
                    SimpleNamespace(layer_id=layer), loc.long(), k[:, part], v[:, part]
                )

    def _hybrid(self, tp_rank, tp_size, order, junk, page, faults, temporal_dtype) -> None:
        """A hybrid world: layer 0's KV through the pool's own ``set_kv_buffer``; the
        window layer's only at the window's pages (the decode receives no more), through
        SGLang's ``set_full_to_swa_mapping``; the Mamba states in each request's state
        slot. ``faults`` per request: ``window-not-sent`` (the window's pages left as
        allocated), ``stale-window`` (one window page holding another request's KV),
        ``contiguous-state`` (the conv state as a TP=2 source's rows land when sliced
        contiguously), ``full-cell`` (one element of layer 0 changed)."""
        self.pool, self.allocator, self.req_to_token = hybrid_pools(
            self.kind, tp_size, self.shard.count, page, temporal_dtype
        )
        self.metadata = MetadataBuffers(
            size=8,
            hidden_size=16,
            hidden_states_dtype=DTYPE,
            max_sampling_mask_tokens=16,
            kv_checksum_enabled=True,
        )
        self.rows = {}
        full = self.allocator.full_attn_allocator if self.kind == "swa" else self.allocator
        full.alloc(junk * page)
        if self.kind == "swa":
            self.allocator.swa_attn_allocator.alloc((junk % 3 + 1) * page)
        else:
            self.req_to_token.mamba_allocator.alloc(junk % 3 + 1)
        part = slice(self.shard.first, self.shard.first + self.shard.count)
        for rid in order:
            n = REQUESTS[rid][0]
            pages = -(-n // page)
            loc = full.alloc(pages * page)
            (row,) = self.req_to_token.alloc_rows(1)
            self.req_to_token.write((row, slice(0, n)), loc[:n].to(torch.int32))
            self.rows[rid] = row
            k, v = kv_of(rid)[0]
            if faults.get(rid) == "full-cell":  # layer 0, token 33, element 3 of every head
                k = k.clone()
                k[33, :, 3] += 1.0
            self.pool.set_kv_buffer(
                SimpleNamespace(layer_id=0), loc[:n].long(), k[:, part], v[:, part]
            )
            if self.kind == "swa":
                start = (max(0, n - WINDOW) // page) * page
                swa = self.allocator.swa_attn_allocator.alloc(pages * page - start)
                self.allocator.set_full_to_swa_mapping(loc[start:], swa)
                k, v = kv_of(rid)[1]
                if faults.get(rid) == "stale-window":  # the first window page: another's
                    k = k.clone()
                    stale = kv_of("req-plain")[1][0][: min(page, n - start)]
                    k[start : start + stale.shape[0]] = stale
                if faults.get(rid) != "window-not-sent":
                    written = KVWriteLoc(loc[start:n].long(), swa_loc=swa[: n - start].long())
                    self.pool.set_kv_buffer(
                        SimpleNamespace(layer_id=1),
                        written,
                        k[start:n, part],
                        v[start:n, part],
                    )
                continue
            (slot,) = self.req_to_token.mamba_allocator.alloc(1).tolist()
            self.req_to_token.req_index_to_mamba_index_mapping[row] = slot
            state = state_of(rid, temporal_dtype)
            conv, temporal = rank_state(state, tp_rank, tp_size)
            if faults.get(rid) == "contiguous-state":
                # What a transfer from two TP ranks that ignores conv_shard_groups puts
                # here: each source rank's conv rows (its q, k and v parts) in one run.
                sources = torch.cat([rank_state(state, r, 2)[0] for r in range(2)])
                conv = rank_state((sources, temporal), tp_rank, tp_size, contiguous=True)[0]
            cache = self.pool.mamba_pool.mamba_cache
            cache.conv[0][0, slot] = conv
            cache.temporal[0, slot] = temporal

    def sglang_digest(self):
        """SGLang's own digest (``KvChecksumComputer.compute``: Adler-32 of this rank's
        bytes, buffer-major, page-minor), on the CPU."""
        if self.kind == "mla":
            buffers = list(self.pool.kv_buffer)
        elif self.kind in HYBRID:  # the full pool's pages (the state's digest left out)
            buffers = self.pool.full_kv_pool.k_buffer + self.pool.full_kv_pool.v_buffer
        else:
            buffers = self.pool.k_buffer + self.pool.v_buffer
        _, _, item_lens = self.pool.get_contiguous_buf_infos()

        def compute(pages, state_indices=None):
            value = 1
            for buffer, item in zip(buffers, item_lens, strict=True):
                raw = buffer.view(torch.uint8).reshape(-1)
                for page in pages.tolist():
                    value = zlib.adler32(raw[page * item : (page + 1) * item].numpy(), value)
            return value

        return SimpleNamespace(compute=compute)


def aux_rows(buffers: MetadataBuffers, index: int) -> list[str]:
    """Every aux buffer's row ``index``, as the bytes a transfer backend sends."""
    ptrs, _, item_lens = buffers.get_buf_infos()
    return [
        ctypes.string_at(ptr + index * item, item).hex()
        for ptr, item in zip(ptrs, item_lens, strict=True)
    ]


def receive_aux(buffers: MetadataBuffers, index: int, rows: list[str]) -> None:
    """Write a prefill's aux rows into the decode's slot ``index`` (mooncake ``send_aux``)."""
    ptrs, _, item_lens = buffers.get_buf_infos()
    assert len(ptrs) == len(rows)
    for ptr, item, row in zip(ptrs, item_lens, rows, strict=True):
        data = bytes.fromhex(row)
        assert len(data) == item
        ctypes.memmove(ptr + index * item, data, item)


def stage_layers(pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The global layer ids of PP stage ``pp_rank`` of ``pp_size``: ``first .. end - 1``."""
    per = LAYERS // pp_size
    return pp_rank * per, (pp_rank + 1) * per


def prefill_rank(
    rank: int,
    init_file: str,
    out_dir: str,
    tp_size: int = 2,
    pp_size: int = 1,
    output: str | None = None,
    kind: str = "mha",
    temporal_dtype: str = "float32",
) -> None:
    """One prefill rank (a spawned process; world rank ``pp_rank * tp_size + tp_rank``,
    each PP stage's TP ranks one gloo group): the real ``send_kv_chunk`` of every
    request's last chunk, ``req-plain`` before kvaudit's hooks are installed; with
    ``output``, kvaudit writes its output folder there and dumps every sent request
    (rotating dumps); ``kind`` is the pool's (``World``)."""
    import torch.distributed as dist
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_context, get_device, get_parallel

    world_size = tp_size * pp_size
    dist.init_process_group(
        "gloo", init_method=file_init(init_file), rank=rank, world_size=world_size
    )
    stages = [
        dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), backend="gloo")
        for s in range(pp_size)
    ]
    pp_rank, tp_rank = divmod(rank, tp_size)
    group = stages[pp_rank]
    if output is not None:
        os.environ.update(
            KVAUDIT_SGLANG_OUTPUT=output,
            KVAUDIT_SGLANG_MAX_DUMP_BYTES=str(10**8),
            KVAUDIT_SGLANG_ROTATE_DUMPS="1",
        )
    override = get_context().override_server_args(
        disaggregation_mode="prefill",
        tp_size=tp_size,
        pp_size=pp_size,
        disaggregation_transfer_backend="fake",
        disaggregation_enable_kv_checksum=True,
    )
    server_args = override.install()
    world = World(
        tp_rank,
        tp_size,
        list(REQUESTS),
        junk=3 + rank,
        layers=stage_layers(pp_rank, pp_size),
        kind=kind,
        temporal_dtype=getattr(torch, temporal_dtype),
    )
    heads = 1 if kind == "mla" else HEADS
    parallel = {"tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": 0, "attn_tp_rank": tp_rank}
    with get_parallel().override(**parallel), get_device().override(gpu_id=0):
        sched = SimpleNamespace(
            tp_worker=SimpleNamespace(
                model_runner=SimpleNamespace(
                    effective_logical_max_total_num_tokens=PAGE * 32,
                    kv_cache_dtype_str="auto",
                    model=None,  # no model: no fp8 scales (the pool is bf16)
                )
            ),
            kv_shard_widening=1,
            token_to_kv_pool_allocator=world.allocator,
            rust_server=None,
            model_config=SimpleNamespace(
                hf_text_config=SimpleNamespace(full_attention_layer_ids=[0])
                if kind == "linear"
                else None,
                num_hidden_layers=LAYERS,
                get_total_num_kv_heads=lambda: heads,
            ),
            server_args=server_args,
            req_to_token_pool=world.req_to_token,
        )
        queue = PrefillBootstrapQueue(
            token_to_kv_pool=world.pool,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
            metadata_buffers=world.metadata,
            gpu_id=0,
            bootstrap_port=8998,
            max_total_num_tokens=PAGE * 32,
            scheduler=sched,
            scheduler_stage_metrics=None,
            transfer_backend=TransferBackend.FAKE,
        )
        sched.kv_checksum_computer = world.sglang_digest()  # compute() needs CUDA
        sched.sliding_window_size = WINDOW
        sched.disagg_prefill_bootstrap_queue = queue
        sched.disagg_metadata_buffers = world.metadata
        sched.enable_staging = False
        sched.disagg_prefill_pending_chunk_rids = set()
        sched.attn_tp_cpu_group = group
        sched._send_kv_chunk = MethodType(SchedulerDisaggregationPrefillMixin._send_kv_chunk, sched)
        sender_class = get_kv_class(TransferBackend.FAKE, KVClassType.SENDER)
        out: dict = {"signature": queue.kv_checksum_signature, "rows": {}, "polls": {}}
        for index, rid in enumerate(REQUESTS, start=1):
            if rid == "req-ok":  # the plain request went first; now install kvaudit
                register_inline()
                HookRegistry.apply_hooks()
            n, prefix = REQUESTS[rid]
            row = world.rows[rid]
            sender = sender_class(queue.kv_manager, "10.0.0.1:8998", 100 + index)
            sender.init(-(-n // PAGE), aux_index=index)
            req = SimpleNamespace(
                rid=rid,
                origin_input_ids=list(range(n)),
                extend_end=n,
                disagg_decode_prefix_len=prefix,
                start_send_idx=prefix,
                kv=SimpleNamespace(req_pool_idx=row),
                metadata_buffer_index=index,
                output_ids=[1000 + index],
                cached_tokens=0,
                cached_tokens_device=0,
                cached_tokens_host=0,
                cached_tokens_storage=0,
                get_mm_token_counts=lambda: (0, 0, 0),
                return_logprob=False,
                return_sampling_mask=False,
                hidden_states_tensor=None,
                bootstrap_room=100 + index,
                disagg_kv_sender=sender,
            )
            SchedulerDisaggregationPrefillMixin.send_kv_chunk(sched, req, last_chunk=True)
            out["rows"][rid] = aux_rows(world.metadata, index)
            out["polls"][rid] = int(sender.poll())
        out["wrapped"] = sorted(
            name
            for name in HOOKED
            if hasattr(getattr(SchedulerDisaggregationPrefillMixin, name, None), "__wrapped__")
        )
        out["stats"] = inline.inline_stats()
    override.restore()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


class Decode:
    """A decode rank: its world (pages in another order, after other pages; the
    ``CHANGED`` cell altered on the rank that holds its head), the real
    ``DecodeTransferQueue``, and a stub scheduler as ``self`` of the real methods."""

    def __init__(
        self,
        group,
        patch,
        tp_rank: int = 0,
        tp_size: int = 1,
        page: int = PAGE,
        layers: tuple[int, int] = (0, LAYERS),
        changed: tuple[str, int, int, int] = CHANGED,
        kind: str = "mha",
        faults: dict[str, str] | None = None,
        temporal_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.world = World(
            tp_rank,
            tp_size,
            ["req-prefix", "HEALTH_CHECK_1", "req-bad", "req-plain", "req-ok"],
            5 + tp_rank,
            page,
            layers,
            kind,
            faults,
            temporal_dtype,
        )
        rid, layer, head, token = changed
        shard = self.world.shard
        if kind in HYBRID:  # its faults are the world's (``faults``)
            pass
        elif kind == "mla" and layers[0] <= layer < layers[1]:  # the latent's element 3
            slot = int(self.world.req_to_token.req_to_token[self.world.rows[rid], token])
            self.world.pool.kv_buffer[layer - layers[0]][slot, 0, 3] += 1.0
        elif shard.first <= head < shard.first + shard.count and layers[0] <= layer < layers[1]:
            slot = int(self.world.req_to_token.req_to_token[self.world.rows[rid], token])
            self.world.pool.k_buffer[layer - layers[0]][slot, head - shard.first, 3] += 1.0
        kv_args = KVArgs()
        kv_args.kv_data_ptrs, _, kv_args.kv_item_lens = self.world.pool.get_contiguous_buf_infos()
        kv_args.page_size, kv_args.kv_cache_dtype_str = page, "auto"
        kv_args.state_types, kv_args.state_item_lens = [], []
        kv_args.swa_kv_cache_layout = None
        self.signature = kv_layout_signature(kv_args)
        self.aborts: list[str] = []
        self.failed = []
        self.released = []
        # release_kv_cache needs a real tree cache: recorded instead.
        patch(sglang_decode, "release_kv_cache", lambda req, *a, **k: self.released.append(req.rid))
        sched = SimpleNamespace(
            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=None)),  # no scales
            kv_checksum_computer=self.world.sglang_digest(),
            req_to_token_pool=self.world.req_to_token,
            token_to_kv_pool_allocator=self.world.allocator,
            attn_tp_cpu_group=group,
            model_config=SimpleNamespace(
                get_total_num_kv_heads=lambda: 1 if kind == "mla" else HEADS
            ),
            disagg_decode_prealloc_queue=SimpleNamespace(
                kv_checksum_signature=self.signature,
                kv_manager=SimpleNamespace(should_verify_kv_checksum=lambda addr: True),
                kv_checksum_mismatch_injector=None,
            ),
            output_streamer=SimpleNamespace(
                stream_output=lambda reqs, logprob: self.aborts.extend(r.rid for r in reqs)
            ),
            tree_cache=None,
            metrics_reporter=SimpleNamespace(enable_metrics=True),
            metrics_collector=SimpleNamespace(
                increment_transfer_failed_reqs=lambda: self.failed.append(1)
            ),
            batch_result_processor=SimpleNamespace(
                _maybe_update_reasoning_tokens=lambda req, token: None
            ),
            spec_algorithm=SimpleNamespace(is_none=lambda: True),
        )
        sched._handle_kv_checksum_mismatch = MethodType(
            SchedulerDisaggregationDecodeMixin._handle_kv_checksum_mismatch, sched
        )
        sched.sliding_window_size = WINDOW
        self.sched = sched
        self.queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
            metadata_buffers=self.world.metadata,
            scheduler=sched,
            tree_cache=None,
        )

    def receive(self, rid: str, prefill: list[dict], index: int):
        """The transfer of ``rid``: the aux rows of the prefill ranks in ``prefill`` (its
        senders, in order) land in slot ``index``; the real ``_commit_transfer_to_req``
        commits it, then the slot is cleared as ``pop_transferred`` does."""
        for rank in prefill:
            receive_aux(self.world.metadata, index, rank["rows"][rid])
        n, prefix = REQUESTS[rid]
        req = SimpleNamespace(
            rid=rid,
            origin_input_ids=list(range(n)),
            bootstrap_host="10.0.0.1",
            bootstrap_port=8998,
            bootstrap_room=100 + list(REQUESTS).index(rid) + 1,  # checked against the row
            kv=SimpleNamespace(req_pool_idx=self.world.rows[rid], cache_protected_len=prefix),
            output_ids=[],
            return_logprob=False,
            return_sampling_mask=False,
            time_stats=SimpleNamespace(set_wait_queue_entry_time=lambda: None),
            expected_kv_checksum=None,
        )
        receiver = SimpleNamespace(clear=lambda: None)
        decode_req = DecodeRequest(req=req, kv_receiver=receiver, metadata_buffer_index=index)
        self.queue._commit_transfer_to_req(decode_req)
        self.world.metadata.clear_slot(index)
        assert req.output_ids == [1000 + list(REQUESTS).index(rid) + 1]  # the row arrived
        return req

    def verify(self, reqs: list) -> list:
        """The real ``_verify_kv_checksums`` on a batch of ``reqs``; the requests kept."""
        batch = SimpleNamespace(reqs=list(reqs))
        batch.filter_batch = lambda keep_indices: setattr(
            batch, "reqs", [batch.reqs[i] for i in keep_indices]
        )
        SchedulerDisaggregationDecodeMixin._verify_kv_checksums(self.sched, batch)
        return batch.reqs


def row_words(prefill: list[dict], rid: str, rank: int = 1) -> list[int]:
    """The checksum row (the last aux buffer) a prefill rank sent for ``rid``."""
    return np.frombuffer(bytes.fromhex(prefill[rank]["rows"][rid][-1]), dtype="<u8").tolist()


def run_prefill(
    out: Path,
    tp_size: int = 2,
    pp_size: int = 1,
    output: str | None = None,
    kind: str = "mha",
    temporal_dtype: str = "float32",
) -> list[dict]:
    """A whole prefill: ``prefill_rank`` in ``tp_size * pp_size`` spawned processes (their
    files under ``out``); every rank's results, in world rank order."""
    import torch.multiprocessing as mp

    ranks = tp_size * pp_size
    args = (str(out / "init"), str(out), tp_size, pp_size, output, kind, temporal_dtype)
    mp.spawn(prefill_rank, args=args, nprocs=ranks)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def file_init(path: str | Path) -> str:
    """A gloo ``init_method`` for the rendezvous file ``path``, relative or absolute
    (``file://`` of a relative path would read its first folder as a host)."""
    return f"file://{Path(path).absolute()}"


@contextlib.contextmanager
def decode_process(
    rank: int, init_file: str, tp_size: int = 2, timeout: timedelta | None = None
) -> Iterator[object]:
    """In a spawned process, one decode TP rank's setting: its gloo group (every rank of
    the decode, collectives bounded by ``timeout`` where given), SGLang's published
    context (decode mode, the fake backend, SGLang's checksum on, SGLang's CI mode off)
    and kvaudit's hooks installed; yields the group."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_context, get_parallel

    os.environ.pop("SGLANG_IS_IN_CI", None)
    bound = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(
        "gloo", init_method=file_init(init_file), rank=rank, world_size=tp_size, **bound
    )
    group = dist.new_group(list(range(tp_size)), backend="gloo", **bound)
    override = get_context().override_server_args(
        disaggregation_mode="decode",
        tp_size=tp_size,
        disaggregation_transfer_backend="fake",
        disaggregation_enable_kv_checksum=True,
    )
    override.install()
    parallel = {
        "tp_rank": rank,
        "attn_tp_rank": rank,
        "attn_tp_group": SimpleNamespace(cpu_group=group),
    }
    try:
        with get_parallel().override(**parallel):
            register_inline()
            HookRegistry.apply_hooks()
            yield group
    finally:
        override.restore()
        dist.destroy_process_group()
