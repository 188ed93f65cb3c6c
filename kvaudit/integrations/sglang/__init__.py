"""kvaudit with SGLang: the cache description of an SGLang worker built from its own KV
pool, the pool's tensors as kvaudit reads them, and a request's blocks from its
``req_to_token`` row (``describe``); the pool served to ``live:`` clients (``live``)
(docs/sglang.md).

The names import SGLang (``describe``) when first asked for, so that importing this
package alone needs no SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.lazy import lazy_exports

if TYPE_CHECKING:
    from .describe import (
        DEFAULT_LAYER_NAME,
        HeadShard,
        NotDescribable,
        describe_sglang_cache,
        sglang_kv_heads,
        sglang_layer_caches,
        write_cache_yaml,
    )
    from .live import HeldRequests, sglang_agent
    from .pages import pool_request_blocks, request_blocks
    from .scales import sglang_attention_layers

__all__ = [
    "DEFAULT_LAYER_NAME",
    "HeadShard",
    "HeldRequests",
    "NotDescribable",
    "describe_sglang_cache",
    "pool_request_blocks",
    "request_blocks",
    "sglang_agent",
    "sglang_attention_layers",
    "sglang_kv_heads",
    "sglang_layer_caches",
    "write_cache_yaml",
]

_EXPORTS = {
    **dict.fromkeys(__all__, ".describe"),
    **dict.fromkeys(("HeldRequests", "sglang_agent"), ".live"),
    **dict.fromkeys(("pool_request_blocks", "request_blocks"), ".pages"),
    "sglang_attention_layers": ".scales",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
