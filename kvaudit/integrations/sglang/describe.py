"""The cache description of an SGLang worker, built from the worker's own KV pool (no
hand-written YAML), and the pool's tensors as kvaudit reads them (the pool kinds, layer
names and heads they rest on: ``pools``).

SGLang 0.5.23 keeps each layer of an ``MHATokenToKVPool`` as two tensors, ``k_buffer[l]``
and ``v_buffer[l]`` of ``[slots + page_size, local heads, head_dim]`` (the "nhd" layout):
token slot ``s`` is row ``s`` and lies in page ``s // page_size``. Viewed without copying
as ``[pages, page_size, heads, head_dim]``, a page is a kvaudit block (``block_size =
kernel_block_size = page_size``) in the ``NTHD`` layout, K and V handed as a pair. An
``MLATokenToKVPool`` keeps one latent row per slot, ``kv_buffer[l]`` of ``[slots +
page_size, 1, kv_lora_rank + qk_rope_head_dim]``, held whole by every TP rank: viewed as
``[pages, page_size, row]`` it is ``NTC``. Page 0 (slots ``0 .. page_size - 1``) is the
padding page SGLang's allocators never hand out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import yaml
from sglang.srt.mem_cache.memory_pool import KVCache, MambaPool

from ...core.files import atomic_path
from ...description import description_to_dict, parse_description
from . import hooked
from .pools import (
    DEFAULT_LAYER_NAME,
    HYBRID_GROUP,
    STATE_BLOCK_TOKENS,
    STATE_LAYER_NAME,
    HeadShard,
    LayerNames,
    NotDescribable,
    layer_ids,
    layer_names,
    name_of,
    pages_of,
    pool_kind,
    sglang_kv_heads,
    state_entries,
)
from .scales import layer_scales

LayerCaches = dict[str, tuple[torch.Tensor, torch.Tensor] | torch.Tensor]
"""A pool's layers by name: ``(K, V)`` pairs, latent rows, or state tensors."""

__all__ = [
    "DEFAULT_LAYER_NAME",
    "HYBRID_GROUP",
    "STATE_BLOCK_TOKENS",
    "STATE_LAYER_NAME",
    "HeadShard",
    "LayerCaches",
    "LayerNames",
    "NotDescribable",
    "describe_sglang_cache",
    "sglang_kv_heads",
    "sglang_layer_caches",
    "write_cache_yaml",
]


def describe_sglang_cache(
    pool: KVCache,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int | None = None,
    names: LayerNames = DEFAULT_LAYER_NAME,
    sliding_window: int | None = None,
    state_names: str = STATE_LAYER_NAME,
    attention: Mapping[int, torch.nn.Module] | None = None,
) -> dict[str, Any]:
    """The description dict of one SGLang worker's KV pool (what ``parse_description``
    reads): group 0 the pool's (full-attention) layers; a hybrid pool's second group
    (``HYBRID_GROUP``) its window layers or Mamba states, in a block space of its own.

    A page is a block: ``num_blocks`` is the pool's whole pages, padding page 0 included
    (never a request's). The global heads of a rank follow from its TP rank and size
    (``sglang_kv_heads``), which kvaudit's ``Checksummer`` is given; the description
    carries ``model_kv_heads`` so that heads replicated over ranks are counted once.
    ``SWAKVPool``: group 1 is its window pool's layers (``sliding_window``), its
    ``num_blocks`` the window pool's pages. ``HybridLinearKVPool``: group 1 is its Mamba
    pool's states as SGLang transfers them (one kvaudit layer per state tensor, named by
    ``state_names``), one block per state slot, TP-split rows as SGLang slices them.

    Args:
        pool: The worker's ``MHATokenToKVPool`` (layout "nhd"), ``MLATokenToKVPool``,
            ``SWAKVPool`` or ``HybridLinearKVPool`` (MHA full layers), the one
            ``token_to_kv_pool_allocator.get_kvcache()`` returns.
        tp_rank: The worker's attention TP rank.
        tp_size: The attention TP size.
        total_kv_heads: The model's KV heads before TP (``ModelConfig.
            get_total_num_kv_heads()``); required for MHA at TP > 1, ignored for MLA.
        names: The attention layer names: a template with ``{i}``, a mapping or a
            function of the global SGLang layer id.
        sliding_window: The window in tokens (the scheduler's ``sliding_window_size``);
            required for an ``SWAKVPool``.
        state_names: The state layers' names, a template with ``{i}`` and ``{state}``.
        attention: The model's ``RadixAttention`` layers by global layer id
            (``sglang_attention_layers``), for the scales of an fp8 pool; None: none.

    Returns:
        The description as a plain dict.

    Raises:
        NotDescribable: A pool kind or layout kvaudit does not describe, or heads that do
            not match SGLang's placement at this TP rank and size.

    """
    kind = pool_kind(pool)
    if kind in ("mha", "mla"):
        return _describe_single(
            pool,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_kv_heads=total_kv_heads,
            names=names,
            attention=attention,
        )
    full = _describe_single(
        pool.full_kv_pool,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=total_kv_heads,
        names=_model_names(pool.full_kv_pool, names),
        attention=_dense_attention(pool.full_kv_pool, attention),
    )
    page_size = int(pool.page_size)
    if kind == "swa":
        if sliding_window is None or sliding_window < 1:
            raise NotDescribable("an SWAKVPool needs its sliding window (sliding_window_size)")
        window = _describe_single(
            pool.swa_kv_pool,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_kv_heads=total_kv_heads,
            names=_model_names(pool.swa_kv_pool, names),
            attention=_dense_attention(pool.swa_kv_pool, attention),
        )
        (group,) = window["groups"]
        group["spec"].update(type="sliding_window", sliding_window=int(sliding_window))
        second = {"id": HYBRID_GROUP, "num_blocks": window["num_blocks"], **group}
        second["id"] = HYBRID_GROUP
    else:
        second = _state_group(pool.mamba_pool, tp_size, state_names)
    if page_size != int(full["groups"][0]["spec"]["block_size"]):
        raise NotDescribable("the hybrid pool's page size differs from its full pool's")
    full["groups"].append(second)
    return full


def _model_names(sub_pool: KVCache, names: LayerNames) -> Callable[[int], str]:
    """The names of a hybrid pool's sub-pool by dense index: its model layer ids named."""
    ids = tuple(int(i) for i in sub_pool.model_layer_ids)
    return lambda dense: name_of(names, ids[dense])


def _dense_attention(
    sub_pool: KVCache, attention: Mapping[int, torch.nn.Module] | None
) -> dict[int, torch.nn.Module] | None:
    """The attention layers of a hybrid pool's sub-pool by its dense index (the ids its
    own buffers are read by), from the model's by global layer id."""
    if attention is None:
        return None
    ids = tuple(int(i) for i in sub_pool.model_layer_ids)
    return {dense: attention[i] for dense, i in enumerate(ids) if i in attention}


def _state_group(mamba_pool: MambaPool, tp_size: int, state_names: str) -> dict[str, Any]:
    """The state group of a Mamba pool: one layer per state tensor, its rows split as
    SGLang slices them for a transfer between TP widths (``conv_shard_groups``: each
    q/k/v sub-block of a GatedDeltaNet conv state sharded on its own)."""
    try:
        shard_groups = hooked.read(mamba_pool, hooked.CONV_SHARD_GROUPS)
    except hooked.NotInThisSglang as missing:
        raise NotDescribable(f"the Mamba pool cannot be described here: {missing}") from None
    layers = []
    slots = None
    for layer_id, state, tensor, axis in state_entries(mamba_pool):
        shape = [int(n) for n in tensor.shape[1:]]
        slots = int(tensor.shape[0]) if slots is None else slots
        if int(tensor.shape[0]) != slots:
            raise NotDescribable("the Mamba pool's states hold different slot counts")
        local = shape[axis]
        segments = [[local, 1]]
        if state.startswith("conv") and shard_groups:
            parts = [int(n) for n in shard_groups]
            if any(n % tp_size for n in parts) or sum(parts) // tp_size != local:
                raise NotDescribable(
                    f"conv_shard_groups {parts} do not split {local} rows at TP {tp_size}"
                )
            segments = [[n // tp_size, 1] for n in parts]
        spec = {
            "shapes": [shape],
            "dtypes": [str(tensor.dtype).removeprefix("torch.")],
            "state_splits": [{"axis": axis, "segments": segments}],
        }
        layers.append({"name": state_names.format(i=layer_id, state=state), "spec": spec})
    layers.sort(key=lambda layer: layer["name"])
    return {
        "id": HYBRID_GROUP,
        "num_blocks": slots,
        "transfer": True,
        "host_resident": False,
        "spec": {"type": "mamba", "block_size": STATE_BLOCK_TOKENS, **layers[0]["spec"]},
        "layers": layers,
    }


def _describe_single(
    pool: KVCache,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int | None = None,
    names: LayerNames = DEFAULT_LAYER_NAME,
    attention: Mapping[int, torch.nn.Module] | None = None,
) -> dict[str, Any]:
    """The description dict of one SGLang worker's KV pool (what ``parse_description``
    reads), one group (id 0) of the pool's layers.

    Where the pool is quantized (fp8) and ``attention`` holds a layer's ``RadixAttention``
    with scales loaded (``k_scale_float``, ``v_scale_float``: what SGLang divides K and V
    by before storing them), the layer's spec carries them as ``k_scale`` and ``v_scale``:
    on the group's spec where every layer has the same, else on each layer.

    A page is a block: ``num_blocks`` is the pool's whole pages, padding page 0 included
    (never a request's). The global heads of a rank follow from its TP rank and size
    (``sglang_kv_heads``), which kvaudit's ``Checksummer`` is given; the description
    carries ``model_kv_heads`` so that heads replicated over ranks are counted once.

    Args:
        pool: The worker's ``MHATokenToKVPool`` (layout "nhd") or ``MLATokenToKVPool``
            (the one ``token_to_kv_pool_allocator.get_kvcache()`` returns).
        tp_rank: The worker's attention TP rank.
        tp_size: The attention TP size.
        total_kv_heads: The model's KV heads before TP (``ModelConfig.
            get_total_num_kv_heads()``); required for MHA at TP > 1, ignored for MLA.
        names: The layer names: a template with ``{i}``, a mapping or a function of the
            global SGLang layer id.
        attention: The model's ``RadixAttention`` layers by global layer id
            (``sglang_attention_layers``); None: no scales recorded.

    Returns:
        The description as a plain dict.

    Raises:
        NotDescribable: A pool kind or layout kvaudit does not describe, or heads that do
            not match SGLang's placement at this TP rank and size.

    """
    kind = pool_kind(pool)
    page_size = int(pool.page_size)
    dtype = str(pool.dtype).removeprefix("torch.")
    spec: dict[str, Any] = {
        "block_size": page_size,
        "kernel_block_size": page_size,
        "dtype": dtype,
    }
    description: dict[str, Any] = {"kvaudit": 1}
    if kind == "mha":
        heads = int(pool.head_num)
        if total_kv_heads is None:
            if tp_size > 1:
                raise NotDescribable(
                    "total_kv_heads is needed at TP > 1 to place this rank's KV heads"
                )
            total_kv_heads = heads
        shard = sglang_kv_heads(tp_rank, tp_size, total_kv_heads)
        if heads != shard.count:
            raise NotDescribable(
                f"the pool holds {heads} KV heads, SGLang places {shard.count} on rank "
                f"{tp_rank} of {tp_size} for {total_kv_heads} KV heads"
            )
        rows = int(pool.k_buffer[0].shape[0])
        spec.update(
            type="full_attention",
            num_kv_heads=heads,
            head_size=int(pool.head_dim),
            head_size_v=int(pool.v_head_dim),
            layout="NTHD",
        )
        description["model_kv_heads"] = int(total_kv_heads)
    else:
        rows = int(pool.kv_buffer[0].shape[0])
        spec.update(type="mla", head_size=int(pool.kv_cache_dim), layout="NTC")
    description["num_blocks"] = pages_of(pool, rows)
    layers: list[Any] = layer_names(pool, names)
    if attention is not None and pool.dtype.itemsize == 1:
        # SGLang applies the scales only where it casts K and V to a one-byte dtype.
        scales = [
            layer_scales(attention.get(layer_id), kind == "mla") for layer_id in layer_ids(pool)
        ]
        if all(found == scales[0] for found in scales):
            spec.update(scales[0])
        else:
            layers = [
                {"name": name, "spec": found} if found else name
                for name, found in zip(layers, scales, strict=True)
            ]
    description["groups"] = [
        {
            "id": 0,
            "transfer": True,
            "host_resident": False,
            "spec": spec,
            "layers": layers,
        }
    ]
    return description


def _paged(buffer: torch.Tensor, pages: int, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[slots, ...]`` rows as ``[pages, page_size, ...]`` (no copy), in the pool's dtype
    (fp8 pools store uint8)."""
    view = buffer[: pages * page_size]
    if view.dtype != dtype:
        view = view.view(dtype)
    return view.view(pages, page_size, *view.shape[1:])


def sglang_layer_caches(
    pool: KVCache,
    names: LayerNames = DEFAULT_LAYER_NAME,
    state_names: str = STATE_LAYER_NAME,
) -> LayerCaches:
    """The pool's layers as kvaudit's ``Checksummer`` and ``write_dump`` take them, by
    layer name: ``(K, V)`` pairs ``[pages, page_size, heads, head_dim]`` (``NTHD``) of an
    MHA pool (a hybrid pool's full and window pools), ``[pages, page_size, row]``
    (``NTC``) of an MLA pool, ``[slots, ...]`` of each Mamba state. Views, not copies.

    Args:
        pool: The pool ``describe_sglang_cache`` described.
        names: The same layer names given to ``describe_sglang_cache``.
        state_names: The same state names given to ``describe_sglang_cache``.

    Returns:
        ``{layer name: (k, v)}`` or ``{layer name: latent}``.

    Raises:
        NotDescribable: A pool kind or layout kvaudit does not describe.

    """
    kind = pool_kind(pool)
    if kind == "swa":
        return {
            **sglang_layer_caches(pool.full_kv_pool, _model_names(pool.full_kv_pool, names)),
            **sglang_layer_caches(pool.swa_kv_pool, _model_names(pool.swa_kv_pool, names)),
        }
    if kind == "linear":
        result = sglang_layer_caches(pool.full_kv_pool, _model_names(pool.full_kv_pool, names))
        for layer_id, state, tensor, _ in state_entries(pool.mamba_pool):
            result[state_names.format(i=layer_id, state=state)] = tensor
        return result
    page_size = int(pool.page_size)
    dtype = pool.dtype
    result = {}
    for index, name in enumerate(layer_names(pool, names)):
        if kind == "mha":
            k, v = pool.k_buffer[index], pool.v_buffer[index]
            pages = pages_of(pool, int(k.shape[0]))
            result[name] = (
                _paged(k, pages, page_size, dtype),
                _paged(v, pages, page_size, dtype),
            )
        else:
            latent = pool.kv_buffer[index]
            pages = pages_of(pool, int(latent.shape[0]))
            result[name] = _paged(latent[:, 0], pages, page_size, dtype)
    return result


def write_cache_yaml(path: str | os.PathLike[str], raw: Mapping[str, Any]) -> dict[str, Any]:
    """Write a description (``describe_sglang_cache``'s) as a ``cache.yaml`` (``--config``).

    The description is validated (``parse_description``) and written atomically in
    kvaudit's own dict form (``description_to_dict``), keys in order.

    Args:
        path: The YAML file written (replaced atomically).
        raw: The description dict, as ``describe_sglang_cache`` returns it.

    Returns:
        The dict written.

    Raises:
        KvauditError: A description kvaudit refuses, or a file that cannot be written.

    """
    data = description_to_dict(parse_description(raw, os.fspath(path)))
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    with atomic_path(path) as temporary, open(temporary, "w", encoding="utf-8") as file:
        file.write(text)
    return data
