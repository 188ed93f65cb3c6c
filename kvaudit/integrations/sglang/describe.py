"""The cache description of an SGLang worker, built from the worker's own KV pool (no
hand-written YAML), the pool's tensors as kvaudit reads them, and a request's blocks from
its ``req_to_token`` row.

SGLang 0.5.23 keeps each layer of an ``MHATokenToKVPool`` as two tensors, ``k_buffer[l]``
and ``v_buffer[l]`` of ``[slots + page_size, local heads, head_dim]`` (the "nhd" layout):
token slot ``s`` is row ``s`` and lies in page ``s // page_size``. Viewed without copying
as ``[pages, page_size, heads, head_dim]``, a page is a kvaudit block (``block_size =
kernel_block_size = page_size``) in the ``NTHD`` layout, K and V handed as a pair. An
``MLATokenToKVPool`` keeps one latent row per slot, ``kv_buffer[l]`` of ``[slots +
page_size, 1, kv_lora_rank + qk_rope_head_dim]``, held whole by every TP rank: viewed as
``[pages, page_size, row]`` it is ``NTC``. Page 0 (slots ``0 .. page_size - 1``) is the
padding page SGLang's allocators never hand out.

Layer ids in SGLang are global (``buffer[layer_id - start_layer]``); a PP stage's pool
holds ``layer_num`` layers from ``start_layer``, so its names carry the global numbers.
Heads are mapped across TP as SGLang's ``QKVParallelLinear`` maps them (``sglang_kv_heads``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    KVCache,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from ...core.files import atomic_path
from ...description import description_to_dict, parse_description
from .scales import layer_scales

DEFAULT_LAYER_NAME = "model.layers.{i}.self_attn.attn"
"""The layer name of SGLang layer id ``i`` unless the caller gives its own names."""
STATE_LAYER_NAME = "model.layers.{i}.linear_attn.{state}"
"""The layer name of state ``state`` (``conv``, ``conv1``, ..., ``temporal``) of SGLang
linear-attention layer id ``i``: one kvaudit layer per state tensor, all of one layer
module (``model.layers.{i}``), so their rows are numbered one after the other."""
STATE_BLOCK_TOKENS = 1 << 24
"""The block size of a Mamba state group (the largest a description takes): one block,
the request's state slot, covers every position of a request (the state being the
request's after its last token); a longer request is not described."""
HYBRID_GROUP = 1
"""The group id of a hybrid pool's second group: the window layers (``SWAKVPool``) or the
Mamba states (``HybridLinearKVPool``); the full-attention layers are group 0."""

LayerNames = str | Mapping[int, str] | Callable[[int], str]
"""A template with ``{i}`` (the global layer id), a mapping of global layer id to name, or
a function of the global layer id."""

LayerCaches = dict[str, tuple[torch.Tensor, torch.Tensor] | torch.Tensor]


class NotDescribable(Exception):
    """A pool kvaudit cannot describe from what SGLang holds; the message says why (one
    line)."""


@dataclass(frozen=True)
class HeadShard:
    """The KV heads one TP rank holds, as SGLang maps them.

    ``first`` is the first global head, ``count`` the heads on the rank, ``replicas`` how
    many consecutive ranks hold the same heads.
    """

    first: int
    count: int
    replicas: int


def sglang_kv_heads(tp_rank: int, tp_size: int, total_kv_heads: int) -> HeadShard:
    """The global KV heads TP rank ``tp_rank`` holds, as SGLang 0.5.23 places them.

    ``QKVParallelLinear`` (``sglang/srt/layers/linear.py``): with at least as many
    attention TP ranks as KV heads, each rank holds one head, ``tp_size // total`` ranks
    hold the same one, and rank ``r`` holds head ``r // replicas``; otherwise each rank
    holds ``total // tp_size`` consecutive heads from ``r * count``. This is kvaudit's
    replica rule (docs/checksum.md, "Replicas") with ``model_kv_heads = total_kv_heads``.

    Args:
        tp_rank: The rank's attention TP rank.
        tp_size: The attention TP size.
        total_kv_heads: The model's KV heads before TP.

    Returns:
        The rank's heads.

    Raises:
        NotDescribable: Sizes that do not divide as SGLang requires.

    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size or total_kv_heads < 1:
        raise NotDescribable(
            f"tp_rank {tp_rank} / tp_size {tp_size} / total_kv_heads {total_kv_heads} "
            "are not a TP placement"
        )
    if tp_size >= total_kv_heads:
        if tp_size % total_kv_heads:
            raise NotDescribable(
                f"{total_kv_heads} KV heads do not divide TP size {tp_size} "
                "(SGLang refuses such a model)"
            )
        replicas = tp_size // total_kv_heads
        return HeadShard(first=tp_rank // replicas, count=1, replicas=replicas)
    if total_kv_heads % tp_size:
        raise NotDescribable(
            f"TP size {tp_size} does not divide {total_kv_heads} KV heads "
            "(SGLang refuses such a model)"
        )
    count = total_kv_heads // tp_size
    return HeadShard(first=tp_rank * count, count=count, replicas=1)


def layer_ids(pool: KVCache) -> list[int]:
    """The global SGLang layer ids a pool holds: ``start_layer`` on, ``layer_num`` of them.

    Args:
        pool: An SGLang KV pool.

    Returns:
        The global layer ids, in the pool's buffer order.

    """
    start = int(pool.start_layer or 0)
    return list(range(start, start + int(pool.layer_num)))


def _name_of(names: LayerNames, layer_id: int) -> str:
    if isinstance(names, str):
        return names.format(i=layer_id)
    if isinstance(names, Mapping):
        if layer_id not in names:
            raise NotDescribable(f"no layer name given for SGLang layer {layer_id}")
        return str(names[layer_id])
    return str(names(layer_id))


def layer_names(pool: KVCache, names: LayerNames = DEFAULT_LAYER_NAME) -> list[str]:
    """The kvaudit layer names of a pool's layers, in its buffer order.

    Args:
        pool: An SGLang KV pool.
        names: A template with ``{i}``, a mapping or a function of the global layer id.

    Returns:
        One name per layer the pool holds.

    Raises:
        NotDescribable: A layer without a name, or two layers with one name.

    """
    result = [_name_of(names, layer_id) for layer_id in layer_ids(pool)]
    if len(set(result)) != len(result):
        raise NotDescribable(f"layer names are not unique: {result}")
    return result


def _mha_kind(pool: Any, what: str) -> None:
    """Refuse an ``MHATokenToKVPool`` (or sub-pool) kvaudit does not describe."""
    if type(pool) is not MHATokenToKVPool:
        raise NotDescribable(
            f"{what} is a {type(pool).__name__}: only MHATokenToKVPool ('nhd') is described"
        )
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd" or getattr(pool, "use_hnd", False):
        raise NotDescribable(
            f"MHATokenToKVPool layout {layout!r} is not described: only SGLang's "
            "default 'nhd' [slots, heads, head_dim] buffers are"
        )


def pool_kind(pool: KVCache) -> str:
    """``"mha"``, ``"mla"``, ``"swa"`` or ``"linear"``; any other pool (a subclass
    included) is refused, with the reason."""
    if type(pool) is MHATokenToKVPool:
        _mha_kind(pool, "the pool")
        return "mha"
    if type(pool) is MLATokenToKVPool:
        if getattr(pool, "use_dsa", False):
            raise NotDescribable(DSA_REFUSED)
        return "mla"
    if type(pool) is SWAKVPool:
        if pool.request_window is not None or pool.swa_req_ring_size is not None:
            raise NotDescribable(
                "an SWAKVPool with per-request window rows or rings is not described: "
                "only the paged window pool (full_to_swa_index_mapping) is"
            )
        if getattr(pool.full_kv_pool, "use_dsa", False):
            raise NotDescribable(DSA_REFUSED)
        _mha_kind(pool.full_kv_pool, "the SWAKVPool's full pool")
        _mha_kind(pool.swa_kv_pool, "the SWAKVPool's window pool")
        return "swa"
    if type(pool) is HybridLinearKVPool:
        if pool.use_dsa:
            raise NotDescribable(DSA_REFUSED)
        if pool.use_mla:
            raise NotDescribable("a HybridLinearKVPool with MLA full layers is not described yet")
        _mha_kind(pool.full_kv_pool, "the HybridLinearKVPool's full pool")
        return "linear"
    raise NotDescribable(
        f"{type(pool).__name__} is not described yet: only MHATokenToKVPool ('nhd'), "
        "MLATokenToKVPool, SWAKVPool and HybridLinearKVPool (MHA full layers) are"
    )


DSA_REFUSED = (
    "a pool with use_dsa (NSA/DSA) is not described: its index-k buffer packs fp8 keys "
    "and their scales page by page (index_k_with_scale_buffer), a layout kvaudit does "
    "not describe, and SGLang 0.5.23 allocates it only under a published DCP parallel "
    "config (not on a bare CPU)"
)


def _pages(pool: KVCache, rows: int) -> int:
    page_size = int(pool.page_size)
    pages = rows // page_size
    if pages < 2:
        raise NotDescribable(f"the pool's {rows} rows hold no page beyond the padding page")
    return pages


def describe_sglang_cache(
    pool: KVCache,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int | None = None,
    names: LayerNames = DEFAULT_LAYER_NAME,
    sliding_window: int | None = None,
    state_names: str = STATE_LAYER_NAME,
    attention: Mapping[int, Any] | None = None,
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


def _model_names(sub_pool: Any, names: LayerNames) -> Callable[[int], str]:
    """The names of a hybrid pool's sub-pool by dense index: its model layer ids named."""
    ids = tuple(int(i) for i in sub_pool.model_layer_ids)
    return lambda dense: _name_of(names, ids[dense])


def _dense_attention(sub_pool: Any, attention: Mapping[int, Any] | None) -> dict[int, Any] | None:
    """The attention layers of a hybrid pool's sub-pool by its dense index (the ids its
    own buffers are read by), from the model's by global layer id."""
    if attention is None:
        return None
    ids = tuple(int(i) for i in sub_pool.model_layer_ids)
    return {dense: attention[i] for dense, i in enumerate(ids) if i in attention}


def _state_entries(mamba_pool: Any) -> list[tuple[int, str, torch.Tensor, int]]:
    """SGLang's transfer entries of a Mamba pool, as ``(layer id, state name, tensor
    [slots, ...], split axis)``, in SGLang's transfer order (``_iter_transfer_state_
    entries``: the conv states, then the temporal, each over the layers)."""
    if getattr(mamba_pool, "_slot_siblings", ()):
        raise NotDescribable("a MambaPool with slot-indexed side states is not described yet")
    entries = []
    seen: dict[tuple[int, str], int] = {}
    for field_name, tensor, axis, layer_id in mamba_pool._iter_transfer_state_entries():
        if field_name not in ("conv", "temporal"):
            raise NotDescribable(f"Mamba state {field_name!r} is not described yet")
        if axis is None:
            raise NotDescribable("replicated request state (no TP slice axis) is not described")
        count = seen.get((int(layer_id), field_name), 0)
        seen[(int(layer_id), field_name)] = count + 1
        state = field_name if count == 0 else f"{field_name}{count}"
        entries.append((int(layer_id), state, tensor, int(axis)))
    if not entries:
        raise NotDescribable("the Mamba pool holds no state")
    return entries


def _state_group(mamba_pool: Any, tp_size: int, state_names: str) -> dict[str, Any]:
    """The state group of a Mamba pool: one layer per state tensor, its rows split as
    SGLang slices them for a transfer between TP widths (``conv_shard_groups``: each
    q/k/v sub-block of a GatedDeltaNet conv state sharded on its own)."""
    shard_groups = getattr(mamba_pool, "conv_shard_groups", None)
    layers = []
    slots = None
    for layer_id, state, tensor, axis in _state_entries(mamba_pool):
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


def hybrid_layer_ids(pool: KVCache) -> list[int]:
    """The global SGLang layer ids a pool holds (a hybrid pool's: all its groups')."""
    kind = pool_kind(pool)
    if kind == "swa":
        return sorted(pool.layers_mapping)
    if kind == "linear":
        return sorted({*pool.full_attention_layer_id_mapping, *pool.mamba_pool.mamba_layer_ids})
    return layer_ids(pool)


def _describe_single(
    pool: KVCache,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int | None = None,
    names: LayerNames = DEFAULT_LAYER_NAME,
    attention: Mapping[int, Any] | None = None,
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
    description["num_blocks"] = _pages(pool, rows)
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
        for layer_id, state, tensor, _ in _state_entries(pool.mamba_pool):
            result[state_names.format(i=layer_id, state=state)] = tensor
        return result
    page_size = int(pool.page_size)
    dtype = pool.dtype
    result = {}
    for index, name in enumerate(layer_names(pool, names)):
        if kind == "mha":
            k, v = pool.k_buffer[index], pool.v_buffer[index]
            pages = _pages(pool, int(k.shape[0]))
            result[name] = (
                _paged(k, pages, page_size, dtype),
                _paged(v, pages, page_size, dtype),
            )
        else:
            latent = pool.kv_buffer[index]
            pages = _pages(pool, int(latent.shape[0]))
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
