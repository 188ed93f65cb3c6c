"""``KVAuditHMAConnector``: kvaudit's connector for a wrapped connector that supports
vLLM's hybrid memory allocator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)

from .connector import KVAuditConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVAuditHMAConnector(KVAuditConnector, SupportsHMA):
    """``KVAuditConnector`` for a wrapped connector that supports vLLM's hybrid memory
    allocator (several KV cache groups), so that vLLM keeps HMA on: vLLM decides it
    from the configured class alone (``supports_hma``), before any instance exists."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.wrapped is not None and not supports_hma(self.wrapped):
            raise ValueError(
                f"KVAuditHMAConnector wraps {type(self.wrapped).__name__}, which does not "
                "support HMA: use KVAuditConnector"
            )

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls it in place of ``request_finished`` for an HMA connector, exactly
        once when a request ends, with its blocks of every KV cache group."""
        if self.wrapped is not None:
            assert isinstance(self.wrapped, SupportsHMA)
            delay_free, params = self.wrapped.request_finished_all_groups(request, block_ids)
        else:
            delay_free, params = False, None
        return delay_free, self._finished(request, params)
