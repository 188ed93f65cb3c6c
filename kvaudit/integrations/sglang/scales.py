"""The K and V scales of an SGLang model's fp8 KV cache, read from its ``RadixAttention``
layers (what ``describe_sglang_cache`` records; docs/sglang.md)."""

from __future__ import annotations

import math
from typing import Any

import torch


def layer_scales(layer: Any, mla: bool) -> dict[str, float]:
    """A ``RadixAttention``'s loaded K and V scales (``k_scale_float``, ``v_scale_float``;
    None until SGLang's ``BaseKVCacheMethod`` loads them, and where the model has no KV
    cache quantization); an MLA layer (one latent row) its K scale only."""
    found: dict[str, float] = {}
    for key in ("k_scale", "v_scale")[: 1 if mla else 2]:
        value = getattr(layer, f"{key}_float", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if math.isfinite(value) and value > 0:
                found[key] = value
    return found


def sglang_attention_layers(model: Any) -> dict[int, Any]:
    """The ``RadixAttention`` layers of an SGLang model by their global layer id (what
    ``describe_sglang_cache`` reads the scales of).

    Args:
        model: The model (``scheduler.tp_worker.model_runner.model``), or None.

    Returns:
        Each attention layer by ``layer_id``; empty where there are none.

    """
    from sglang.srt.layers.radix_attention import RadixAttention

    if not isinstance(model, torch.nn.Module):
        return {}
    return {
        int(module.layer_id): module
        for module in model.modules()
        if isinstance(module, RadixAttention)
    }
