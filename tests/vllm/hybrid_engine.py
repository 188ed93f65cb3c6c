"""A hybrid model's engine on the CPU under vLLM 0.33.0's real ``Scheduler``: layer 0
attends in a sliding window, layer 1 to every token (Gemma's pattern), so vLLM's planner
(``get_global_kv_cache_groups``, ``get_kv_cache_configs``) makes two KV cache groups
sharing one block pool, and its hybrid KV cache manager allocates, skips (null blocks
out of the window) and frees each group's blocks.

``HybridStoreConnector`` is ``async_store``'s asynchronous store for several groups
(``SupportsHMA``, so vLLM keeps the hybrid manager on): it stores each layer's blocks
through its own group's block table and loads, into the groups it says it restores
(``get_loaded_kv_cache_group_ids``: every group, or those in ``LOADED_GROUPS``), the
positions the consumer holds a block for. ``DAMAGE`` flips one bit of a loaded block as
in ``async_store``.

vLLM disables the hybrid manager where the platform does not support it; the class-only
environment has no platform (its ``UnspecifiedPlatform`` says no), while the CPU
platform that serves engines says yes (``CpuPlatform.support_hybrid_kv_cache``): the
engine turns it back on after vLLM's post-initialisation, as on the CPU.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from unittest import mock

import async_store
import cpu_engine as r
import torch
from async_store import ENGINES, READ, STORE, AsyncStoreConnector, NixlWire, StoreMetadata, damage
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

import kvaudit.integrations.vllm.worker_hooks as worker_hooks

WINDOW = 32  # layer 0's sliding window, in tokens
HYBRID_STORE = {"kv_connector": "HybridStoreConnector", "kv_connector_module_path": "hybrid_engine"}
NIXL_WIRE = {"kv_connector": "HybridNixlWire", "kv_connector_module_path": "hybrid_engine"}


def transfer_config(
    kvaudit: dict[str, Any], role: str, engine_id: str, wrapped: dict[str, Any] = HYBRID_STORE
) -> KVTransferConfig:
    """kvaudit's connector for a wrapped connector that supports HMA, wrapping
    :class:`HybridStoreConnector` or another connector loaded by module path."""
    return KVTransferConfig(
        kv_connector="KVAuditHMAConnector", kv_connector_module_path=r.MODULE,
        kv_connector_extra_config={"kvaudit": kvaudit, "wrapped": wrapped},
        kv_role=role, engine_id=engine_id,
    )  # fmt: skip


def nixl_transfer_config(kvaudit: dict[str, Any], role: str, engine_id: str) -> KVTransferConfig:
    """vLLM's ``NixlConnector`` wrapped by kvaudit's HMA connector (docs/vllm.md)."""
    nixl = {"kv_connector": "NixlConnector"}
    return r.transfer_config(kvaudit, nixl, role, engine_id, connector="KVAuditHMAConnector")


# The groups HybridStoreConnector's next consumer says its load restores (empty: all).
LOADED_GROUPS: set[int] = set()
NULL_BLOCK = 0


def layer_specs(block_size: int = 16) -> dict[str, KVCacheSpec]:
    """Layer 0 sliding-window, layer 1 full attention, each with the model's heads."""
    common = dict(block_size=block_size, num_kv_heads=r.HEADS, head_size=r.HEAD_SIZE,
                  dtype=torch.bfloat16)  # fmt: skip
    return {
        r.LAYER.format(0): SlidingWindowSpec(sliding_window=WINDOW, **common),
        r.LAYER.format(1): FullAttentionSpec(**common),
    }


class HybridEngine(r.Engine):
    """``cpu_engine.Engine`` whose model writes each layer through its group's table."""

    group_of: dict[str, int]

    def _forward(self, worker: r.Worker, output: SchedulerOutput, context: Any) -> None:
        for rid, count in output.num_scheduled_tokens.items():
            state = self.runner[rid]
            last = min(state.computed + count, len(state.tokens))
            for name, cache in worker.caches.items():
                table = state.blocks[self.group_of[name]]
                for position in range(state.computed, last):
                    # A position out of the window may hold vLLM's null block: no slot.
                    if table[position // self.block_size] != NULL_BLOCK:
                        r.write_tokens(cache, name, state.tokens, position, position + 1,
                                       table, self.block_size, 0)  # fmt: skip
        for name, cache in worker.caches.items():
            worker.connector.save_kv_layer(name, cache, context.attn_metadata[name])

    def group_table(self, rid: str, group: int) -> list[int]:
        """The request's block ids of one group in the scheduler's KV cache manager."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[group])


def make_hybrid_engine(
    folder: Path, transfer: Any, *, num_blocks: int = 64, async_scheduling: bool = False,
    block_size: int = 16, step_tokens: int = 256, worker_transfer: Any = None,
) -> HybridEngine:  # fmt: skip
    """An engine of one worker whose KV cache config vLLM's planner made from
    :func:`layer_specs` (two groups), with vLLM's hybrid KV cache manager.
    ``worker_transfer``: the worker's transfer config, where its connector differs from
    the scheduler's (``HybridNixlWire`` behind NIXL's scheduler side)."""
    model = r.model_config(folder / "model")
    config = r.engine_config(
        model, transfer, block_size=block_size, num_blocks=num_blocks,
        async_scheduling=async_scheduling, step_tokens=step_tokens,
    )  # fmt: skip
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    layout = KVCacheLayout.LBHNC
    config.cache_config.kv_cache_layout = layout.name
    specs = layer_specs(block_size)
    groups = get_global_kv_cache_groups(config, [specs])
    # The two groups' layers share one tensor (one layer's page per block id).
    page = max(spec.page_size_bytes for spec in specs.values())
    [kv_cache_config] = get_kv_cache_configs(config, [specs], [page * num_blocks], groups)
    kv_cache_config.kv_cache_layout = layout.name
    assert kv_cache_config.num_blocks == num_blocks
    scheduler = config.scheduler_config.get_scheduler_cls()(
        vllm_config=config, kv_cache_config=copy.deepcopy(kv_cache_config),
        structured_output_manager=StructuredOutputManager(config), block_size=block_size,
        log_stats=True,
    )  # fmt: skip
    worker_config = config
    if worker_transfer is not None:
        worker_config = copy.copy(config)
        worker_config.kv_transfer_config = worker_transfer
    with mock.patch.object(worker_hooks, "worker_ranks", return_value=(0, 1, 0, 1)):
        conn = KVConnectorFactory.create_connector(
            worker_config, KVConnectorRole.WORKER, kv_cache_config
        )
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        for cache in caches.values():  # junk first: only what the model writes counts
            cache.view(torch.int16).copy_(torch.randint_like(cache.view(torch.int16), -999, 999))
        conn.register_kv_caches(caches)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    engine = HybridEngine(config, scheduler, [r.Worker(0, conn, caches)], block_size, r.HEADS,
                          num_blocks, hasher=hasher)  # fmt: skip
    engine.group_of = {
        name: gid
        for gid, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    }
    return engine


class HybridStoreConnector(AsyncStoreConnector, SupportsHMA):
    """The asynchronous store, per KV cache group (each layer through its group's
    blocks); a position the consumer holds no block for (out of a window) is not loaded."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._group_of = {
            name: gid
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self._group_tables: dict[str, list[list[int]]] = {}

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        every = range(len(self._kv_cache_config.kv_cache_groups))
        return tuple(g for g in every if not LOADED_GROUPS or g in LOADED_GROUPS)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        local = self._local.pop(request.request_id, 0)
        if num_external_tokens > 0:
            key = tuple(request.prompt_token_ids)
            ids = [list(table) for table in blocks.get_block_ids()]
            self._loads.append((request.request_id, key, local // self.block_size, ids))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = StoreMetadata()
        steps = [
            (new.req_id, new.prompt_token_ids, new.block_ids, new.num_computed_tokens)
            for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            steps.append((rid, None, cached.new_block_ids[i], cached.num_computed_tokens[i]))
        for rid, prompt, new_ids, computed in steps:
            if prompt is not None:
                self._prompts[rid] = tuple(prompt)
                self._group_tables[rid] = [[] for _ in self._kv_cache_config.kv_cache_groups]
            if rid not in self._prompts:
                continue
            if new_ids is not None:
                for table, ids in zip(self._group_tables[rid], new_ids, strict=True):
                    table.extend(ids)
            key = self._prompts[rid]
            if computed + scheduler_output.num_scheduled_tokens[rid] >= len(key):
                if (0, key) not in STORE:
                    meta.saves.append((key, [list(t) for t in self._group_tables[rid]]))
                del self._prompts[rid], self._group_tables[rid]
        meta.loads, self._loads = self._loads, []
        return meta

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return False, None

    def _load(self, rid: str, key: tuple[int, ...], first: int, ids: Any) -> None:
        count = -(-len(key) // self.block_size)
        self.loads += 1
        restored = LOADED_GROUPS or set(range(len(ids)))
        for name, cache in self._caches.items():
            group = self._group_of[name]
            if group not in restored:
                continue
            stored = STORE[(self.rank, key)][name]
            for position in range(first, count):
                block = ids[group][position]
                if block != NULL_BLOCK and position in stored:
                    cache[block] = stored[position]
                    damage(cache, name, block, position, self.loads)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        for key, tables in meta.saves:
            count = -(-len(key) // self.block_size)
            saved = STORE.setdefault((self.rank, key), {})
            for name, cache in self._caches.items():
                table = tables[self._group_of[name]][:count]
                saved[name] = {p: cache[b].clone() for p, b in enumerate(table) if b != NULL_BLOCK}


class HybridNixlWire(NixlWire):
    """``async_store.NixlWire`` for several groups: per group, NIXL's local block ids
    (those the decode allocated for the load, none out of a window) are filled from the
    tail of the remote request's blocks of that group, as NIXL's pull worker reads them."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._group_of = {
            name: gid
            for gid, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for rid, req in meta.reqs_to_recv.items():
            remote = req.remote
            positions = max(len(ids) for ids in remote.block_ids)
            source = ENGINES[(remote.engine_id, self.rank)]
            for name, cache in self._caches.items():
                group = self._group_of[name]
                local = [b for b in req.local_block_ids[group] if b != NULL_BLOCK]
                theirs = list(remote.block_ids[group])[len(remote.block_ids[group]) - len(local) :]
                first = positions - len(local)
                for offset, (mine, block) in enumerate(zip(local, theirs, strict=True)):
                    cache[mine] = source[name][block]
                    damage(cache, name, mine, first + offset)
            READ.add(remote.request_id)
            self._received.add(rid)
        self._sending.update(meta.reqs_to_send)


def reset() -> None:
    """Every store and setting back to its start."""
    async_store.reset()
    LOADED_GROUPS.clear()
