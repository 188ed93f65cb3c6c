"""``KVAuditConnector``: a vLLM v1 KV connector that wraps the deployment's connector,
delegates every call to it unchanged, and audits the KV it sends and receives.

Configured one way, kvaudit's connector outermost: ``"kv_connector":
"KVAuditConnector"`` (module ``kvaudit.integrations.vllm``); under
``kv_connector_extra_config``, ``"kvaudit"`` holds the audit's settings (``config.py``)
and ``"wrapped"`` the wrapped connector's ``KVTransferConfig`` fields (any connector
vLLM's factory loads, ``MultiConnector`` included; its other fields are this
connector's). Without ``"wrapped"`` it audits on its own. The hooks are in
``worker_hooks.py`` and ``scheduler_hooks.py``, the class methods in
``class_queries.py``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from .class_queries import ClassQueries
from .config import AuditConfig, parse_config
from .engine import AUDIT_KEY, group_layouts, refuse_sync_loading, with_transfer_config
from .guard import AuditGuard
from .messages import STATS_KEY, KVAuditStats, class_path
from .name_checks import check_named_decisions, log_missed, wrapped_connector_names
from .scheduler import SchedulerAudit
from .scheduler_hooks import SchedulerHooks
from .versions import follow_vllm_logging, warn_if_untested
from .worker import WorkerAudit
from .worker_hooks import WorkerHooks

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvaudit.vllm")


class KVAuditConnector(ClassQueries, SchedulerHooks, WorkerHooks):
    """Audits the KV a wrapped connector moves: checksums on the producer when the KV is
    complete, on the consumer once loaded; the producer's wire in ``kv_transfer_params``
    under ``"kvaudit"``; mismatches logged, counted and (policy ``fail``) reported as load
    errors. Every call is delegated to the wrapped connector, its results unchanged.

    Each hook calls the wrapped connector first, outside kvaudit's guard (what it raises
    is the engine's, as without kvaudit), then does kvaudit's part inside the guard
    (``guard.py``): a failure there is logged, counted (``internal_errors``), turns the
    requests in flight into unverified ones, and the hook answers vLLM what the wrapped
    connector answered. Only a configuration error stops the engine, at start-up.

    Example:
        ``--kv-transfer-config`` of a decode engine auditing NIXL::

            {"kv_connector": "KVAuditConnector",
             "kv_connector_module_path": "kvaudit.integrations.vllm",
             "kv_role": "kv_consumer",
             "kv_connector_extra_config": {
                 "kvaudit": {"output": "/var/tmp/kvaudit/decode", "policy": "fail"},
                 "wrapped": {"kv_connector": "NixlConnector"}}}
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        """vLLM builds one per engine on the scheduler (role ``SCHEDULER``) and one per
        worker (role ``WORKER``), once the KV cache config is known; the wrapped
        connector is built here with the same role and caches.

        Raises:
            ValueError: A configuration error (kvaudit's settings, ``"wrapped"``, or what
                vLLM would refuse for the wrapped connector), in one line.
        """
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        self.audit_config: AuditConfig = parse_config(
            config.kv_connector_extra_config.get(AUDIT_KEY)
        )
        inner_config = self.inner_transfer_config(config)
        missed = check_named_decisions(vllm_config, inner_config, kv_cache_config)
        self.wrapped: KVConnectorBase_V1 | None = None
        if inner_config is not None:
            created = KVConnectorFactory.create_connector(
                with_transfer_config(vllm_config, inner_config), role, kv_cache_config
            )
            assert isinstance(created, KVConnectorBase_V1)
            self.wrapped = created
        self._wrapped_class = class_path(type(self.wrapped) if self.wrapped else None)
        self.guard = AuditGuard(self._internal_error)
        self._matched: dict[str, tuple[int, bool]] = {}
        self._warned_sync = False
        self._declined: set[str] = set()
        self._unaudited: set[str] = set()
        self._let_go: set[str] = set()
        consumer = config.is_kv_consumer
        if self.audit_config.policy == "fail" and inner_config is not None and consumer:
            refuse_sync_loading(inner_config)
        self.worker_audit: WorkerAudit | None = None
        self.scheduler_audit: SchedulerAudit | None = None
        with self.guard("__init__"):
            follow_vllm_logging()
            warn_if_untested()
            if role == KVConnectorRole.SCHEDULER:
                log_missed(missed, wrapped_connector_names(inner_config))
                self._hint_hma(vllm_config, inner_config)
                parallel = vllm_config.parallel_config
                self.scheduler_audit = SchedulerAudit(
                    self.audit_config,
                    group_layouts(kv_cache_config),
                    producer=config.is_kv_producer,
                    world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
                    single_group=len(kv_cache_config.kv_cache_groups) == 1,
                )

    def _hint_hma(self, vllm_config: VllmConfig, inner: KVTransferConfig | None) -> None:
        """Say which class keeps vLLM's hybrid memory allocator on, where vLLM turned it
        off for this class although the wrapped connector supports it (vLLM decides it
        from the configured class alone)."""
        if inner is None or not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
            return
        if not isinstance(self, SupportsHMA) and KVConnectorFactory.supports_hma_config(inner):
            logger.info(
                "kvaudit: vLLM's hybrid memory allocator is off; %s supports it: "
                '"kv_connector": "KVAuditHMAConnector" keeps it on (docs/vllm.md)',
                inner.kv_connector,
            )

    def _internal_error(self, hook: str) -> None:
        """After a failure of kvaudit's own code: the requests in flight are reported
        unverified, and loads held for a verdict are let go."""
        if self.scheduler_audit is not None:
            self.scheduler_audit.abandon()
        if self.worker_audit is not None:
            self._let_go |= self.worker_audit.abandon()

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """vLLM asks it when a local hybrid hit differs between groups: the wrapped
        connector's answer."""
        return self.wrapped.supports_divergent_local_hybrid_hits if self.wrapped else False

    @property
    def requires_kv_delivery(self) -> bool:
        """vLLM asks it whether the connector's KV must be delivered reliably: the
        wrapped connector's answer."""
        if self.wrapped is None:
            return super().requires_kv_delivery
        return self.wrapped.requires_kv_delivery

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """vLLM calls it after each step on the workers and on the scheduler; the stats
        travel to the process that logs them (``build_kv_connector_stats`` rebuilds
        them there). kvaudit's counters beside the wrapped connector's stats."""
        inner = self.wrapped.get_kv_connector_stats() if self.wrapped else None
        stats = KVAuditStats(inner=inner, inner_class=self._wrapped_class)
        counts = stats.data[STATS_KEY]
        with self.guard("get_kv_connector_stats"):
            if self.scheduler_audit is not None:
                counts.update(self.scheduler_audit.take_counters().as_dict())
            if self.worker_audit is not None:
                counts.update(self.worker_audit.take_counters())
        counts["internal_errors"] = counts.get("internal_errors", 0) + self.guard.take_errors()
        return None if stats.is_empty() and inner is None else stats
