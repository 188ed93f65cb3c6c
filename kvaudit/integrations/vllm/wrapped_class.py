"""The questions vLLM asks of a connector's class before any instance exists (its config's
layout, sleep mode, CUDA graphs, stats and Prometheus metrics), answered for kvaudit's
connector by the class of the connector it wraps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from .engine import AUDIT_KEY, WRAPPED_KEY, with_transfer_config, wrapped_transfer_config
from .messages import KVAuditPromMetrics, KVAuditStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )


class WrappedClassQueries:
    """The class methods of ``KVAuditConnector``: each asks the wrapped connector's class
    (the one named under ``"wrapped"``, or ``audited_name``) and answers as it does."""

    audited_name: ClassVar[str | None] = None
    """The vLLM connector a class of ``kvaudit.integrations.vllm.audited`` is named after
    and audits (None: the one named under ``"wrapped"``)."""

    @classmethod
    def inner_transfer_config(cls, config: KVTransferConfig) -> KVTransferConfig | None:
        """The wrapped connector's ``KVTransferConfig`` (None: nothing wrapped)."""
        return wrapped_transfer_config(config, cls.audited_name)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        inner = cls.inner_transfer_config(kv_transfer_config)
        if inner is None:
            return True
        return KVConnectorFactory.get_connector_class(inner).supports_sleep_mode(inner)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        assert vllm_config.kv_transfer_config is not None
        inner = cls.inner_transfer_config(vllm_config.kv_transfer_config)
        if inner is None:
            return None
        wrapped = KVConnectorFactory.get_connector_class(inner)
        return wrapped.get_required_kvcache_layout(with_transfer_config(vllm_config, inner))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        if cls.audited_name is not None:
            own = {k: v for k, v in extra_config.items() if k != AUDIT_KEY}
            wrapped_cls = KVConnectorFactory.get_connector_class_by_name(cls.audited_name)
            return wrapped_cls.requires_piecewise_for_cudagraph(own)
        wrapped = extra_config.get(WRAPPED_KEY)
        if not wrapped:
            return False
        # The role only satisfies the config's validation: the class is what is asked.
        inner = KVTransferConfig(**{"kv_role": "kv_both", **wrapped})
        return KVConnectorFactory.get_connector_class(inner).requires_piecewise_for_cudagraph(
            inner.kv_connector_extra_config
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVAuditStats.from_dict(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        assert vllm_config.kv_transfer_config is not None
        inner = cls.inner_transfer_config(vllm_config.kv_transfer_config)
        wrapped = None
        if inner is not None:
            wrapped = KVConnectorFactory.get_connector_class(inner).build_prom_metrics(
                with_transfer_config(vllm_config, inner), metric_types, labelnames,
                per_engine_labelvalues,
            )  # fmt: skip
        return KVAuditPromMetrics(
            wrapped, vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
