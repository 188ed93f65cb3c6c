"""The worker side of ``KVAuditConnector``: the hooks vLLM calls in each worker process,
around the model's forward pass, each delegated to the wrapped connector first.

vLLM builds one worker-side connector per worker (``KVConnectorRole.WORKER``) once the
worker's KV cache config is known, and calls these hooks from its model runner on the
worker's main thread. Within a step (vLLM 0.32 and 0.33, both model runners):
``bind_connector_metadata``; ``start_load_kv`` (before the forward when the step has a
synchronous load, after its launch otherwise); the forward (``wait_for_layer_load`` and
``save_kv_layer`` per attention layer); ``finish_forward`` (the V2 model runner);
``wait_for_save`` (deferred to the step's end when vLLM overlaps steps);
``get_transfer_results``, ``get_block_ids_with_load_errors``,
``get_kv_connector_stats``, ``get_kv_connector_kv_cache_events``,
``build_connector_worker_meta``; ``clear_connector_metadata``. A step without scheduled
tokens still binds, asks for results and clears.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.attention.backend import AttentionMetadata

from ...description import parse_description
from ...records import WorkerInfo
from .config import AuditConfig
from .describe import describe_vllm_cache
from .engine import model_kv_heads, worker_ranks
from .guard import AuditGuard
from .messages import KVAuditMetadata, KVAuditWorkerMetadata
from .worker import WorkerAudit

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVConnectorKVEvents
    from vllm.forward_context import ForwardContext

logger = logging.getLogger("kvaudit.vllm")


class WorkerHooks(KVConnectorBase_V1):
    """Worker-side hooks of ``KVAuditConnector`` (``connector.py`` builds the state).

    Each calls the wrapped connector first, outside kvaudit's guard; kvaudit's part runs
    inside it, so that a failure of kvaudit's own leaves the hook answering vLLM what
    the wrapped connector answered."""

    wrapped: KVConnectorBase_V1 | None
    guard: AuditGuard
    audit_config: AuditConfig
    worker_audit: WorkerAudit | None
    # Requests this worker could not check (no audit of its caches), and held loads to
    # report finished after an internal error let them go.
    _unaudited: set[str]
    _let_go: set[str]

    @property
    def engine_label(self) -> str:
        """The engine's name in records."""
        config = self._kv_transfer_config
        return self.audit_config.engine or f"vLLM {config.kv_role} {config.engine_id}"

    def get_mem_pool_context(self) -> AbstractContextManager | None:
        """vLLM calls it once, before allocating the KV caches: the wrapped connector's
        allocation context (kvaudit needs none)."""
        return self.wrapped.get_mem_pool_context() if self.wrapped else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM calls it once, after the worker allocated its KV caches and before the
        first forward; the tensors stay in place until ``unregister_kv_caches`` (sleep
        mode). kvaudit describes them from the KV cache config and sets up its
        checksums; a cache it cannot describe is logged and not audited."""
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
        """vLLM 0.33 calls it before sleep mode releases the caches, transfers drained
        (vLLM 0.32's connectors have no such method: asked only where there is one)."""
        if self.wrapped is not None and hasattr(self.wrapped, "unregister_kv_caches"):
            self.wrapped.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 calls it after wake-up, the caches back in place."""
        if self.wrapped is not None and hasattr(self.wrapped, "restore_kv_caches"):
            self.wrapped.restore_kv_caches()

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        """vLLM calls it once at start-up with the platform's host-copy operation."""
        if self.wrapped is not None:
            self.wrapped.set_host_xfer_buffer_ops(copy_operation)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls it at the start of each step, before the forward, with what this
        connector's scheduler side built for the step (``KVAuditMetadata``: the wrapped
        connector's metadata and kvaudit's jobs). The wrapped connector gets its own."""
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

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls it before the forward of a step that preempted requests, before
        their blocks can be overwritten (the wrapped connector's metadata passed on)."""
        if isinstance(kv_connector_metadata, KVAuditMetadata):
            kv_connector_metadata = kv_connector_metadata.inner
        if self.wrapped is not None and kv_connector_metadata is not None:
            self.wrapped.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """vLLM calls it each step after ``bind_connector_metadata``, under the step's
        forward context."""
        if self.wrapped is not None:
            self.wrapped.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """vLLM calls it in each attention layer's forward, before it reads its KV."""
        if self.wrapped is not None:
            self.wrapped.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """vLLM calls it in each attention layer's forward, after it wrote its KV."""
        if self.wrapped is not None:
            self.wrapped.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        """vLLM calls it after each forward, the step's KV written (or at the step's end
        when it overlaps steps): kvaudit takes the checksums of this step's jobs
        (producer, synchronous loads) unless ``finish_forward`` did."""
        if self.wrapped is not None:
            self.wrapped.wait_for_save()
        self._forward_done("wait_for_save")

    def finish_forward(self) -> None:
        """vLLM's V2 model runner calls it once the model no longer reads this step's KV:
        kvaudit takes the checksums of this step's jobs."""
        if self.wrapped is not None:
            self.wrapped.finish_forward()
        self._forward_done("finish_forward")

    def _forward_done(self, hook: str) -> None:
        with self.guard(hook):
            if self.worker_audit is not None:
                self.worker_audit.forward_done()

    def reset_capture_state(self) -> None:
        """vLLM calls it after capturing CUDA graphs (kvaudit captures nothing)."""
        if self.wrapped is not None:
            self.wrapped.reset_capture_state()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The older form of ``get_transfer_results`` (vLLM 0.32 and 0.33 ask that one):
        the wrapped connector's finished sends and receives, receives held for their
        verdict (policy ``fail``) reported once checked."""
        if self.wrapped is None:
            return None, None
        sending, recving = self.wrapped.get_finished(finished_req_ids)
        finished, _ = self._audited_results(set(recving or ()), set(), finished_req_ids)
        return sending, finished if recving is not None or finished else recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM calls it after each forward, with the requests that ended this step: the
        wrapped connector's finished sends, finished and failed receives; a receive that
        finished is checksummed here, and under policy ``fail`` held until its verdict."""
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
        """vLLM calls it after each step's results: the wrapped connector's failed
        blocks, and under policy ``fail`` the blocks whose check failed."""
        errors = self.wrapped.get_block_ids_with_load_errors() if self.wrapped else set()
        with self.guard("get_block_ids_with_load_errors"):
            if self.worker_audit is not None:
                return set(errors) | self.worker_audit.load_errors()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """vLLM calls it after each forward and sends the result to the scheduler side
        (``update_connector_output``), summed over the workers by ``aggregate``: this
        worker's checksums, failed loads and unverified requests beside the wrapped
        connector's metadata."""
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

    def clear_connector_metadata(self) -> None:
        """vLLM calls it at the end of each step, after the step's results."""
        super().clear_connector_metadata()
        if self.wrapped is not None:
            self.wrapped.clear_connector_metadata()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """vLLM calls it each step for the wrapped connector's KV cache events."""
        return self.wrapped.get_kv_connector_kv_cache_events() if self.wrapped else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """vLLM calls it once after ``register_kv_caches``, for the scheduler side."""
        return self.wrapped.get_handshake_metadata() if self.wrapped else None

    def shutdown(self) -> None:
        """vLLM calls it when the worker (or the scheduler) shuts down: kvaudit closes
        its output files and live agent."""
        if self.wrapped is not None:
            self.wrapped.shutdown()
        with self.guard("shutdown"):
            if self.worker_audit is not None:
                self.worker_audit.close()
