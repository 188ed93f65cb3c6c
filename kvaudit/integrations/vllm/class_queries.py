"""The questions vLLM asks of a connector's class before any instance exists (its KV cache
layout, sleep mode, CUDA graph mode, stats and Prometheus metrics), answered for kvaudit's
connector by the class of the connector it wraps (named under ``"wrapped"``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from .engine import WRAPPED_KEY, with_transfer_config, wrapped_transfer_config
from .messages import KVAuditPromMetrics, KVAuditStats
from .name_checks import wrapped_connector_names

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )


class ClassQueries:
    """The class methods of ``KVAuditConnector``: each asks the wrapped connector's class
    and answers as it does. vLLM calls them with the engine's config (kvaudit's
    connector outermost) before any connector instance exists, and in processes where
    none will (the API server rebuilding stats, building Prometheus metrics)."""

    @classmethod
    def inner_transfer_config(cls, config: KVTransferConfig) -> KVTransferConfig | None:
        """The wrapped connector's ``KVTransferConfig`` (None: nothing wrapped)."""
        return wrapped_transfer_config(config)

    @classmethod
    def wrapped_connector_names(cls, kv_transfer_config: KVTransferConfig) -> tuple[str, ...]:
        """The connector names vLLM's ``has_connector`` should also see behind this one:
        the wrapped connector's and, for a ``MultiConnector``, its children's.

        The hook docs/vllm.md proposes to vLLM: ``has_connector(name)`` asking the
        configured class this, so that vLLM's name-based decisions see the wrapped
        connector (today kvaudit checks them itself: ``name_checks.py``).

        Args:
            kv_transfer_config: kvaudit's connector's transfer config.

        Returns:
            The names, the wrapped connector's first (empty: nothing wrapped).
        """
        return wrapped_connector_names(cls.inner_transfer_config(kv_transfer_config))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Whether the wrapped connector follows sleep mode's KV cache remap (vLLM asks
        when validating a config with sleep mode on; kvaudit alone: yes)."""
        inner = cls.inner_transfer_config(kv_transfer_config)
        if inner is None:
            return True
        return KVConnectorFactory.get_connector_class(inner).supports_sleep_mode(inner)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The KV cache layout the wrapped connector needs (vLLM asks before the
        attention backends choose theirs; kvaudit reads any layout)."""
        assert vllm_config.kv_transfer_config is not None
        inner = cls.inner_transfer_config(vllm_config.kv_transfer_config)
        if inner is None:
            return None
        wrapped = KVConnectorFactory.get_connector_class(inner)
        return wrapped.get_required_kvcache_layout(with_transfer_config(vllm_config, inner))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Whether the wrapped connector needs PIECEWISE CUDA graphs (vLLM asks when
        resolving the compilation config, with this connector's extra config)."""
        wrapped = extra_config.get(WRAPPED_KEY)
        if not isinstance(wrapped, dict) or not wrapped.get("kv_connector"):
            return False
        # The role only satisfies the config's validation: the class is what is asked.
        inner = KVTransferConfig(**{"kv_role": "kv_both", **wrapped})
        return KVConnectorFactory.get_connector_class(inner).requires_piecewise_for_cudagraph(
            inner.kv_connector_extra_config
        )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """kvaudit's stats rebuilt from ``to_dict``'s data (vLLM calls it in the process
        that logs them, which may hold no connector), the wrapped connector's inside."""
        return KVAuditStats.from_dict(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """kvaudit's Prometheus counters beside the wrapped connector's metrics (vLLM
        calls it once per stat logger, in the API server)."""
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
