"""kvaudit with SGLang: the cache description of an SGLang worker built from its own KV
pool, the pool's tensors as kvaudit reads them, and a request's blocks from its
``req_to_token`` row (``describe``); the pool served to ``live:`` clients (``live``)
(docs/sglang.md).

The names import SGLang (``describe``, ``pools``) when first asked for, so that importing this
package alone needs no SGLang.
"""

from __future__ import annotations

from ...core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ("describe_sglang_cache", "sglang_layer_caches", "write_cache_yaml"), ".describe"
    ),
    **dict.fromkeys(("HeldRequests", "sglang_agent"), ".live"),
    **dict.fromkeys(("pool_request_blocks", "request_blocks"), ".pages"),
    **dict.fromkeys(
        ("DEFAULT_LAYER_NAME", "HeadShard", "NotDescribable", "sglang_kv_heads"), ".pools"
    ),
    "sglang_attention_layers": ".scales",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
