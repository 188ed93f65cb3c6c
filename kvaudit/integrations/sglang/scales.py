"""The K and V scales of an SGLang model's fp8 KV cache, read from its ``RadixAttention``
layers (what ``describe_sglang_cache`` records; docs/sglang.md)."""

from __future__ import annotations

import math

import torch

from . import hooked


def layer_scales(layer: torch.nn.Module | None, mla: bool) -> dict[str, float]:
    """A ``RadixAttention``'s loaded K and V scales (``k_scale_float``, ``v_scale_float``;
    None until SGLang's ``BaseKVCacheMethod`` loads them, and where the model has no KV
    cache quantization); an MLA layer (one latent row) its K scale only.

    Args:
        layer: The layer, or None (a layer id the model has no attention layer of).
        mla: Whether the pool is MLA (its K scale only).

    Returns:
        ``k_scale`` and ``v_scale`` where loaded (finite, positive); empty otherwise.

    """
    found: dict[str, float] = {}
    if layer is None:
        return found
    for key in ("k_scale", "v_scale")[: 1 if mla else 2]:
        value = hooked.read_or_none(
            layer, hooked.SCALES, "no KV scale recorded for its layers", f"{key}_float"
        )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if math.isfinite(value) and value > 0:
                found[key] = value
    return found


def sglang_attention_layers(model: torch.nn.Module | None) -> dict[int, torch.nn.Module]:
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
