"""kvaudit in a running vLLM: ``KVAuditConnector``, a v1 KV connector that checksums the KV
a producer sends and a consumer receives (docs/vllm.md).

Loaded by vLLM as ``"kv_connector": "KVAuditConnector", "kv_connector_module_path":
"kvaudit.integrations.vllm"``. The connector classes import vLLM when first asked for, so
that the output-folder reader (``kvaudit.output_folders``) works without it.
"""

from __future__ import annotations

from ...core.lazy import lazy_exports

_EXPORTS = {"KVAuditConnector": ".connector", "KVAuditHMAConnector": ".hma"}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
