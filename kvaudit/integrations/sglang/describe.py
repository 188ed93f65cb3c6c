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

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from sglang.srt.mem_cache.memory_pool import (
    KVCache,
    MHATokenToKVPool,
    MLATokenToKVPool,
)

from ...core.files import atomic_path
from ...description import description_to_dict, parse_description
from ...views.inputs import RequestBlocks

DEFAULT_LAYER_NAME = "model.layers.{i}.self_attn.attn"
"""The layer name of SGLang layer id ``i`` unless the caller gives its own names."""

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


def _pool_kind(pool: KVCache) -> str:
    """``"mha"`` or ``"mla"``; any other pool (a subclass included) is refused."""
    if type(pool) is MHATokenToKVPool:
        layout = getattr(pool, "kv_cache_layout", "nhd")
        if layout != "nhd" or getattr(pool, "use_hnd", False):
            raise NotDescribable(
                f"MHATokenToKVPool layout {layout!r} is not described: only SGLang's "
                "default 'nhd' [slots, heads, head_dim] buffers are"
            )
        return "mha"
    if type(pool) is MLATokenToKVPool:
        if getattr(pool, "use_dsa", False):
            raise NotDescribable("an MLATokenToKVPool with use_dsa (DSA) is not described yet")
        return "mla"
    raise NotDescribable(
        f"{type(pool).__name__} is not described yet: only MHATokenToKVPool ('nhd') and "
        "MLATokenToKVPool are"
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
    kind = _pool_kind(pool)
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
        scales = [_scales(attention.get(layer_id), kind == "mla") for layer_id in layer_ids(pool)]
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


def _scales(layer: Any, mla: bool) -> dict[str, float]:
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


def _paged(buffer: torch.Tensor, pages: int, page_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[slots, ...]`` rows as ``[pages, page_size, ...]`` (no copy), in the pool's dtype
    (fp8 pools store uint8)."""
    view = buffer[: pages * page_size]
    if view.dtype != dtype:
        view = view.view(dtype)
    return view.view(pages, page_size, *view.shape[1:])


def sglang_layer_caches(pool: KVCache, names: LayerNames = DEFAULT_LAYER_NAME) -> LayerCaches:
    """The pool's layers as kvaudit's ``Checksummer`` and ``write_dump`` take them, by
    layer name: ``(K, V)`` pairs ``[pages, page_size, heads, head_dim]`` (``NTHD``) of an
    MHA pool, ``[pages, page_size, row]`` (``NTC``) of an MLA pool. Views, not copies.

    Args:
        pool: The pool ``describe_sglang_cache`` described.
        names: The same layer names given to ``describe_sglang_cache``.

    Returns:
        ``{layer name: (k, v)}`` or ``{layer name: latent}``.

    Raises:
        NotDescribable: A pool kind or layout kvaudit does not describe.

    """
    kind = _pool_kind(pool)
    page_size = int(pool.page_size)
    dtype = pool.dtype
    result: LayerCaches = {}
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


def request_blocks(
    req_to_token_row: torch.Tensor | Sequence[int],
    num_tokens: int,
    page_size: int,
    *,
    group_id: int = 0,
) -> RequestBlocks:
    """A request's blocks from its ``req_to_token`` row (``ReqToTokenPool.req_to_token[
    req.kv.req_pool_idx]``): block ids are the pages holding its tokens, in order.

    Every token slot must lie at its place in its page (``slot % page_size`` equal to the
    token's position in its block), as SGLang's paged allocators hand slots out, and no
    token may lie in padding page 0.

    Args:
        req_to_token_row: The request's row of token slots (at least ``num_tokens``).
        num_tokens: The tokens of the request to cover.
        page_size: The pool's page size.
        group_id: The description's group id (0 for ``describe_sglang_cache``'s).

    Returns:
        The request's ``RequestBlocks``, from position 0.

    Raises:
        NotDescribable: A row shorter than ``num_tokens``, slots not page-aligned, or a
            token in page 0.

    """
    row = torch.as_tensor(req_to_token_row).detach().to("cpu", torch.int64).reshape(-1)
    if num_tokens < 0 or row.numel() < num_tokens:
        raise NotDescribable(f"the row holds {row.numel()} slots, not {num_tokens} tokens")
    slots = row[:num_tokens]
    padding = slots < page_size
    if bool(padding.any()):
        token = int(padding.nonzero()[0, 0])
        raise NotDescribable(f"token {token} lies in padding page 0: the row is not allocated")
    pages = slots[::page_size] // page_size
    positions = torch.arange(num_tokens, dtype=torch.int64)
    expected = pages.repeat_interleave(page_size)[:num_tokens] * page_size + positions % page_size
    if not torch.equal(slots, expected):
        token = int((slots != expected).nonzero()[0, 0])
        raise NotDescribable(
            f"token {token} lies in slot {int(slots[token])}, not at its place in a "
            f"{page_size}-token page"
        )
    return RequestBlocks(num_tokens=num_tokens, groups={group_id: (0, pages.tolist())})


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
