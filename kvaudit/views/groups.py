"""A worker's group views: each group's distinct caches (aliases counted once) viewed as
pieces and numbered with global layer and head numbers and this rank's replica key, or the
reason the group cannot be checksummed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from ..core.arrays import data_ptr, strides
from ..core.errors import UnsupportedGroupError
from ..core.scheme import MAX_KV_HEADS_PER_LAYER, layer_module
from ..core.validation import Checker
from ..description import (
    HOST_RESIDENT,
    NOT_TRANSFERRED,
    CacheDescription,
    GroupDescription,
    LayerSpec,
)
from ..description.fingerprint import group_fingerprint
from .attention import attention_parts
from .model import GroupViews, LayerTensor, LayerView, LocalCache
from .replicas import check_model_kv_heads, tp_replicas
from .state import split_state_caches, state_caches, state_pages


def build_group_views(
    description: CacheDescription,
    tensors: Mapping[str, LayerTensor],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    num_blocks: int | Mapping[int, int] | None = None,
) -> dict[int, GroupViews]:
    """Every group's views on this worker, keyed by group id.

    ``num_blocks`` is the number of manager blocks the tensors hold, for every group or
    per group id (default: each group's block space, ``CacheDescription.group_rows``); a
    dump holds only its dumped rows.
    """
    Checker(None).rank(tp_rank, tp_size, "tp_rank")
    check_model_kv_heads(description, tp_size)
    group_rows = description.group_rows(num_blocks)
    result = {}
    for group in description.groups:
        fingerprint = group_fingerprint(group, tp_size, description.draft_layers)
        group_views = GroupViews(group, fingerprint)
        try:
            group_views.views = _group_views(
                description, group, tensors, tp_rank, tp_size, group_rows[group.id]
            )
        except UnsupportedGroupError as error:
            group_views.reason = str(error)
        result[group.id] = group_views
    return result


def _group_views(
    description: CacheDescription,
    group: GroupDescription,
    tensors: Mapping[str, LayerTensor],
    tp_rank: int,
    tp_size: int,
    num_blocks: int,
) -> list[LayerView]:
    """One group's views on this worker, each distinct cache once.

    Raises:
        UnsupportedGroupError: The group cannot be checksummed; the message says why.

    """
    if not group.transfer:
        raise UnsupportedGroupError(NOT_TRANSFERRED)
    if group.host_resident:
        raise UnsupportedGroupError(HOST_RESIDENT)
    layers = [entry for entry in group.layers if entry.name not in description.draft_layers]
    by_name = {entry.name: entry for group_ in description.groups for entry in group_.layers}

    # Aliased caches (``shares:``, or one tensor under several names) count once, under
    # the lowest (layer number, name) that uses them.
    owners: dict[tuple, tuple[int, str]] = {}
    caches: dict[tuple, list[LocalCache]] = {}
    for entry in layers:
        number, _ = layer_module(entry.name)
        storage_name = entry.shares or entry.name
        tensor = tensors.get(storage_name)
        if tensor is None:
            raise UnsupportedGroupError(f"layer {storage_name} has no KV cache tensor")
        identity = _storage_identity(tensor)
        if identity in owners:
            owners[identity] = min(owners[identity], (number, entry.name))
            continue
        owners[identity] = (number, entry.name)
        owner_spec = by_name[storage_name].spec
        caches[identity] = _layer_caches(owner_spec, tensor, num_blocks, tp_size, description)

    views: list[LayerView] = []
    modules: dict[int, str] = {}
    next_head: dict[int, int] = defaultdict(int)
    for identity, (number, name) in sorted(owners.items(), key=lambda item: item[1]):
        module = layer_module(name)[1]
        if modules.setdefault(number, module) != module:
            raise UnsupportedGroupError(
                f"layers {modules[number]} and {module} share layer number {number}"
            )
        base = next_head[number]
        for cache in caches[identity]:
            shard, replica = divmod(tp_rank, cache.replicas)
            views.append(
                LayerView(
                    name=name,
                    number=number,
                    first_head=base + cache.first_head + shard * cache.heads,
                    heads=cache.heads,
                    replica_key=(cache.replicas, replica),
                    parts=cache.parts,
                    dtype=cache.dtype,
                )
            )
            next_head[number] = max(next_head[number], base + cache.first_head + cache.global_heads)
        if next_head[number] > MAX_KV_HEADS_PER_LAYER:
            raise UnsupportedGroupError(
                f"layer {number} has more than {MAX_KV_HEADS_PER_LAYER} KV heads"
            )
    return views


def _storage_identity(tensor: LayerTensor) -> tuple:
    """What makes two layers' caches the same storage."""
    parts = tensor if isinstance(tensor, tuple) else (tensor,)
    return tuple((data_ptr(part), tuple(part.shape), strides(part)) for part in parts)


def _layer_caches(
    spec: LayerSpec,
    tensor: LayerTensor,
    num_blocks: int,
    tp_size: int,
    description: CacheDescription,
) -> list[LocalCache]:
    """A layer's cache as the caches (state segments) its heads are numbered by."""
    if spec.is_state:
        if isinstance(tensor, tuple):
            raise UnsupportedGroupError("its state cache is given as a K/V pair")
        pages = state_pages(tensor, num_blocks)
        if spec.state_splits is not None:
            return split_state_caches(spec, pages, num_blocks, tp_size)
        return state_caches(spec, pages, num_blocks, tp_size)
    parts = attention_parts(spec, tensor, num_blocks)
    replicas = tp_replicas(spec, tp_size, description.model_kv_heads)
    heads = spec.num_kv_heads
    return [LocalCache(heads, replicas, parts, spec.dtype, 0, heads * tp_size // replicas)]
