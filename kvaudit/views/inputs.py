"""The shapes engines hold, made into the ones kvaudit reads: vLLM's ``kv_caches`` list
as tensors by layer name, and block ids given as ints, numpy arrays or torch tensors as
plain ints.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import KvauditError
from ..description import CacheDescription
from . import LayerTensor

if TYPE_CHECKING:
    import torch

LayerTensors = Mapping[str, LayerTensor] | Sequence[LayerTensor]


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (none can be while torch is not imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


@dataclass
class RequestBlocks:
    """A request's blocks in a worker's cache, as the engine's block table holds them.

    ``num_tokens`` is the request's token count; ``groups`` maps a group id to the
    position of the first listed block and the block ids of consecutive positions (a
    list of ints, a 1-D integer numpy array or a torch tensor on any device). The list
    may cover part of the request.
    """

    num_tokens: int
    groups: dict[int, tuple[int, list[int]]] = field(default_factory=dict)


def description_layer_names(description: CacheDescription) -> list[str]:
    """Every layer of the description, group by group in the order listed (layers that
    share a cache included): the order a ``kv_caches`` list follows."""
    return [entry.name for group in description.groups for entry in group.layers]


def tensors_by_name(
    description: CacheDescription, tensors: LayerTensors, source: str | None = None
) -> Mapping[str, LayerTensor]:
    """``tensors`` keyed by layer name: a mapping as given, or a list with one tensor (or
    K/V pair) per layer of the description, in the description's layer order.

    Raises:
        KvauditError: A list whose length is not the description's number of layers, or
            something that is neither a mapping nor a list.

    """
    if isinstance(tensors, Mapping):
        return tensors
    if is_tensor(tensors) or not isinstance(tensors, (list, tuple)):
        raise KvauditError(
            "tensors must be a mapping of layer name to tensor or a list of tensors in the "
            f"description's layer order, got {type(tensors).__name__}",
            source,
        )
    names = description_layer_names(description)
    if len(tensors) != len(names):
        raise KvauditError(
            f"the kv_caches list holds {len(tensors)} tensors, the description has "
            f"{len(names)} layers ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})",
            source,
        )
    return dict(zip(names, tensors, strict=True))


def _plain(value: Any) -> Any:
    """A single-element integer tensor or 0-d integer array as an int; anything else as
    given, for the caller's own check to name."""
    if is_tensor(value) and value.numel() == 1 and _integer_dtype(value.dtype):
        return int(value.item())
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        return int(value[()])
    return value


def _integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool")


def block_id_list(block_ids: Any, what: str, source: str | None = None) -> list[Any]:
    """Block ids given as a list, a 1-D integer numpy array or a torch tensor (any device)
    as a list; ids that are tensors or arrays become Python ints, anything else is kept
    for the caller's check to name.

    Raises:
        KvauditError: A non-integer or multi-dimensional array or tensor, or something
            that is not a list of ids; ``what`` names the request and group.

    """
    if is_tensor(block_ids):
        if not _integer_dtype(block_ids.dtype) or block_ids.dim() != 1:
            raise KvauditError(
                f"{what}: block ids must be a 1-D integer tensor, got {block_ids.dtype} of "
                f"shape {tuple(block_ids.shape)}",
                source,
            )
        return [int(value) for value in block_ids.detach().cpu().tolist()]
    if isinstance(block_ids, np.ndarray):
        if block_ids.dtype.kind not in "iu" or block_ids.ndim != 1:
            raise KvauditError(
                f"{what}: block ids must be a 1-D integer array, got {block_ids.dtype} of "
                f"shape {block_ids.shape}",
                source,
            )
        return [int(value) for value in block_ids.tolist()]
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Sequence):
        raise KvauditError(
            f"{what}: expected a list, array or tensor of block ids, got "
            f"{type(block_ids).__name__}",
            source,
        )
    return [_plain(value) for value in block_ids]


def plain_requests(
    requests: Mapping[str, RequestBlocks], source: str | None = None
) -> dict[str, RequestBlocks]:
    """The requests with token counts, start positions and block ids as Python ints where
    they were given as numpy or torch integers (values of other types kept as given)."""
    out = {}
    for req_id, blocks in requests.items():
        groups = {
            group_id: (
                _plain(start),
                block_id_list(ids, f"request {req_id} group {group_id}", source),
            )
            for group_id, (start, ids) in blocks.groups.items()
        }
        out[req_id] = RequestBlocks(_plain(blocks.num_tokens), groups)
    return out
