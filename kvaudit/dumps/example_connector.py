"""vLLM ExampleConnector folders (one ``<layer_name>.safetensors`` file per layer, one
token-major ``kv_cache`` tensor each) opened as one-request dumps.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch

from ..description import CacheDescription, LayerEntry, LayerSpec
from ..dtypes import dtype_name
from ..errors import KvauditError
from ..records import WorkerInfo
from ..validation import fail
from .dump import META_FORMAT, Dump, DumpRequest
from .layers import kv_apart, owner_layers
from .safetensors_io import Entry, map_file, read_header, tensor_view

EXAMPLE_CONNECTOR_TENSOR = "kv_cache"


def safetensors_files(folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError as error:
        fail(folder, f"cannot list: {error.strerror}")
    return [
        os.path.join(folder, name)
        for name in names
        if name.endswith(".safetensors") and os.path.isfile(os.path.join(folder, name))
    ]


def is_example_connector(folder: str) -> bool:
    """Whether a folder holds ExampleConnector files: one ``kv_cache`` tensor per file and
    no kvaudit metadata."""
    files = safetensors_files(folder)
    if not files:
        return False
    for file in files:
        try:
            header = read_header(file)
        except KvauditError:
            return False
        if META_FORMAT in header.metadata or set(header.tensors) != {EXAMPLE_CONNECTOR_TENSOR}:
            return False
    return True


def open_example_connector(folder: str, config: CacheDescription | None) -> Dump:
    """One request's prompt KV saved by vLLM's ExampleConnector, token-major, as a
    one-request dump whose rows are the request's block positions."""
    if not is_example_connector(folder):
        fail(
            folder,
            "is a directory but not an ExampleConnector folder (<layer_name>.safetensors "
            "files, one kv_cache tensor each)",
        )
    if config is None:
        fail(folder, "an ExampleConnector folder embeds no cache description: give one (--config)")
    files = {
        Path(file).name.removesuffix(".safetensors"): file for file in safetensors_files(folder)
    }
    layers = [
        entry
        for entry in owner_layers(config)
        if entry.name in files or entry.name not in config.draft_layers
    ]
    num_tokens: int | None = None
    loaded: dict[str, tuple[LayerEntry, torch.Tensor, str]] = {}
    maps = []
    for entry in layers:
        spec = entry.spec
        file = files.get(entry.name)
        if file is None:
            fail(folder, f"layer {entry.name} has no file {entry.name}.safetensors")
        if spec.is_state or kv_apart(spec):
            kind = "a state layer" if spec.is_state else f"layout {spec.layout} keeps K and V apart"
            fail(file, f"layer {entry.name}: {kind}; ExampleConnector saves one kv_cache per layer")
        header = read_header(file)
        item = header.tensors[EXAMPLE_CONNECTOR_TENSOR]
        layout = spec.layout.replace("N", "")
        tokens = _example_tokens(file, entry, item, layout)
        if num_tokens is not None and tokens != num_tokens:
            fail(file, f"holds {tokens} tokens, the folder's other layers hold {num_tokens}")
        num_tokens = tokens
        mapped = map_file(file)
        maps.append(mapped)
        sizes = _layout_sizes(spec, tokens)
        loaded[entry.name] = (entry, tensor_view(mapped, item).reshape(sizes), layout)
    owners = {entry.name for entry in owner_layers(config)}
    sharing = {entry.name: entry.shares for group in config.groups for entry in group.layers}
    for name, file in files.items():
        if name in owners:
            continue
        if name in sharing:
            fail(file, f"layer {name} shares the cache of {sharing[name]}: it has no file")
        fail(file, f"layer {name} is not a layer of the cache description")
    num_tokens = num_tokens or 0
    rows = {-(-num_tokens // group.block_size) for group in config.groups}
    if len(rows) > 1:
        fail(folder, "the description's groups have different block sizes; a folder holds one")
    num_rows = rows.pop()
    tensors = {
        name: _blocked(tensor, layout, entry.spec, num_rows)
        for name, (entry, tensor, layout) in loaded.items()
    }
    config = _with_blocks_axis(config)
    request = DumpRequest(
        num_tokens, {group.id: (0, list(range(num_rows))) for group in config.groups}
    )
    return Dump(
        path=folder,
        worker=WorkerInfo(0, 1, 0, 1, "producer", "vllm ExampleConnector", folder),
        description=config,
        tensors=tensors,
        num_rows=num_rows,
        block_ids=list(range(num_rows)),
        requests={Path(os.path.abspath(folder)).name: request},
        maps=maps,
    )


def _layout_sizes(spec: LayerSpec, tokens: int) -> tuple[int, ...]:
    """A token-major tensor's shape: the layout without ``N``, ``T`` spanning every token."""
    sizes = spec.axis_sizes(tokens=tokens)
    return tuple(sizes[letter] for letter in spec.layout.replace("N", ""))


def _example_tokens(file: str, entry: LayerEntry, item: Entry, layout: str) -> int:
    """The token count of an ExampleConnector tensor, checked against the layout (the
    axes after ``T`` may be merged into one, as vLLM saves them)."""
    spec = entry.spec
    axis = layout.index("T")
    shape = item.shape
    if len(shape) > axis:
        tokens = shape[axis]
        full = _layout_sizes(spec, tokens)
        merged = (*full[: axis + 1], math.prod(full[axis + 1 :]))
        if shape in (full, merged) and item.dtype == spec.dtype:
            return tokens
    want = _layout_sizes(spec, 0)
    expected = "x".join("T" if i == axis else str(n) for i, n in enumerate(want))
    fail(
        file,
        f"layer {entry.name}: expected kv_cache of shape [{expected}] ({layout}, "
        f"{dtype_name(spec.dtype)}), got {list(shape)} {dtype_name(item.dtype)}",
    )


def _blocks_layout(layout: str) -> str:
    """A token-major layout with ``N`` put just outside ``T`` (unchanged if it has ``N``)."""
    if "N" in layout:
        return layout
    axis = layout.index("T")
    return layout[:axis] + "N" + layout[axis:]


def _with_blocks_axis(config: CacheDescription) -> CacheDescription:
    """The description with every token-major attention layout given its ``N`` axis, as
    the blocked views of ``_blocked`` lay the tensors out."""

    def spec_of(spec: LayerSpec) -> LayerSpec:
        if spec.is_state:
            return spec
        return dataclasses.replace(spec, layout=_blocks_layout(spec.layout))

    groups = tuple(
        dataclasses.replace(
            group,
            spec=spec_of(group.spec),
            layers=tuple(
                dataclasses.replace(entry, spec=spec_of(entry.spec)) for entry in group.layers
            ),
        )
        for group in config.groups
    )
    return dataclasses.replace(config, groups=groups)


def _blocked(tensor: torch.Tensor, layout: str, spec: LayerSpec, num_rows: int) -> torch.Tensor:
    """A token-major tensor as the description's layout, with ``N`` kernel blocks (a view;
    a copy padded with zeros only when the tokens do not fill the last block)."""
    axis = layout.index("T")
    tokens = num_rows * spec.block_size
    if tensor.shape[axis] != tokens:
        padded = torch.zeros(
            (*tensor.shape[:axis], tokens, *tensor.shape[axis + 1 :]), dtype=tensor.dtype
        )
        padded.narrow(axis, 0, tensor.shape[axis]).copy_(tensor)
        tensor = padded
    kernel = spec.kernel_block_size
    blocked = tensor.unflatten(axis, (tokens // kernel, kernel))
    letters = layout[:axis] + "NT" + layout[axis + 1 :]
    return blocked.permute([letters.index(letter) for letter in _blocks_layout(spec.layout)])
