"""What SGLang's KV pools are, as kvaudit's description needs them: the pool kinds
kvaudit describes (refusing every other, with the reason), the global layer ids a pool
holds and their names, the KV heads SGLang places on a TP rank, and a Mamba pool's state
tensors in SGLang's transfer order (``describe`` builds the description from these).

Layer ids in SGLang are global (``buffer[layer_id - start_layer]``); a PP stage's pool
holds ``layer_num`` layers from ``start_layer``, so its names carry the global numbers.
Heads are mapped across TP as SGLang's ``QKVParallelLinear`` maps them
(``sglang_kv_heads``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    KVCache,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from . import hooked

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


def name_of(names: LayerNames, layer_id: int) -> str:
    """The kvaudit name of SGLang layer id ``layer_id``.

    Args:
        names: A template with ``{i}``, a mapping or a function of the global layer id.
        layer_id: The global SGLang layer id.

    Returns:
        The layer's name.

    Raises:
        NotDescribable: A mapping without that layer.

    """
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
    result = [name_of(names, layer_id) for layer_id in layer_ids(pool)]
    if len(set(result)) != len(result):
        raise NotDescribable(f"layer names are not unique: {result}")
    return result


def _mha_kind(pool: KVCache, what: str) -> None:
    """Refuse an ``MHATokenToKVPool`` (or sub-pool) kvaudit does not describe."""
    if type(pool) is not MHATokenToKVPool:
        raise NotDescribable(
            f"{what} is a {type(pool).__name__}: only MHATokenToKVPool ('nhd') is described"
        )
    layout = _read(pool, hooked.KV_CACHE_LAYOUT)
    if layout != "nhd" or _read(pool, hooked.USE_HND):
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
        if _read(pool, hooked.USE_DSA):
            raise NotDescribable(DSA_REFUSED)
        return "mla"
    if type(pool) is SWAKVPool:
        if pool.request_window is not None or pool.swa_req_ring_size is not None:
            raise NotDescribable(
                "an SWAKVPool with per-request window rows or rings is not described: "
                "only the paged window pool (full_to_swa_index_mapping) is"
            )
        full = pool.full_kv_pool
        # SGLang's DSA pools are MLATokenToKVPool's subclasses; an MHA pool has no use_dsa.
        if isinstance(full, MLATokenToKVPool) and _read(full, hooked.USE_DSA):
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


def pages_of(pool: KVCache, rows: int) -> int:
    """The whole pages of a pool buffer of ``rows`` rows (padding page 0 included).

    Args:
        pool: The pool (its ``page_size``).
        rows: The buffer's rows (token slots).

    Returns:
        The pages, at least 2.

    Raises:
        NotDescribable: No page beyond the padding page.

    """
    page_size = int(pool.page_size)
    pages = rows // page_size
    if pages < 2:
        raise NotDescribable(f"the pool's {rows} rows hold no page beyond the padding page")
    return pages


def state_entries(mamba_pool: MambaPool) -> list[tuple[int, str, torch.Tensor, int]]:
    """SGLang's transfer entries of a Mamba pool, as ``(layer id, state name, tensor
    [slots, ...], split axis)``, in SGLang's transfer order (``_iter_transfer_state_
    entries``: the conv states, then the temporal, each over the layers)."""
    if _read(mamba_pool, hooked.SLOT_SIBLINGS):
        raise NotDescribable("a MambaPool with slot-indexed side states is not described yet")
    entries = []
    seen: dict[tuple[int, str], int] = {}
    for field_name, tensor, axis, layer_id in _read(mamba_pool, hooked.TRANSFER_STATES)():
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


def hybrid_layer_ids(pool: KVCache) -> list[int]:
    """The global SGLang layer ids a pool holds (a hybrid pool's: all its groups')."""
    kind = pool_kind(pool)
    if kind == "swa":
        return sorted(pool.layers_mapping)
    if kind == "linear":
        return sorted({*pool.full_attention_layer_id_mapping, *pool.mamba_pool.mamba_layer_ids})
    return layer_ids(pool)


def _read(obj: object, name: hooked.Name) -> Any:
    """``hooked.read``, a missing name refused as the pool not being described."""
    try:
        return hooked.read(obj, name)
    except hooked.NotInThisSglang as missing:
        raise NotDescribable(f"the pool cannot be described here: {missing}") from None
