"""kvaudit in a running vLLM: ``KVAuditConnector``, a v1 KV connector that checksums the KV
a producer sends and a consumer receives (docs/vllm.md).

Loaded by vLLM as ``"kv_connector": "KVAuditConnector", "kv_connector_module_path":
"kvaudit.integrations.vllm"``. The connector classes import vLLM when first asked for, so
that the output-folder reader (``kvaudit.output_folders``) works without it.
"""

from __future__ import annotations

from typing import Any

_CONNECTORS = ("KVAuditConnector", "KVAuditHMAConnector")


def __getattr__(name: str) -> Any:
    """The connector classes, imported (with vLLM) on first use."""
    if name == "KVAuditConnector":
        from .connector import KVAuditConnector

        return KVAuditConnector
    if name == "KVAuditHMAConnector":
        from .hma import KVAuditHMAConnector

        return KVAuditHMAConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_CONNECTORS)
