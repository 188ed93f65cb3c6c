"""The cache description of a vLLM worker, built from the engine's own ``KVCacheConfig``
and the caches handed to ``register_kv_caches`` (no hand-written YAML).

vLLM hands each attention layer's cache as its standardized per-layer view ``[blocks,
heads, tokens, K row then V row]`` (kernel blocks, any strides), which is kvaudit's
``NHTC`` layout (an MLA latent: one head).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from ...core.dtypes import parse_dtype

# Most derived first: an MLA spec is a full-attention spec, a sliding-window MLA spec a
# sliding-window spec.
_TYPES: tuple[tuple[type, str], ...] = (
    (SlidingWindowMLASpec, "sliding_window_mla"),
    (MLAAttentionSpec, "mla"),
    (SlidingWindowSpec, "sliding_window"),
    (ChunkedLocalAttentionSpec, "chunked_local_attention"),
    (FullAttentionSpec, "full_attention"),
)


class NotDescribable(Exception):
    """A group kvaudit cannot describe from what vLLM hands over; the message says why."""


def describe_vllm_cache(
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
    model_kv_heads: int | None = None,
    attention_layers: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[int, str]]:
    """The description dict of this worker's caches, and the groups left out (id: why).

    Group ids are the indices of ``kv_cache_config.kv_cache_groups``. Where
    ``attention_layers`` holds a layer's ``Attention`` module and its cache is quantized
    (fp8), the layer's spec carries the module's ``k_scale`` and ``v_scale``
    (``layer_scales``).

    Args:
        kv_cache_config: The worker's ``KVCacheConfig``.
        kv_caches: The caches ``register_kv_caches`` was handed, by layer name.
        model_kv_heads: The model's KV heads, where every attention layer shares them.
        attention_layers: The attention modules by layer name (vLLM's
            ``compilation_config.static_forward_context``); None: no scales recorded.

    Returns:
        The description dict, and the groups left out with why.

    """
    groups = []
    left_out: dict[int, str] = {}
    drafts: list[str] = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        try:
            layers = []
            for name in group.layer_names:
                spec = _layer_spec(group.kv_cache_spec, name)
                if getattr(spec, "is_draft", False):  # vLLM 0.33's specs say; 0.32's do not
                    drafts.append(name)
                cache = kv_caches.get(name)
                if cache is None:
                    raise NotDescribable(f"layer {name} has no cache in register_kv_caches")
                layer_spec = _attention_spec(spec, cache, name)
                layer_spec.update(layer_scales((attention_layers or {}).get(name), layer_spec))
                layers.append({"name": name, "spec": layer_spec})
        except NotDescribable as error:
            left_out[group_id] = str(error)
            continue
        group_spec = layers[0]["spec"]
        entries: list[Any] = []
        for layer in layers:
            override = {k: v for k, v in layer["spec"].items() if group_spec.get(k) != v}
            override.update({k: None for k in group_spec if k not in layer["spec"]})
            entries.append({"name": layer["name"], "spec": override} if override else layer["name"])
        groups.append(
            {
                "id": group_id,
                "transfer": bool(group.enable_kv_transfer),
                "host_resident": bool(group.host_resident),
                "spec": group_spec,
                "layers": entries,
            }
        )
    description: dict[str, Any] = {
        "kvaudit": 1,
        "num_blocks": int(kv_cache_config.num_blocks),
        "groups": groups,
    }
    if model_kv_heads is not None:
        description["model_kv_heads"] = int(model_kv_heads)
    if drafts:
        description["draft_layers"] = drafts
    return description, left_out


def _scale_of(module: Any, name: str) -> float | None:
    """A module's scale ``name`` (``k_scale``, ``v_scale``): its host copy
    ``_{name}_float`` where it has one (what vLLM's backends read), else its one-element
    tensor ``_{name}``; None where it has neither or the value is not a positive finite
    number."""
    value = getattr(module, f"_{name}_float", None)
    if value is None:
        tensor = getattr(module, f"_{name}", None)
        if isinstance(tensor, torch.Tensor) and tensor.numel() == 1:
            value = tensor.detach().to("cpu", torch.float64).item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None


def layer_scales(module: Any, spec: Mapping[str, Any]) -> dict[str, float]:
    """The K and V scales of one attention module, for its layer's spec: only where its
    cache is quantized (a one-byte dtype, or ``kv_cache_dtype`` other than ``auto``):
    vLLM keeps scales of 1.0 on every layer, which an unquantized cache never applies.
    An MLA layer (no V rows) gets its K scale only.

    Args:
        module: The layer's ``Attention`` (or MLA attention) module; None: no scales.
        spec: The layer's spec dict as ``describe_vllm_cache`` builds it.

    Returns:
        ``k_scale`` and ``v_scale`` where the module has them, else nothing.

    """
    if module is None:
        return {}
    quantized = str(getattr(module, "kv_cache_dtype", "auto")) != "auto"
    try:
        one_byte = parse_dtype(str(spec["dtype"])).itemsize == 1
    except ValueError:
        one_byte = False
    if not (quantized or one_byte):
        return {}
    found = {key: _scale_of(module, key) for key in ("k_scale", "v_scale")}
    if not spec.get("head_size_v"):
        found.pop("v_scale")
    return {key: value for key, value in found.items() if value is not None}


def _layer_spec(spec: KVCacheSpec, name: str) -> KVCacheSpec:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[name]
    return spec


def _attention_spec(spec: KVCacheSpec, cache: torch.Tensor, name: str) -> dict[str, Any]:
    """One attention layer's spec dict, its layout read from its ``[B, H, N, C]`` view."""
    kind = next((kind for cls, kind in _TYPES if isinstance(spec, cls)), None)
    if kind is None or not isinstance(spec, AttentionSpec):
        raise NotDescribable(f"{type(spec).__name__} of layer {name} is not an attention spec")
    if spec.num_head_slots is not None or spec.tokens_per_state != 1:
        raise NotDescribable(f"layer {name} packs heads or tokens into slots")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise NotDescribable(
            f"layer {name}: expected a [blocks, heads, tokens, cell] view, got {shape}"
        )
    mla = kind in ("mla", "sliding_window_mla")
    heads, tokens, cell = (int(x) for x in cache.shape[1:])
    head_size_v = 0 if mla else spec.head_size_v
    if cell != spec.head_size + head_size_v or heads != (1 if mla else spec.num_kv_heads):
        raise NotDescribable(
            f"layer {name}: its cache view {tuple(cache.shape)} does not match its spec "
            f"({spec.num_kv_heads} heads, K {spec.head_size} + V {head_size_v})"
        )
    if spec.block_size % tokens:
        raise NotDescribable(
            f"layer {name}: {tokens}-token kernel blocks do not tile {spec.block_size}"
        )
    out: dict[str, Any] = {
        "type": kind,
        "spec_class": type(spec).__name__,
        "block_size": int(spec.block_size),
        "kernel_block_size": tokens,
        "head_size": int(spec.head_size),
        "dtype": str(spec.dtype),
        "layout": "NHTC",
    }
    if not mla:
        out["num_kv_heads"] = int(spec.num_kv_heads)
        out["head_size_v"] = int(spec.head_size_v)
    if spec.max_tp_shards is not None:
        out["max_tp_shards"] = int(spec.max_tp_shards)
    if isinstance(spec, SlidingWindowSpec):
        out["sliding_window"] = int(spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        out["attention_chunk_size"] = int(spec.attention_chunk_size)
    return out
