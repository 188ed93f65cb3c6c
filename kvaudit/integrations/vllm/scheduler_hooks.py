"""The scheduler side of ``KVAuditConnector``: the hooks vLLM's scheduler calls in the
engine-core process, each delegated to the wrapped connector first.

vLLM builds one scheduler-side connector per engine (``KVConnectorRole.SCHEDULER``) in
its ``Scheduler``, and calls these hooks from the scheduler's thread only. A request
goes through ``on_new_request`` when added; ``get_num_new_matched_tokens`` each step it
waits to be admitted (asked again while it waits); ``update_state_after_alloc`` once per
admission, after its blocks are allocated; ``request_finished`` exactly once when it
ends (finished or aborted), before its blocks are freed. Each step ends with
``build_connector_meta`` (sent to the workers' ``bind_connector_metadata``), and the
workers' results of a step come back in ``update_connector_output`` (with asynchronous
scheduling, a step later).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from .config import AuditConfig
from .guard import AuditGuard
from .jobs import AuditStep
from .messages import KVAuditMetadata, KVAuditWorkerMetadata
from .scheduler import SchedulerAudit

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request

logger = logging.getLogger("kvaudit.vllm")


class SchedulerHooks(KVConnectorBase_V1):
    """Scheduler-side hooks of ``KVAuditConnector`` (``connector.py`` builds the state).

    Each calls the wrapped connector first, outside kvaudit's guard; kvaudit's part runs
    inside it, so that a failure of kvaudit's own leaves the hook answering vLLM what
    the wrapped connector answered."""

    wrapped: KVConnectorBase_V1 | None
    guard: AuditGuard
    audit_config: AuditConfig
    scheduler_audit: SchedulerAudit | None
    # Per request being admitted: the local prefix-cache hit its load starts after, and
    # whether the load is asynchronous (get_num_new_matched_tokens).
    _matched: dict[str, tuple[int, bool]]
    _declined: set[str]
    _warned_sync: bool

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM calls it once, after building the scheduler's cache manager."""
        self._kv_cache_manager = kv_cache_manager
        if self.wrapped is not None:
            self.wrapped.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """vLLM calls it once, with the block pool of the scheduler's cache manager."""
        if self.wrapped is not None:
            self.wrapped.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        """vLLM calls it when a request is added to the scheduler, before it is
        scheduled: kvaudit notes the producer's checksums it brings, if any."""
        if self.wrapped is not None:
            self.wrapped.on_new_request(request)
        with self.guard("on_new_request"):
            if self.scheduler_audit is not None:
                self.scheduler_audit.new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """vLLM calls it for a waiting request each step it tries to admit it, after the
        local prefix-cache lookup (``num_computed_tokens``, block-aligned): the wrapped
        connector's answer, or none under policy ``fail`` when kvaudit declines the load
        (a synchronous one, or a request whose loaded KV already failed its check)."""
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

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """vLLM calls it after ``get_num_new_matched_tokens`` returned a positive count:
        the KV cache groups the wrapped connector's load restores."""
        if self.wrapped is None:
            return super().get_loaded_kv_cache_group_ids(request)
        return self.wrapped.get_loaded_kv_cache_group_ids(request)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        """vLLM calls it for its cache-hit stats after an external hit."""
        if self.wrapped is None:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return self.wrapped.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """vLLM calls it once per admission, after allocating the request's blocks, with
        the tokens the connector is to load (0: none): kvaudit records which block
        positions a consumer loads, to check them once loaded."""
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
        """vLLM calls it once per step, after scheduling it, and hands the result to
        every worker (``bind_connector_metadata``); ``scheduler_output`` is read, never
        changed. kvaudit adds the step's checksum jobs to the wrapped metadata."""
        inner = self.wrapped.build_connector_meta(scheduler_output) if self.wrapped else None
        step = AuditStep()
        with self.guard("build_connector_meta"):
            if self.scheduler_audit is not None:
                step = self.scheduler_audit.build(scheduler_output)
                self.scheduler_audit.forget(scheduler_output.finished_req_ids)
        return KVAuditMetadata(inner, step)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """vLLM calls it once per step's results, with the workers' outputs aggregated:
        the wrapped connector gets its own worker metadata; kvaudit sums the workers'
        checksums and, once every worker's are in, gives each request its verdict."""
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
        """vLLM calls it exactly once when a request ends, before freeing its blocks:
        the wrapped connector's answer, its ``kv_transfer_params`` with the producer's
        checksums added (filled in later in the same dict when the last step's are
        still on their way)."""
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
        """vLLM calls it when a request ends, before block cleanup, for connectors that
        offload a partial last block."""
        if self.wrapped is None:
            return False
        return self.wrapped.register_finished_partial_tail(
            request, block_ids, partial_tail_offloads
        )

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM calls it each step for the wrapped connector's KV cache events."""
        return self.wrapped.take_events() if self.wrapped else ()

    def has_pending_block_frees(self) -> bool:
        """vLLM asks it before preempting: whether pending transfers will free blocks."""
        return self.wrapped.has_pending_block_frees() if self.wrapped else False

    def has_pending_push_work(self) -> bool:
        """vLLM asks it whether the connector still has blocks to push to a consumer."""
        return self.wrapped.has_pending_push_work() if self.wrapped else False

    def get_finished_count(self) -> int | None:
        """vLLM asks it once, for how many workers report each finished transfer."""
        return self.wrapped.get_finished_count() if self.wrapped else None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """vLLM calls it once at start-up with every worker's handshake metadata."""
        if self.wrapped is not None:
            self.wrapped.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """vLLM calls it once at start-up, as above, keyed by pipeline stage and rank."""
        if self.wrapped is not None:
            self.wrapped.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        """vLLM calls it when its prefix cache is reset."""
        return self.wrapped.reset_cache() if self.wrapped else None
