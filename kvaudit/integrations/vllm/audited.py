"""vLLM's connectors, audited, under their own names: ``"kv_connector": "NixlConnector",
"kv_connector_module_path": "kvaudit.integrations.vllm.audited"`` loads kvaudit's
connector wrapping vLLM's ``NixlConnector`` (docs/vllm.md).

vLLM configures itself around the connector it is given by name
(``KVTransferConfig.has_connector``: NIXL's context-parallel checks and block-size
alignment, the CPU offload's block counts, the routed-experts rejection): a class named
as the connector it wraps keeps every one of those decisions what it is without kvaudit.
Any connector in vLLM's registry can be named, ``MultiConnector`` included.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

from .connector import KVAuditConnector
from .hma import KVAuditHMAConnector

_CLASSES: dict[str, type[KVAuditConnector]] = {}


def audited_connector(name: str) -> type[KVAuditConnector]:
    """kvaudit's connector class that wraps vLLM's connector ``name``, named ``name``.

    Args:
        name: A connector in vLLM's registry (``NixlConnector``, ``MultiConnector``, ...).

    Returns:
        A subclass of ``KVAuditHMAConnector`` when vLLM's connector supports the hybrid
        memory allocator, of ``KVAuditConnector`` otherwise; one class per name.

    Raises:
        AttributeError: ``name`` is not in vLLM's registry.

    """
    if name not in _CLASSES:
        try:
            wrapped = KVConnectorFactory.get_connector_class_by_name(name)
        except ValueError:
            raise AttributeError(
                f"{__name__} has no connector {name!r}: it is not in vLLM's registry"
            ) from None
        base = KVAuditHMAConnector if supports_hma(wrapped) else KVAuditConnector
        _CLASSES[name] = type(
            name, (base,), {"__module__": __name__, "__qualname__": name, "audited_name": name}
        )
    return _CLASSES[name]


def __getattr__(name: str) -> Any:
    """The audited class of vLLM's connector ``name`` (what vLLM's factory asks for)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return audited_connector(name)
