"""A vLLM engine on the CPU: vLLM 0.33.0's own ``Scheduler`` (or ``AsyncScheduler``) with a
KV connector in both roles (kvaudit's, around ExampleConnector or any other), so the
connector sees exactly the calls, states and timing of a real vLLM: prefix-cache hits,
chunked prefill, preemption, aborts, async scheduling. ``walkthrough.py`` runs it; the
tests of kvaudit's vLLM connector (tests/vllm) drive it.

What is vLLM's own: ``ModelConfig`` (read from a small Llama-shaped ``config.json`` written
here; no weights), ``VllmConfig`` and its post-initialisation, the ``Scheduler`` and its
``KVCacheManager``/``BlockPool``, ``Request`` with vLLM's block hasher, the connectors'
scheduler sides, ``KVOutputAggregator``, ``ModelRunnerOutput`` and ``KVConnectorOutput``.
The worker side follows vLLM's ``v1/worker/gpu/kv_connector.py`` call for call
(``pre_forward``, ``finish_forward``, ``post_forward`` with ``defer_finalize`` when a
drafter runs, ``finalize_step``, ``no_forward``). Only the model is replaced: its forward
writes each scheduled token's KV (a function of token, position, layer and global head,
``harness.token_kv``) and samples the token ``SAMPLED + position``, so two engines given
one prompt compute the same KV and the same output.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import ForwardContext
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

import kvaudit.integrations.vllm.worker_hooks as worker_hooks

MODULE = "kvaudit.integrations.vllm"
LAYER = "model.layers.{}.self_attn.attn"
SAMPLED = 7000  # the model's output token at position p is SAMPLED + p
LAYERS, HEADS, HEAD_SIZE = 2, 4, 8
MAX_MODEL_LEN = 512
_MODEL_CONFIGS: dict[str, ModelConfig] = {}


def model_config(folder: Path) -> ModelConfig:
    """vLLM's ``ModelConfig`` of a small Llama-shaped model (2 layers, 4 KV heads of 8),
    read offline from a ``config.json`` written in ``folder``; built once per process."""
    key = str(folder)
    if key not in _MODEL_CONFIGS:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(
            json.dumps(
                {
                    "architectures": ["LlamaForCausalLM"],
                    "model_type": "llama",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_attention_heads": 8,
                    "num_key_value_heads": HEADS,
                    "head_dim": HEAD_SIZE,
                    "num_hidden_layers": LAYERS,
                    "vocab_size": 10000,
                    "max_position_embeddings": 2048,
                    "torch_dtype": "bfloat16",
                }
            )
        )
        _MODEL_CONFIGS[key] = ModelConfig(
            model=str(folder),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=MAX_MODEL_LEN,
            seed=0,
        )
    return copy.deepcopy(_MODEL_CONFIGS[key])


def engine_config(
    model: ModelConfig,
    transfer: KVTransferConfig | None,
    *,
    block_size: int = 16,
    num_blocks: int = 64,
    step_tokens: int = 256,
    max_seqs: int = 16,
    async_scheduling: bool = False,
    prefix_caching: bool = True,
    tp_size: int = 1,
) -> VllmConfig:
    """vLLM's config of one engine, post-initialised by vLLM itself."""
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    cache.num_gpu_blocks = num_blocks
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=step_tokens,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            async_scheduling=async_scheduling,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=transfer,
    )


def transfer_config(
    kvaudit: dict[str, Any], wrapped: dict[str, Any] | None, role: str = "kv_both",
    engine_id: str = "engine", connector: str = "KVAuditConnector",
) -> KVTransferConfig:  # fmt: skip
    """kvaudit's connector, configured as docs/vllm.md says: ``connector``
    (``KVAuditHMAConnector`` keeps vLLM's hybrid memory allocator on for a wrapped
    connector that supports it) from ``kvaudit.integrations.vllm``, wrapping the
    connector ``wrapped`` names (by vLLM's registry or a module path; None: kvaudit on
    its own)."""
    extra: dict[str, Any] = {"kvaudit": kvaudit}
    if wrapped is not None:
        extra["wrapped"] = wrapped
    return KVTransferConfig(
        kv_connector=connector, kv_connector_module_path=MODULE,
        kv_connector_extra_config=extra, kv_role=role, engine_id=engine_id,
    )  # fmt: skip


def attention_spec(block_size: int, heads: int, head_size: int, mla: bool = False) -> AttentionSpec:
    if mla:
        return MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16
        )
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16
    )


def cache_config(
    spec: AttentionSpec, layers: int | Sequence[int], num_blocks: int, layout: KVCacheLayout
) -> KVCacheConfig:
    """One group of layers (``layers`` of them, or those numbered) in one backing
    allocation, placed as ``layout``."""
    numbers = range(layers) if isinstance(layers, int) else layers
    names = [LAYER.format(i) for i in numbers]
    layers = len(names)
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        layer_stride, block_stride = page * num_blocks, page
    else:
        layer_stride, block_stride = page, page * layers
    tensor = KVCacheTensor(
        size=page * num_blocks * layers, layers=names, layer_stride=layer_stride,
        block_stride=block_stride,
    )  # fmt: skip
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        kv_cache_layout=layout.name,
    )


def token_kv(token: int, position: int, layer: int, head: int, width: int) -> torch.Tensor:
    """The KV the model computes for one token, layer and global head (bf16 bits)."""
    seed = (token * 1_000_003 + position * 7919 + layer * 104_729 + head * 15_485_863) % 2**31
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 2**16, (width,), generator=generator, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
    )


def write_tokens(
    cache: torch.Tensor, name: str, prompt: Sequence[int], first: int, last: int,
    table: Sequence[int], block_size: int, first_head: int,
) -> None:  # fmt: skip
    """Tokens ``first .. last-1`` of a prompt into a ``[blocks, heads, tokens, C]`` cache
    whose head 0 is global head ``first_head``."""
    layer = int(name.split(".")[2])
    width = cache.shape[-1]
    for position in range(first, last):
        block = table[position // block_size]
        for h in range(cache.shape[1]):
            cache[block, h, position % block_size] = token_kv(
                prompt[position], position, layer, first_head + h, width
            )


def transfer_output(conn: Any, finished_req_ids: set[str]) -> KVConnectorOutput:
    """A worker connector's part of the step's output, collected as vLLM's
    ``ActiveKVConnector.post_forward`` collects it (after ``wait_for_save``, or before it
    when a drafter defers it)."""
    results = conn.get_transfer_results(finished_req_ids)
    return KVConnectorOutput(
        finished_sending=results.finished_sending or None,
        finished_recving=results.finished_recving or None,
        failed_recving=results.failed_recving,
        invalid_block_ids=conn.get_block_ids_with_load_errors(),
        kv_connector_stats=conn.get_kv_connector_stats(),
        kv_cache_events=conn.get_kv_connector_kv_cache_events(),
        kv_connector_worker_meta=conn.build_connector_worker_meta(),
    )


@dataclass
class RunnerRequest:
    """What the model runner keeps of a request: its tokens and block ids."""

    tokens: list[int]
    blocks: list[list[int]]
    computed: int = 0


@dataclass
class Worker:
    """One TP rank: its connector and its caches."""

    rank: int
    connector: Any
    caches: dict[str, torch.Tensor]


Plant = Callable[["Engine", SchedulerOutput], None]


@dataclass
class Engine:
    """One engine: vLLM's scheduler, its workers' connectors, and the model stand-in."""

    config: VllmConfig
    scheduler: Any
    workers: list[Worker]
    block_size: int
    heads_per_rank: int
    num_blocks: int
    drafter: bool = False
    hasher: Any = None
    aggregator: KVOutputAggregator | None = None
    runner: dict[str, RunnerRequest] = field(default_factory=dict)
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    before_forward: Plant | None = None
    stats: list[Any] = field(default_factory=list)
    pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    history: list[tuple[SchedulerOutput, ModelRunnerOutput]] = field(default_factory=list)

    # Requests.

    def add(
        self,
        rid: str,
        prompt: Sequence[int],
        params: dict[str, Any] | None = None,
        max_tokens: int = 1,
        stop: int | None = None,
    ) -> Request:
        """``EngineCore.add_request``: a request with vLLM's block hasher."""
        extra = {"kv_transfer_params": dict(params)} if params is not None else None
        sampling = SamplingParams(
            max_tokens=max_tokens,
            extra_args=extra,
            ignore_eos=True,
            stop_token_ids=[stop] if stop is not None else None,
        )
        request = Request(rid, list(prompt), sampling, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        return request

    def abort(self, rid: str) -> None:
        """The client went away: ``finish_requests(..., FINISHED_ABORTED)``."""
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def finished(self, rid: str) -> EngineCoreOutput | None:
        """The request's last output, if it finished."""
        for out in self.outputs.get(rid, []):
            if out.finish_reason is not None:
                return out
        return None

    def params(self, rid: str) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a finished request handed back (what a proxy
        forwards)."""
        out = self.finished(rid)
        return None if out is None else out.kv_transfer_params

    def generated(self, rid: str) -> list[int]:
        return [t for out in self.outputs.get(rid, []) for t in out.new_token_ids]

    # Steps.

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, execute, update (with async scheduling, the update
        of the previous step comes after this step's schedule and execution, as
        ``EngineCore.step_with_batch_queue`` orders them)."""
        output = self.scheduler.schedule()
        result = self.execute(output)
        self.history.append((output, result))
        if self.config.scheduler_config.async_scheduling:
            previous, self.pending = self.pending, (output, result)
            if previous is not None:
                self._update(*previous)
        else:
            self._update(output, result)
        return output

    def run(self, steps: int = 200) -> None:
        """Steps until no request is left (and every held block is back)."""
        for _ in range(steps):
            if not self.scheduler.has_requests() and self.pending is None:
                return
            self.step()
            if self.pending is not None and not self.scheduler.has_requests():
                self._update(*self.pending)
                self.pending = None
        raise AssertionError(f"requests left after {steps} steps: {list(self.scheduler.requests)}")

    def _update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        outputs = self.scheduler.update_from_output(output, result)
        for batch in outputs.values():
            for out in batch.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
            if batch.scheduler_stats is not None:
                self.stats.append(batch.scheduler_stats.kv_connector_stats)

    # The block pool.

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def all_blocks_free(self) -> bool:
        """Whether every block but vLLM's null block is back in the pool."""
        return self.free_blocks() == self.num_blocks - 1

    # The model runner.

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """The workers' step, as vLLM's GPU model runner drives the connector."""
        self._update_states(output)
        sampled = self._sample(output)
        results = [self._run_worker(w, output) for w in self.workers]
        for rid, count in output.num_scheduled_tokens.items():
            state = self.runner[rid]
            state.computed = min(state.computed + count, len(state.tokens))
            state.tokens.extend(sampled.get(rid, []))
        if self.aggregator is None:
            self.aggregator = KVOutputAggregator.from_connector(
                self.scheduler.connector, len(self.workers)
            )
        rids = list(output.num_scheduled_tokens)
        base = ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={rid: i for i, rid in enumerate(rids)},
            sampled_token_ids=[sampled.get(rid, []) for rid in rids],
        )
        outputs = []
        for i, kv in enumerate(results):
            if i == 0:
                outputs.append(copy.copy(base))
                outputs[0].kv_connector_output = kv
            else:
                outputs.append(ModelRunnerOutput.with_kv_conn_output_only(kv))
        combined = self.aggregator.aggregate(outputs)
        assert combined is not None
        return combined

    def _update_states(self, output: SchedulerOutput) -> None:
        for rid in output.finished_req_ids:
            self.runner.pop(rid, None)
        for rid in output.preempted_req_ids or ():
            state = self.runner.get(rid)
            if state is not None:
                state.blocks = []
        for new in output.scheduled_new_reqs:
            # A resumed request comes back as new, with its output so far (v2 runner).
            tokens = new.prefill_token_ids or new.prompt_token_ids
            self.runner[new.req_id] = RunnerRequest(
                list(tokens), [list(b) for b in new.block_ids], new.num_computed_tokens
            )
        cached = output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.runner[rid]
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.blocks = [list(b) for b in new_ids or ()]
                if rid in cached.all_token_ids:
                    state.tokens = list(cached.all_token_ids[rid])
            elif new_ids is not None:
                for table, ids in zip(state.blocks, new_ids, strict=True):
                    table.extend(ids)
            state.computed = cached.num_computed_tokens[i]

    def _sample(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """The token each request whose prompt (or decode) is done this step samples."""
        sampled = {}
        for rid, count in output.num_scheduled_tokens.items():
            state = self.runner[rid]
            if state.computed + count >= len(state.tokens):
                sampled[rid] = [SAMPLED + len(state.tokens)]
        return sampled

    def _run_worker(self, worker: Worker, output: SchedulerOutput) -> KVConnectorOutput:
        conn = worker.connector
        meta = output.kv_connector_metadata
        context = self._forward_context(worker)
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        forward = output.total_num_scheduled_tokens > 0
        load_pending = True
        if output.has_sync_kv_loads:
            conn.start_load_kv(context)
            load_pending = False
        if forward:
            if self.before_forward is not None:
                self.before_forward(self, output)
            self._forward(worker, output, context)
        conn.finish_forward()
        if load_pending:
            conn.start_load_kv(context)
        defer = forward and self.drafter
        if not defer:
            conn.wait_for_save()
        kv = transfer_output(conn, output.finished_req_ids)
        if not defer:
            conn.clear_connector_metadata()
        else:
            # The drafter runs here (its layers are never checksummed), then
            # finalize_step.
            conn.wait_for_save()
            conn.clear_connector_metadata()
        return kv

    def _forward_context(self, worker: Worker) -> ForwardContext:
        layers = {name: mock.Mock(kv_cache=cache) for name, cache in worker.caches.items()}
        metadata = {name: object() for name in worker.caches}
        return ForwardContext(no_compile_layers=layers, attn_metadata=metadata, slot_mapping={})

    def _forward(self, worker: Worker, output: SchedulerOutput, context: ForwardContext) -> None:
        """Every scheduled token's KV into its slot (its own heads), each layer saved."""
        for rid, count in output.num_scheduled_tokens.items():
            state = self.runner[rid]
            last = min(state.computed + count, len(state.tokens))
            for name, cache in worker.caches.items():
                write_tokens(
                    cache,
                    name,
                    state.tokens,
                    state.computed,
                    last,
                    state.blocks[0],
                    self.block_size,
                    worker.rank * self.heads_per_rank,
                )
        for name, cache in worker.caches.items():
            worker.connector.save_kv_layer(name, cache, context.attn_metadata[name])

    # Helpers for tests.

    def scheduled(self, rid: str) -> list[tuple[int, int]]:
        """``(num_computed_tokens, num_scheduled_tokens)`` of each step that ran ``rid``."""
        out = []
        for output, _ in self.history:
            computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
            cached = output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            if rid in output.num_scheduled_tokens:
                out.append((computed[rid], output.num_scheduled_tokens[rid]))
        return out

    def invalid_blocks(self) -> list[set[int]]:
        """The load errors each step's workers reported."""
        return [
            set(result.kv_connector_output.invalid_block_ids)
            for _, result in self.history
            if result.kv_connector_output
        ]

    def table(self, rid: str) -> list[int]:
        """The request's block ids (group 0) in the scheduler's KV cache manager."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])

    def connector_counters(self) -> dict[str, int]:
        """kvaudit's counters summed over every step's connector stats."""
        total: dict[str, int] = {}
        for stats in self.stats:
            if stats:
                for key, value in stats.get("kvaudit", {}).items():
                    total[key] = total.get(key, 0) + value
        return total


def make_engine(
    folder: Path,
    transfer: KVTransferConfig,
    *,
    worker_transfer: KVTransferConfig | None = None,
    tp_size: int = 1,
    block_size: int = 16,
    num_blocks: int = 64,
    step_tokens: int = 256,
    async_scheduling: bool = False,
    prefix_caching: bool = True,
    drafter: bool = False,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    max_seqs: int = 16,
) -> Engine:
    """An engine with ``tp_size`` workers, each holding ``HEADS / tp_size`` heads.

    ``worker_transfer``: the workers' transfer config, where their connector differs
    from the scheduler's (a stand-in of a transport that cannot run here, behind the
    real connector's scheduler side).
    """
    model = model_config(folder / "model")
    config = engine_config(
        model,
        transfer,
        block_size=block_size,
        num_blocks=num_blocks,
        step_tokens=step_tokens,
        async_scheduling=async_scheduling,
        prefix_caching=prefix_caching,
        tp_size=tp_size,
        max_seqs=max_seqs,
    )
    per_rank = HEADS // tp_size
    spec = attention_spec(block_size, per_rank, HEAD_SIZE)
    kv_cache_config: KVCacheConfig = cache_config(spec, LAYERS, num_blocks, layout)
    scheduler_cls = config.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(
        vllm_config=config,
        kv_cache_config=copy.deepcopy(kv_cache_config),
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=True,
    )
    worker_config = config
    if worker_transfer is not None:
        worker_config = copy.copy(config)
        worker_config.kv_transfer_config = worker_transfer
    workers = []
    for rank in range(tp_size):
        with mock.patch.object(worker_hooks, "worker_ranks", return_value=(rank, tp_size, 0, 1)):
            conn = KVConnectorFactory.create_connector(
                worker_config, KVConnectorRole.WORKER, kv_cache_config
            )
            caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
            for cache in caches.values():  # junk first: only what the model writes counts
                cache.view(torch.int16).copy_(
                    torch.randint_like(cache.view(torch.int16), -999, 999)
                )
            conn.register_kv_caches(caches)
        workers.append(Worker(rank, conn, caches))
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    return Engine(config, scheduler, workers, block_size, per_rank, num_blocks, drafter, hasher)


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))
