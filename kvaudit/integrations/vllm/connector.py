"""``KVAuditConnector``: a vLLM v1 KV connector that wraps the deployment's connector,
delegates every call to it unchanged, and audits the KV it sends and receives.

Configured under ``kv_connector_extra_config``: ``"kvaudit"`` holds the audit's settings
(``config.py``), ``"wrapped"`` the wrapped connector's ``KVTransferConfig`` fields (its
other fields are this connector's). Without ``"wrapped"`` it audits on its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from ...description import parse_description
from ...records import WorkerInfo
from .config import AuditConfig, parse_config
from .describe import describe_vllm_cache
from .engine import (
    AUDIT_KEY,
    group_layouts,
    model_kv_heads,
    multiconnector_siblings,
    refuse_sync_loading,
    with_transfer_config,
    worker_ranks,
)
from .guard import AuditGuard
from .jobs import AuditStep
from .messages import (
    STATS_KEY,
    KVAuditMetadata,
    KVAuditStats,
    KVAuditWorkerMetadata,
    class_path,
)
from .scheduler import SchedulerAudit
from .versions import follow_vllm_logging, warn_if_untested
from .worker import WorkerAudit
from .wrapped_class import WrappedClassQueries

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvaudit.vllm")


class KVAuditConnector(WrappedClassQueries, KVConnectorBase_V1):
    """Audits the KV a wrapped connector moves: checksums on the producer when the KV is
    complete, on the consumer once loaded; the producer's wire in ``kv_transfer_params``
    under ``"kvaudit"``; mismatches logged, counted and (policy ``fail``) reported as load
    errors. Every call is delegated to the wrapped connector, its results unchanged.

    Configured either as itself, wrapping the connector named under ``"wrapped"``, or
    under the name of the vLLM connector it audits (``kvaudit.integrations.vllm.audited``
    makes one such class per name: ``audited_name``), so that vLLM's own checks of that
    connector still apply.

    Each hook calls the wrapped connector first, outside kvaudit's guard (what it raises
    is the engine's, as without kvaudit), then does kvaudit's part inside the guard
    (``guard.py``): a failure there is logged, counted (``internal_errors``), turns the
    requests in flight into unverified ones, and the hook answers vLLM what the wrapped
    connector answered. Only a configuration error stops the engine, at start-up."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.audit_config: AuditConfig = parse_config(extra.get(AUDIT_KEY))
        inner_config = self.inner_transfer_config(self._kv_transfer_config)
        self.wrapped: KVConnectorBase_V1 | None = None
        if inner_config is not None:
            created = KVConnectorFactory.create_connector(
                with_transfer_config(vllm_config, inner_config), role, kv_cache_config
            )
            assert isinstance(created, KVConnectorBase_V1)
            self.wrapped = created
        self._wrapped_class = class_path(type(self.wrapped) if self.wrapped else None)
        self.guard = AuditGuard(self._internal_error)
        # Per request being admitted: the local prefix-cache hit its load starts after,
        # and whether the load is asynchronous (get_num_new_matched_tokens).
        self._matched: dict[str, tuple[int, bool]] = {}
        self._warned_sync = False
        self._declined: set[str] = set()
        # Worker side: requests this worker could not check (no audit of its caches),
        # and held loads to report finished after an internal error let them go.
        self._unaudited: set[str] = set()
        self._let_go: set[str] = set()
        consumer = self._kv_transfer_config.is_kv_consumer
        if self.audit_config.policy == "fail" and inner_config is not None and consumer:
            refuse_sync_loading(inner_config)
        siblings = multiconnector_siblings()
        # A child of vLLM's MultiConnector under an audited name reports the wrapped
        # connector's stats only (MultiConnector rebuilds them with that name's class).
        self._stats_are_wrapped = self.audited_name is not None and siblings is not None
        if siblings:
            self._check_place_in_multiconnector(siblings)
        self.worker_audit: WorkerAudit | None = None
        self.scheduler_audit: SchedulerAudit | None = None
        with self.guard("__init__"):
            follow_vllm_logging()
            warn_if_untested()
            if role == KVConnectorRole.SCHEDULER:
                parallel = vllm_config.parallel_config
                self.scheduler_audit = SchedulerAudit(
                    self.audit_config,
                    group_layouts(kv_cache_config),
                    producer=self._kv_transfer_config.is_kv_producer,
                    world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
                    single_group=len(kv_cache_config.kv_cache_groups) == 1,
                )

    def _internal_error(self, hook: str) -> None:
        """After a failure of kvaudit's own code: the requests in flight are reported
        unverified, and loads held for a verdict are let go."""
        if self.scheduler_audit is not None:
            self.scheduler_audit.abandon()
        if self.worker_audit is not None:
            self._let_go |= self.worker_audit.abandon()

    def _check_place_in_multiconnector(self, earlier: list[Any]) -> None:
        """Refuse a second kvaudit connector among a MultiConnector's children (their
        ``kv_transfer_params`` keys would clash); warn a producer that is not the first
        child (an earlier child's params take kvaudit's in when ``request_finished``
        returns, before the checksums of a request's last step are in: its wire would
        be lost whenever that child hands back params, as NIXL's does)."""
        if any(isinstance(child, KVAuditConnector) for child in earlier):
            raise ValueError(
                "kvaudit: a MultiConnector holds two kvaudit connectors: audit it once, "
                'with "kv_connector": "MultiConnector", "kv_connector_module_path": '
                '"kvaudit.integrations.vllm.audited"'
            )
        if self._kv_transfer_config.is_kv_producer:
            logger.warning(
                "kvaudit: child %d of a MultiConnector: the producer's checksums are lost "
                "wherever an earlier child hands back kv_transfer_params; make kvaudit's "
                "child the first, or audit the MultiConnector itself (docs/vllm.md)",
                len(earlier),
            )

    @property
    def _connectors(self) -> list[KVConnectorBase_V1]:
        """The wrapped connector, where vLLM looks for a connector among another's
        children (as it does in MultiConnector's: SimpleCPUOffload's block count)."""
        return [self.wrapped] if self.wrapped is not None else []

    @property
    def engine_label(self) -> str:
        """The engine's name in records."""
        config = self._kv_transfer_config
        return self.audit_config.engine or f"vLLM {config.kv_role} {config.engine_id}"

    # Properties and class methods: the wrapped connector's.

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self.wrapped.supports_divergent_local_hybrid_hits if self.wrapped else False

    @property
    def requires_kv_delivery(self) -> bool:
        if self.wrapped is None:
            return super().requires_kv_delivery
        return self.wrapped.requires_kv_delivery

    # Worker side.

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        return self.wrapped.get_mem_pool_context() if self.wrapped else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        audited = isinstance(connector_metadata, KVAuditMetadata)
        inner = connector_metadata.inner if audited else connector_metadata
        if self.wrapped is not None and inner is not None:
            self.wrapped.bind_connector_metadata(inner)
        with self.guard("bind_connector_metadata"):
            step = connector_metadata.audit if audited else None
            if self.worker_audit is not None:
                self.worker_audit.bind(step)
            elif step is not None:  # nothing on this worker checks them: said, not hidden
                self._unaudited |= {job.request for job in step.jobs}

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.wrapped is not None:
            self.wrapped.clear_connector_metadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.wrapped is not None:
            self.wrapped.register_kv_caches(kv_caches)
        with self.guard("register_kv_caches"):
            self._start_worker_audit(kv_caches)

    def _start_worker_audit(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe the caches from the engine's KVCacheConfig and set up the checksums."""
        tp_rank, tp_size, pp_rank, pp_size = worker_ranks(self._vllm_config)
        worker = WorkerInfo(tp_rank, tp_size, pp_rank, pp_size, "consumer", self.engine_label)
        heads = model_kv_heads(self._vllm_config)
        # The attention modules, for the scales of a quantized (fp8) cache.
        modules = getattr(
            getattr(self._vllm_config, "compilation_config", None), "static_forward_context", None
        )
        description_dict, left_out = describe_vllm_cache(
            self._kv_cache_config, kv_caches, heads, modules if isinstance(modules, dict) else None
        )
        if not description_dict["groups"]:
            reasons = "; ".join(f"group {gid}: {why}" for gid, why in sorted(left_out.items()))
            logger.warning("kvaudit: no KV cache group of this worker can be audited (%s)", reasons)
            return
        description = parse_description(description_dict, "vLLM KVCacheConfig")
        self.worker_audit = WorkerAudit(
            description, description_dict, kv_caches, worker, self.audit_config, left_out
        )

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33's sleep mode; 0.32's connectors have no such method.
        if self.wrapped is not None and hasattr(self.wrapped, "unregister_kv_caches"):
            self.wrapped.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self.wrapped is not None and hasattr(self.wrapped, "restore_kv_caches"):
            self.wrapped.restore_kv_caches()

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        if self.wrapped is not None:
            self.wrapped.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        if self.wrapped is not None:
            self.wrapped.finish_forward()
        self._forward_done("finish_forward")

    def _forward_done(self, hook: str) -> None:
        with self.guard(hook):
            if self.worker_audit is not None:
                self.worker_audit.forward_done()

    def reset_capture_state(self) -> None:
        if self.wrapped is not None:
            self.wrapped.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVAuditMetadata):
            kv_connector_metadata = kv_connector_metadata.inner
        if self.wrapped is not None and kv_connector_metadata is not None:
            self.wrapped.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.wrapped is not None:
            self.wrapped.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.wrapped is not None:
            self.wrapped.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if self.wrapped is not None:
            self.wrapped.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        if self.wrapped is not None:
            self.wrapped.wait_for_save()
        self._forward_done("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.wrapped is None:
            return None, None
        sending, recving = self.wrapped.get_finished(finished_req_ids)
        finished, _ = self._audited_results(set(recving or ()), set(), finished_req_ids)
        return sending, finished if recving is not None or finished else recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.wrapped is not None:
            results = self.wrapped.get_transfer_results(finished_req_ids)
        else:
            results = KVConnectorTransferResults()
        finished, failed = self._audited_results(
            set(results.finished_recving), set(results.failed_recving), finished_req_ids
        )
        return KVConnectorTransferResults(results.finished_sending, finished, failed)

    def _audited_results(
        self, finished_recving: set[str], failed_recving: set[str], ended: set[str]
    ) -> tuple[set[str], set[str]]:
        """The finished and failed receives to report to vLLM: the wrapped connector's,
        less loads held for their verdict (policy ``fail``), plus loads let go."""
        out = finished_recving, failed_recving
        with self.guard("get_transfer_results"):
            if self.worker_audit is not None:
                out = self.worker_audit.transfer_results(
                    finished_recving, failed_recving, set(ended)
                )
        if self._let_go:  # held before an internal error: reported finished now
            out = out[0] | self._let_go, out[1]
            self._let_go = set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.wrapped.get_block_ids_with_load_errors() if self.wrapped else set()
        with self.guard("get_block_ids_with_load_errors"):
            if self.worker_audit is not None:
                return set(errors) | self.worker_audit.load_errors()
        return errors

    def shutdown(self) -> None:
        if self.wrapped is not None:
            self.wrapped.shutdown()
        with self.guard("shutdown"):
            if self.worker_audit is not None:
                self.worker_audit.close()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        inner = self.wrapped.get_kv_connector_stats() if self.wrapped else None
        if self._stats_are_wrapped:
            return inner
        stats = KVAuditStats(inner=inner, inner_class=self._wrapped_class)
        counts = stats.data[STATS_KEY]
        with self.guard("get_kv_connector_stats"):
            if self.scheduler_audit is not None:
                counts.update(self.scheduler_audit.take_counters().as_dict())
            if self.worker_audit is not None:
                counts.update(self.worker_audit.take_counters())
        counts["internal_errors"] = counts.get("internal_errors", 0) + self.guard.take_errors()
        return None if stats.is_empty() and inner is None else stats

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self.wrapped.get_kv_connector_kv_cache_events() if self.wrapped else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.wrapped.get_handshake_metadata() if self.wrapped else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        inner = self.wrapped.build_connector_worker_meta() if self.wrapped else None
        partials: list = []
        failed: set[str] = set()
        unverified, self._unaudited = self._unaudited, set()
        with self.guard("build_connector_worker_meta"):
            if self.worker_audit is not None:
                partials = self.worker_audit.partials()
                failed = self.worker_audit.failed_loads()
                unverified |= self.worker_audit.unverified()
        if inner is None and not partials and not failed and not unverified:
            return None
        return KVAuditWorkerMetadata(inner, partials, failed, unverified)

    # Scheduler side.

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._kv_cache_manager = kv_cache_manager
        if self.wrapped is not None:
            self.wrapped.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self.wrapped is not None:
            self.wrapped.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        if self.wrapped is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self.wrapped.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.wrapped is None:
            return 0, False
        tokens, load_async = self.wrapped.get_num_new_matched_tokens(request, num_computed_tokens)
        with self.guard("get_num_new_matched_tokens"):
            return self._matched_tokens(request, num_computed_tokens, tokens, load_async)
        return tokens, load_async

    def _matched_tokens(
        self, request: Request, num_computed_tokens: int, tokens: int | None, load_async: bool
    ) -> tuple[int | None, bool]:
        """The wrapped connector's answer, unless kvaudit declines the load."""
        audit = self.scheduler_audit
        if tokens and audit is not None and request.request_id in audit.failed_checks:
            # Its loaded KV failed its check: the rest is computed here, not loaded again.
            return 0, False
        if tokens and not load_async and self._declines_sync_load(request):
            return 0, False
        # The load covers the tokens past this (block-aligned) local prefix-cache hit.
        self._matched[request.request_id] = (int(num_computed_tokens), bool(load_async))
        return tokens, load_async

    def _declines_sync_load(self, request: Request) -> bool:
        """Under policy ``fail``, a synchronous load of a request with producer checksums
        is declined (vLLM computes its prompt itself): vLLM samples from a synchronous
        load in the step that loads it, before any check across the workers can end."""
        audit = self.scheduler_audit
        if self.audit_config.policy != "fail" or audit is None:
            return False
        if not audit.has_producer_checksums(request):
            return False
        if request.request_id not in self._declined:  # vLLM may ask again next step
            self._declined.add(request.request_id)
            audit.counters.declined_sync_loads += 1
        if not self._warned_sync:
            self._warned_sync = True
            logger.error(
                "kvaudit: policy fail: %s loaded request %s synchronously; kvaudit "
                "declines such loads (the prompt is computed here instead), since vLLM "
                "would sample from the KV before it could be checked (docs/vllm.md)",
                type(self.wrapped).__name__, request.request_id,
            )  # fmt: skip
        return True

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        if self.wrapped is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self.wrapped.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.wrapped is not None:
            self.wrapped.update_state_after_alloc(request, blocks, num_external_tokens)
        with self.guard("update_state_after_alloc"):
            self._after_alloc(request, blocks, num_external_tokens)

    def _after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        local, load_async = self._matched.pop(request.request_id, (0, False))
        if request.request_id in self._declined:
            self._declined.discard(request.request_id)  # this admission's load is declined
        elif self.scheduler_audit is not None:
            groups = self.get_loaded_kv_cache_group_ids(request) if num_external_tokens else None
            self.scheduler_audit.after_alloc(
                request, blocks.get_block_ids(), local, num_external_tokens,
                "async" if load_async else "sync", groups,
            )  # fmt: skip

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        inner = self.wrapped.build_connector_meta(scheduler_output) if self.wrapped else None
        step = AuditStep()
        with self.guard("build_connector_meta"):
            if self.scheduler_audit is not None:
                step = self.scheduler_audit.build(scheduler_output)
                self.scheduler_audit.forget(scheduler_output.finished_req_ids)
        return KVAuditMetadata(inner, step)

    def on_new_request(self, request: Request) -> None:
        if self.wrapped is not None:
            self.wrapped.on_new_request(request)
        with self.guard("on_new_request"):
            if self.scheduler_audit is not None:
                self.scheduler_audit.new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        audited = isinstance(meta, KVAuditWorkerMetadata)
        if audited:
            connector_output = dataclasses.replace(
                connector_output, kv_connector_worker_meta=meta.inner
            )
        if self.wrapped is not None:
            self.wrapped.update_connector_output(connector_output)
        with self.guard("update_connector_output"):
            if self.scheduler_audit is not None and audited:
                self.scheduler_audit.give_up(
                    meta.unverified, "a worker could not check it (see that worker's log)"
                )
                self.scheduler_audit.update(meta.partials)
                self.scheduler_audit.load_failed(meta.failed)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.wrapped is not None:
            delay_free, params = self.wrapped.request_finished(request, block_ids)
        else:
            delay_free, params = False, None
        return delay_free, self._finished(request, params)

    def _finished(self, request: Request, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The wrapped connector's params, with the producer's checksums where kvaudit
        has them (the wrapped connector's params alone if kvaudit fails)."""
        with self.guard("request_finished"):
            self._matched.pop(request.request_id, None)
            self._declined.discard(request.request_id)
            if self.scheduler_audit is not None:
                return self.scheduler_audit.finished(request, params)
        return params

    def register_finished_partial_tail(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        partial_tail_offloads: list[tuple[int, int, int]],
    ) -> bool:
        if self.wrapped is None:
            return False
        return self.wrapped.register_finished_partial_tail(
            request, block_ids, partial_tail_offloads
        )

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.wrapped.take_events() if self.wrapped else ()

    def has_pending_block_frees(self) -> bool:
        return self.wrapped.has_pending_block_frees() if self.wrapped else False

    def has_pending_push_work(self) -> bool:
        return self.wrapped.has_pending_push_work() if self.wrapped else False

    def get_finished_count(self) -> int | None:
        return self.wrapped.get_finished_count() if self.wrapped else None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        if self.wrapped is not None:
            self.wrapped.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        if self.wrapped is not None:
            self.wrapped.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        return self.wrapped.reset_cache() if self.wrapped else None
