"""A vLLM engine's connector calls, in vLLM 0.33.0's order, around kvaudit's connector.

The classes are vLLM's own: ``KVTransferConfig``/``VllmConfig``, ``KVCacheConfig`` with
``KVCacheGroupSpec``/``FullAttentionSpec``/``MLAAttentionSpec`` and ``KVCacheTensor``, the
caches from ``vllm.v1.worker.utils.allocate_kv_cache`` (the standardized per-layer
``[blocks, heads, tokens, 2*head_size]`` views, laid out by ``KVCacheLayout``),
``Request``, ``SchedulerOutput``/``NewRequestData``/``CachedRequestData``, ``KVCacheBlocks``,
``ForwardContext``, ``ModelRunnerOutput`` and ``KVOutputAggregator``. Only the model is
replaced: its "forward" writes each scheduled token's KV, a function of the token id,
position, layer and global head, so two engines given one prompt compute the same KV.

The order followed (vllm 0.33.0 sources):

- scheduler, ``v1/core/sched/scheduler.py``: ``add_request`` calls ``on_new_request``;
  ``schedule`` (line 699) asks ``get_num_new_matched_tokens``, allocates, calls
  ``update_state_after_alloc``, and ends with ``build_connector_meta`` (line 1789);
  ``update_from_output`` (line 2259) handles ``invalid_block_ids`` (2296), then finishes
  requests through ``_free_request`` -> ``_connector_finished`` -> ``request_finished``
  (2476, 3395), then ``update_connector_output`` (2582, 3566), then the scheduler side's
  ``get_kv_connector_stats`` (2594);
- worker, ``v1/worker/gpu/kv_connector.py``: ``register_kv_caches`` (line 69), then per
  step ``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv`` (before the
  forward for sync loads), the forward (``save_kv_layer`` per layer), ``finish_forward``,
  ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
  ``get_kv_connector_stats``, ``get_kv_connector_kv_cache_events``,
  ``build_connector_worker_meta``, ``clear_connector_metadata`` (``post_forward``);
- executor, ``distributed/kv_transfer/kv_connector/utils.py``: ``KVOutputAggregator``
  combines every worker's ``KVConnectorOutput``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from cpu_engine import (  # the pieces this stand-in shares with the real-scheduler engine
    LAYER,  # noqa: F401 - re-exported for the tests
    MODULE,  # noqa: F401
    attention_spec,
    cache_config,
    token_kv,  # noqa: F401
    transfer_config,
    transfer_output,
    write_tokens,
)
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.worker.utils import allocate_kv_cache

import kvaudit.integrations.vllm.worker_hooks as worker_hooks


def vllm_config(
    ktc: KVTransferConfig, block_size: int, tp_size: int = 1, pp_size: int = 1
) -> VllmConfig:
    return VllmConfig(
        kv_transfer_config=ktc,
        cache_config=CacheConfig(block_size=block_size),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size
        ),
    )


@dataclass
class Worker:
    """One TP rank: its connector and its caches."""

    rank: int
    connector: Any
    caches: dict[str, torch.Tensor]


@dataclass
class Engine:
    """One engine: the scheduler's connector, its workers, and a minimal scheduler."""

    config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler: Any
    workers: list[Worker]
    block_size: int
    heads_per_rank: int
    replicated: bool = False
    requests: dict[str, Request] = field(default_factory=dict)
    tables: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    external: dict[str, tuple[int, bool]] = field(default_factory=dict)
    waiting_remote: dict[str, int] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)
    next_block: int = 1  # block 0 is vLLM's null block
    aggregator: KVOutputAggregator | None = None
    finished_params: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    before_forward: Callable[[Engine, SchedulerOutput], None] | None = None
    stats: list[Any] = field(default_factory=list)

    def add(self, rid: str, prompt: Sequence[int], params: dict[str, Any] | None = None) -> Request:
        """``Scheduler.add_request``: the request, then ``on_new_request``."""
        extra = {"kv_transfer_params": params} if params is not None else None
        request = Request(rid, list(prompt), SamplingParams(max_tokens=1, extra_args=extra), None)
        self.requests[rid] = request
        self.scheduler.on_new_request(request)
        return request

    def _allocate(self, rid: str, tokens: int) -> KVCacheBlocks:
        table = self.tables.setdefault(rid, [])
        while len(table) * self.block_size < tokens:
            table.append(self.next_block)
            self.next_block += 1
        return KVCacheBlocks((tuple(KVCacheBlock(b) for b in table),))

    def step(self) -> dict[str, Any]:
        """One step: schedule every waiting request's whole prompt (the scheduler side),
        run the workers, aggregate, and update the scheduler from the output."""
        new_reqs = []
        num_scheduled = {}
        for rid, request in self.requests.items():
            if rid in self.computed:
                continue
            if rid in self.waiting_remote:
                # WAITING_FOR_REMOTE_KVS until its load is reported finished.
                if rid not in self.loaded:
                    continue
                hit = self.waiting_remote.pop(rid)
            else:
                hit, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
                hit = hit or 0
                blocks = self._allocate(rid, request.num_prompt_tokens)
                self.scheduler.update_state_after_alloc(request, blocks, hit)
                self.external[rid] = (hit, is_async)
                if is_async and hit:
                    self.waiting_remote[rid] = hit
                    continue
            request.num_computed_tokens = hit
            num_scheduled[rid] = request.num_prompt_tokens - hit
            new_reqs.append(
                NewRequestData(
                    req_id=rid,
                    prompt_token_ids=request.prompt_token_ids,
                    mm_features=[],
                    sampling_params=request.sampling_params,
                    pooling_params=None,
                    block_ids=(list(self.tables[rid]),),
                    num_computed_tokens=hit,
                    lora_request=None,
                )
            )
            self.computed[rid] = hit
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = new_reqs
        output.scheduled_cached_reqs = CachedRequestData.make_empty()
        output.num_scheduled_tokens = num_scheduled
        output.total_num_scheduled_tokens = sum(num_scheduled.values())
        output.has_sync_kv_loads = any(
            self.external[r][0] and not self.external[r][1] for r in num_scheduled
        )
        output.kv_connector_metadata = self.scheduler.build_connector_meta(output)
        runner_outputs = [self._run_worker(w, output) for w in self.workers]
        if self.aggregator is None:
            self.aggregator = KVOutputAggregator.from_connector(self.scheduler, len(self.workers))
        combined = self.aggregator.aggregate(runner_outputs)
        kv_output = combined.kv_connector_output
        errors = set(kv_output.invalid_block_ids) if kv_output else set()
        if kv_output and kv_output.finished_recving:
            self.loaded |= kv_output.finished_recving
        finished = {}
        for rid in [r for r in num_scheduled if r not in self.finished_params]:
            request = self.requests[rid]
            request.num_computed_tokens = request.num_prompt_tokens
            _, params = self.scheduler.request_finished(request, list(self.tables[rid]))
            finished[rid] = params
        if kv_output:
            self.scheduler.update_connector_output(kv_output)
        self.stats.append(self.scheduler.get_kv_connector_stats())
        self.finished_params.update(finished)
        recving = set(kv_output.finished_recving or ()) if kv_output else set()
        return {"finished": finished, "invalid_block_ids": errors, "finished_recving": recving}

    def _run_worker(self, worker: Worker, output: SchedulerOutput) -> ModelRunnerOutput:
        conn = worker.connector
        meta = output.kv_connector_metadata
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        context = self._forward_context(worker)
        if output.has_sync_kv_loads:
            # Sync loads run before the forward; async ones are started after it.
            conn.start_load_kv(context)
        if self.before_forward is not None:
            self.before_forward(self, output)
        self._forward(worker, output, context)
        if not output.has_sync_kv_loads:
            conn.start_load_kv(context)
        conn.finish_forward()
        conn.wait_for_save()
        kv = transfer_output(conn, output.finished_req_ids)
        conn.clear_connector_metadata()
        return ModelRunnerOutput.with_kv_conn_output_only(kv)

    def _forward_context(self, worker: Worker) -> ForwardContext:
        layers = {name: mock.Mock(kv_cache=cache) for name, cache in worker.caches.items()}
        metadata = {name: object() for name in worker.caches}
        return ForwardContext(no_compile_layers=layers, attn_metadata=metadata, slot_mapping={})

    def _forward(self, worker: Worker, output: SchedulerOutput, context: ForwardContext) -> None:
        """The model: every scheduled token's KV into its slot, then each layer saved."""
        for new in output.scheduled_new_reqs:
            prompt = new.prompt_token_ids
            first = new.num_computed_tokens
            for name, cache in worker.caches.items():
                shard = 0 if self.replicated else worker.rank
                write_tokens(cache, name, prompt, first, len(prompt), self.tables[new.req_id],
                             self.block_size, shard * self.heads_per_rank)  # fmt: skip
        for name, cache in worker.caches.items():
            worker.connector.save_kv_layer(name, cache, context.attn_metadata[name])


def make_engine(
    kvaudit: dict[str, Any], wrapped: dict[str, Any] | None, *, role: str = "kv_both",
    tp_size: int = 1, heads: int = 4, head_size: int = 8, layers: int = 2, block_size: int = 16,
    num_blocks: int = 24, mla: bool = False, layout: KVCacheLayout = KVCacheLayout.LBHNC,
    engine_id: str = "engine", pp_size: int = 1,
) -> Engine:  # fmt: skip
    """An engine with ``tp_size`` workers per PP stage, each holding ``heads / tp_size``
    heads of its stage's layers (consecutive layers split evenly over the stages)."""
    ktc = transfer_config(kvaudit, wrapped, role, engine_id)
    config = vllm_config(ktc, block_size, tp_size, pp_size)
    per_rank = 1 if mla else heads // tp_size
    spec = attention_spec(block_size, per_rank, head_size, mla)
    kv_cache_config = cache_config(spec, layers, num_blocks, layout)
    scheduler = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    workers = []
    for pp_rank, rank in itertools.product(range(pp_size), range(tp_size)):
        stage = [i for i in range(layers) if i * pp_size // layers == pp_rank]
        stage_config = cache_config(spec, stage, num_blocks, layout)
        with mock.patch.object(
            worker_hooks, "worker_ranks", return_value=(rank, tp_size, pp_rank, pp_size)
        ):
            conn = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, stage_config)
            caches = allocate_kv_cache(stage_config, torch.device("cpu"), layout)
            # Junk everywhere first: only what the model writes may count.
            for cache in caches.values():
                cache.view(torch.int16).copy_(
                    torch.randint_like(cache.view(torch.int16), -999, 999)
                )
            conn.register_kv_caches(caches)
        workers.append(Worker(rank, conn, caches))
    return Engine(config, kv_cache_config, scheduler, workers, block_size, per_rank, mla)


def bound_metric(cls: type, registry: Any) -> type:
    """A Prometheus metric class (as vLLM hands to ``build_prom_metrics``) registering in
    ``registry``, so that tests do not touch the process-wide one."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, registry=registry, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": init})


def blocks_needed(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)
