"""A description as a plain JSON-able dict (what a dump embeds) that
``parse_description`` reads back equal."""

from __future__ import annotations

from typing import Any

from ..core.dtypes import dtype_name
from .model import FORMAT_VERSION, CacheDescription, LayerEntry, LayerSpec


def _spec_to_dict(spec: LayerSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": spec.type,
        "block_size": spec.block_size,
        "kernel_block_size": spec.kernel_block_size,
    }
    if spec.spec_class is not None:
        out["spec_class"] = spec.spec_class
    if spec.is_state:
        out["shapes"] = [list(shape) for shape in spec.shapes]
        out["dtypes"] = [dtype_name(dtype) for dtype in spec.dtypes]
        if spec.checksummed_states is not None:
            out["checksummed_states"] = spec.checksummed_states
        out["tp_replicated"] = spec.tp_replicated
        if spec.state_splits is not None:
            out["state_splits"] = [
                {"axis": split.axis, "segments": [list(segment) for segment in split.segments]}
                for split in spec.state_splits
            ]
        return out
    out["num_kv_heads"] = spec.num_kv_heads
    out["head_size"] = spec.head_size
    out["head_size_v"] = spec.head_size_v
    out["dtype"] = dtype_name(spec.dtype)
    out["layout"] = spec.layout
    optional: dict[str, float | None] = {
        "sliding_window": spec.sliding_window,
        "attention_chunk_size": spec.attention_chunk_size,
        "max_tp_shards": spec.max_tp_shards,
        "k_scale": spec.k_scale,
        "v_scale": spec.v_scale,
    }
    out.update({key: value for key, value in optional.items() if value is not None})
    return out


def _layer_to_dict(layer: LayerEntry, group_spec: dict[str, Any]) -> str | dict[str, Any]:
    spec = _spec_to_dict(layer.spec)
    override: dict[str, Any] = {
        key: value for key, value in spec.items() if group_spec.get(key) != value
    }
    # Null in an override removes a key the group's spec sets.
    override.update({key: None for key in group_spec if key not in spec})
    if not override and layer.shares is None:
        return layer.name
    out: dict[str, Any] = {"name": layer.name}
    if override:
        out["spec"] = override
    if layer.shares is not None:
        out["shares"] = layer.shares
    return out


def description_to_dict(description: CacheDescription) -> dict[str, Any]:
    """A plain JSON-able dict of a description that ``parse_description`` reads back equal.

    A layer whose spec differs from its group's lists only the keys that differ.
    """
    out: dict[str, Any] = {"kvaudit": FORMAT_VERSION, "num_blocks": description.num_blocks}
    if description.model_kv_heads is not None:
        out["model_kv_heads"] = description.model_kv_heads
    if description.draft_layers:
        out["draft_layers"] = sorted(description.draft_layers)
    groups = []
    for group in description.groups:
        group_spec = _spec_to_dict(group.spec)
        # A group's own block space only where it has one: other descriptions serialize
        # as before, byte for byte.
        own = {} if group.num_blocks is None else {"num_blocks": group.num_blocks}
        groups.append(
            {
                "id": group.id,
                **own,
                "transfer": group.transfer,
                "host_resident": group.host_resident,
                "spec": group_spec,
                "layers": [_layer_to_dict(layer, group_spec) for layer in group.layers],
            }
        )
    out["groups"] = groups
    return out
