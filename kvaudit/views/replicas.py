"""KV head replication across TP ranks: how many ranks hold the same heads of an attention
layer, and the description's ``model_kv_heads`` checked against every layer's heads.
"""

from __future__ import annotations

from ..core.errors import KvauditError, UnsupportedGroupError
from ..description import CacheDescription, LayerSpec


def check_model_kv_heads(description: CacheDescription, tp_size: int) -> None:
    """``model_kv_heads`` against every attention layer's heads per rank at this TP size.

    Raises:
        KvauditError: A layer whose heads across the TP ranks cannot be ``model_kv_heads``;
            the message names the description's source and the layer.

    """
    model = description.model_kv_heads
    if model is None:
        return
    for group in description.groups:
        for entry in group.layers:
            spec = entry.spec
            if spec.is_state or spec.is_mla or entry.name in description.draft_layers:
                continue
            heads = spec.num_kv_heads
            if spec.max_tp_shards is None and heads == 1 and tp_size > 1:
                # One head per rank: the model's heads are replicated over the ranks.
                if model <= tp_size and tp_size % model == 0:
                    continue
                held = f"one KV head per rank at TP {tp_size} needs a count that divides {tp_size}"
            else:
                shards = tp_size if spec.max_tp_shards is None else min(tp_size, spec.max_tp_shards)
                if heads * shards == model:
                    continue
                held = f"{heads} KV heads per rank x {shards} TP shards = {heads * shards}"
            raise KvauditError(
                f"model_kv_heads {model} contradicts layer {entry.name}: {held}", description.source
            )


def tp_replicas(spec: LayerSpec, tp_size: int, model_kv_heads: int | None) -> int:
    """How many consecutive TP ranks hold the same heads of an attention layer."""
    if spec.max_tp_shards is not None:
        shards = min(tp_size, spec.max_tp_shards)
        if tp_size % shards:
            raise UnsupportedGroupError(
                f"its max_tp_shards {spec.max_tp_shards} does not divide TP size {tp_size}"
            )
        return tp_size // shards
    if spec.is_mla:
        return tp_size
    if spec.num_kv_heads > 1 or tp_size == 1:
        return 1
    if model_kv_heads is None or model_kv_heads > tp_size or tp_size % model_kv_heads:
        raise UnsupportedGroupError(
            "its KV head replication across TP is unknown (one head per rank, and no "
            "model_kv_heads that divides the TP size)"
        )
    return tp_size // model_kv_heads
