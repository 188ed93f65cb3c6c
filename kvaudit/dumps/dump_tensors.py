"""A dump's tensors checked against the cache description: every layer's entries (its
rows, dtype and shape), the stored checksums, nothing else but padding; and a whole-cache
dump read under another engine's description named as such."""

from __future__ import annotations

from ..core.dtypes import INT64, UINT8, dtype_name
from ..core.validation import fail
from ..description import CacheDescription, LayerEntry
from ..records import WorkerInfo
from .dump import META_BLOCKS, STORED_CHECKSUMS
from .hints import other_engine_hint
from .layers import (
    check_layer,
    kernel_blocks_per_block,
    layer_groups,
    owner_layers,
    rows_of_layer,
    tensor_names,
)
from .safetensors_io import PAD_PREFIX, Entry, Header


def dump_tensors(
    source: str, header: Header, description: CacheDescription, num_rows: int | dict[int, int]
) -> tuple[dict[str, Entry | tuple[Entry, Entry]], Entry | None]:
    """Every layer's tensor entries, checked against the description (each layer's rows:
    ``num_rows``, or its group's entry), and the stored checksums' entry.

    Args:
        source: The dump, in errors.
        header: The dump's safetensors header.
        description: The cache description the dump is read under.
        num_rows: The dump's rows, one count or per group.

    Returns:
        Each layer's entry (or K and V entries) by name, and the stored checksums' entry.

    """
    found: dict[str, Entry | tuple[Entry, Entry]] = {}
    used: set[str] = set()
    groups = layer_groups(description)
    for entry in owner_layers(description):
        rows = rows_of_layer(num_rows, groups[entry.name])
        what = "rows" if isinstance(num_rows, int) else f"rows of group {groups[entry.name]}"
        names = tensor_names(entry)
        present = [name for name in names if name in header.tensors]
        if len(present) < len(names):
            if entry.name in description.draft_layers and not present:
                continue
            expected = " and ".join(names)
            alone = entry.name in header.tensors and len(names) == 2
            hint = f" (layout {entry.spec.layout} keeps K and V apart)" if alone else ""
            fail(source, f"layer {entry.name} has no tensor: expected {expected}{hint}")
        parts = [header.tensors[name] for name in names]
        check_layer(
            source,
            entry,
            [part.shape for part in parts],
            [part.dtype for part in parts],
            names,
            rows,
            what,
        )
        found[entry.name] = (parts[0], parts[1]) if len(parts) == 2 else parts[0]
        used.update(names)
    stored = header.tensors.get(STORED_CHECKSUMS)
    if stored is not None and not isinstance(num_rows, int):
        fail(
            source,
            f"tensor {STORED_CHECKSUMS}: stored checksums need one {META_BLOCKS} list for "
            "every group, not a list per group",
        )
    if stored is not None:
        rows = num_rows
        if stored.dtype != INT64 or stored.shape != (rows,):
            fail(
                source,
                f"tensor {STORED_CHECKSUMS}: expected int64 of shape ({rows},), got "
                f"{dtype_name(stored.dtype)} of shape {stored.shape}",
            )
        used.add(STORED_CHECKSUMS)
    for name, item in header.tensors.items():
        if name in used:
            continue
        if name.startswith(PAD_PREFIX) and item.dtype == UINT8 and len(item.shape) == 1:
            continue
        sharing = _sharing_layers(description).get(name.removesuffix("/k").removesuffix("/v"))
        if sharing is not None:
            fail(
                source,
                f"tensor {name}: layer {sharing.name} shares the cache of {sharing.shares} "
                "(shares:) and has no tensor of its own",
            )
        fail(source, f"tensor {name} is not a layer of the cache description")
    return found, stored


def _sharing_layers(description: CacheDescription) -> dict[str, LayerEntry]:
    """The layers that share another layer's cache, by name."""
    return {
        entry.name: entry
        for group in description.groups
        for entry in group.layers
        if entry.shares is not None
    }


def check_whole_cache_rows(
    source: str, header: Header, description: CacheDescription, worker: WorkerInfo
) -> None:
    """Check a whole-cache dump read under a given description: a layer whose tensor
    matches its description but for the rows means the description is probably the other
    engine's (one check, on the first such layer).

    Args:
        source: The dump, in errors.
        header: The dump's safetensors header.
        description: The given description.
        worker: The dump's worker (its role names the likely other engine).

    """
    groups = layer_groups(description)
    for entry in owner_layers(description):
        spec = entry.spec
        space = description.blocks_of(groups[entry.name])
        item = header.tensors.get(tensor_names(entry)[0])
        if item is None or spec.is_state or "N" not in spec.layout:
            continue
        axis = spec.layout.index("N")
        per_row = kernel_blocks_per_block(spec)
        sizes = {**spec.axis_sizes(kernel_blocks=0), "D": spec.head_size}
        others = [sizes[letter] for letter in spec.layout if letter != "N"]
        shape = list(item.shape)
        if len(shape) != len(spec.layout) or shape[:axis] + shape[axis + 1 :] != others:
            return
        if shape[axis] != space * per_row:
            fail(
                source,
                f"layer {entry.name} holds {shape[axis] // per_row} blocks (the whole cache); "
                + other_engine_hint(worker.role, space),
            )
        return
