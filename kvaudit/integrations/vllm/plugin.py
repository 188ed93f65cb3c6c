"""kvaudit's vLLM plugin (entry point ``vllm.general_plugins``): names kvaudit's connector
classes in vLLM's connector registry, in every vLLM process, so that vLLM finds them by
name where it has only the name (``"kv_connector": "KVAuditConnector"`` without a module
path; a ``MultiConnector`` rebuilding a child's connector stats in the API server).
"""

from __future__ import annotations

CLASSES = {
    "KVAuditConnector": "kvaudit.integrations.vllm.connector",
    "KVAuditHMAConnector": "kvaudit.integrations.vllm.hma",
}


def register() -> None:
    """Register kvaudit's connector classes with vLLM's factory (lazily: nothing of
    kvaudit is imported until vLLM asks for a class); a name already there is kept."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in CLASSES.items():
        try:
            KVConnectorFactory.register_connector(name, module, name)
        except ValueError:  # registered already (vLLM may load plugins more than once)
            continue
