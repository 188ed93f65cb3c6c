"""The tensors a cache description's layers have in a dump: which layers own one, under
which names, of which shapes, and the strict check of a layer's tensors against its
description (the same for reading and writing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..core.dtypes import dtype_name, dtype_size
from ..core.validation import fail
from ..description import CacheDescription, LayerEntry, LayerSpec
from ..views import LayerTensor

if TYPE_CHECKING:
    import torch


def kernel_blocks_per_block(spec: LayerSpec) -> int:
    return spec.block_size // spec.kernel_block_size


def _attention_shapes(spec: LayerSpec, kernel_blocks: int) -> list[tuple[int, ...]]:
    """The expected shapes of an attention layer's tensor (K and V where kept apart)."""
    sizes = spec.axis_sizes(kernel_blocks=kernel_blocks)
    if kv_apart(spec):
        return [
            tuple({**sizes, "D": size}[letter] for letter in spec.layout)
            for size in (spec.head_size, spec.head_size_v)
        ]
    return [tuple(sizes[letter] for letter in spec.layout)]


def kv_apart(spec: LayerSpec) -> bool:
    return "D" in spec.layout and "K" not in spec.layout


def _states_bytes(spec: LayerSpec) -> int:
    return sum(
        math.prod(shape) * dtype_size(dtype)
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )


def tensor_names(entry: LayerEntry) -> list[str]:
    if not entry.spec.is_state and kv_apart(entry.spec):
        return [f"{entry.name}/k", f"{entry.name}/v"]
    return [entry.name]


def owner_layers(description: CacheDescription) -> list[LayerEntry]:
    """The layers that own a cache tensor (every layer but those that share one)."""
    return [entry for group in description.groups for entry in group.layers if entry.shares is None]


def layer_groups(description: CacheDescription) -> dict[str, int]:
    """Each layer's group id, by layer name."""
    return {entry.name: group.id for group in description.groups for entry in group.layers}


def rows_of_layer(rows: int | Mapping[int, int], group_id: int) -> int:
    """The rows a layer of the group holds: ``rows`` itself, or the group's entry."""
    return rows if isinstance(rows, int) else rows[group_id]


def check_layer(
    source: str,
    entry: LayerEntry,
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    names: Sequence[str],
    rows: int,
    what: str,
) -> None:
    """A layer's tensors against its description: shape and dtype, or a state layer's
    rows and page size."""
    spec = entry.spec
    if spec.is_state:
        shape, dtype = shapes[0], dtypes[0]
        if len(shape) < 1 or shape[0] != rows:
            fail(
                source,
                f"layer {entry.name}: expected a state tensor of {rows} {what} on its first "
                f"axis, got shape {shape}",
            )
        page = math.prod(shape[1:]) * dtype_size(dtype)
        if page < _states_bytes(spec):
            fail(
                source,
                f"layer {entry.name}: its pages of {page} bytes (shape {shape}, "
                f"{dtype_name(dtype)}) are smaller than its {_states_bytes(spec)} bytes of states",
            )
        return
    if "N" not in spec.layout:
        fail(
            source,
            f"layer {entry.name}: layout {spec.layout} has no N (kernel blocks) axis, which "
            "only token-major ExampleConnector folders leave out",
        )
    expected = _attention_shapes(spec, rows * kernel_blocks_per_block(spec))
    for name, shape, dtype, want in zip(names, shapes, dtypes, expected, strict=True):
        if tuple(shape) != want:
            fail(
                source,
                f"tensor {name}: expected shape {want} (layout {spec.layout}, {rows} {what}), "
                f"got {tuple(shape)}",
            )
        if dtype != spec.dtype:
            fail(
                source,
                f"tensor {name}: expected dtype {dtype_name(spec.dtype)}, got {dtype_name(dtype)}",
            )


def layer_parts(tensor: LayerTensor) -> tuple[torch.Tensor, ...]:
    return tensor if isinstance(tensor, tuple) else (tensor,)
