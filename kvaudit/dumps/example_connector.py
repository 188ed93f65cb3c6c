"""vLLM ExampleConnector folders opened as one-request dumps: one ``<layer_name>.safetensors``
file per layer, one ``kv_cache`` tensor each holding the request's prompt KV, token-major.

The connector saves ``layer[block_ids, :, offsets]`` of vLLM's standardized per-layer view
``[blocks, heads, tokens, 2*head_size]``, that is ``[tokens, heads, 2*head_size]`` (MLA:
``[tokens, width]``), whatever the engine's physical layout; older versions saved
``[2, tokens, heads*head_size]``. Each layer is read in the form its tensor has, under the
engine's own description: the dump's description gets the form's layout (with ``N``), as
checksums do not depend on the layout. Several folders (one per request, the folder's name
the request id) are read together as one dump.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.dtypes import dtype_name
from ..core.validation import fail
from ..description import CacheDescription, LayerEntry, LayerSpec
from ..records import WorkerInfo
from .dump import META_FORMAT, Dump, DumpRequest
from .layers import kv_apart, owner_layers
from .safetensors_io import Entry, map_file, read_header, safetensors_files, tensor_view

if TYPE_CHECKING:
    import torch

EXAMPLE_CONNECTOR_TENSOR = "kv_cache"
ENGINE = "vllm ExampleConnector"


@dataclasses.dataclass(frozen=True)
class _Form:
    """A form a connector saves a layer in: the tensor's axis letters (``T`` spans the
    request's tokens; ``C`` is K's then V's row), and whether the axes after ``T`` may come
    merged into one."""

    name: str
    letters: str
    merged: bool


def _forms(spec: LayerSpec) -> list[_Form]:
    """The forms a layer's ``kv_cache`` may have, in order of preference: a token-major
    description's own layout, then vLLM's current form, then its older one."""
    forms = []
    if "N" not in spec.layout:
        forms.append(_Form(f"layout {spec.layout}", spec.layout, True))
    if spec.is_mla:
        forms.append(_Form("[tokens, width]", "TC", False))
    else:
        forms.append(_Form("[tokens, heads, 2*head_size]", "THC", False))
        if spec.head_size == spec.head_size_v:
            forms.append(_Form("[2, tokens, heads*head_size]", "KTHD", True))
    return forms


def _shapes(spec: LayerSpec, form: _Form, tokens: int) -> tuple[tuple[int, ...], ...]:
    """The shapes a form's tensor of ``tokens`` tokens may have: whole, and merged after T."""
    sizes = spec.axis_sizes(tokens=tokens)
    full = tuple(sizes[letter] for letter in form.letters)
    if not form.merged:
        return (full,)
    axis = form.letters.index("T")
    return full, (*full[: axis + 1], math.prod(full[axis + 1 :]))


def _match(file: str, entry: LayerEntry, item: Entry) -> tuple[_Form, int]:
    """The form of a layer's ``kv_cache`` and its token count.

    Raises:
        KvauditError: No form of the layer's spec has the tensor's shape and dtype; the
            message lists the forms expected.

    """
    spec = entry.spec
    forms = _forms(spec)
    if item.dtype == spec.dtype:
        for form in forms:
            axis = form.letters.index("T")
            if len(item.shape) > axis and item.shape in _shapes(spec, form, item.shape[axis]):
                return form, item.shape[axis]
    expected = " or ".join(
        f"[{'x'.join('T' if n == -1 else str(n) for n in _shapes(spec, form, -1)[-1])}] "
        f"({form.name})"
        for form in forms
    )
    fail(
        file,
        f"layer {entry.name}: expected kv_cache of shape {expected}, "
        f"{dtype_name(spec.dtype)}; got {list(item.shape)} {dtype_name(item.dtype)}",
    )


def request_id_of(folder: str) -> str:
    """A folder's request id: its name (the connector's hash of the prompt)."""
    return os.path.basename(os.path.abspath(folder))


def open_example_connector(folder: str, config: CacheDescription | None) -> Dump:
    """One request's prompt KV saved by vLLM's ExampleConnector as a one-request dump
    whose rows are the request's block positions (views of the files, no copy but the
    zero padding of a last block the tokens do not fill)."""
    paths = safetensors_files(folder)
    if not paths:
        fail(
            folder,
            "is a directory but not an ExampleConnector folder (<layer_name>.safetensors "
            "files, one kv_cache tensor each)",
        )
    if config is None:
        fail(folder, "an ExampleConnector folder embeds no cache description: give one (--config)")
    files = {os.path.basename(path).removesuffix(".safetensors"): path for path in paths}
    _check_files(files, config)
    num_tokens: int | None = None
    loaded: dict[str, tuple[LayerEntry, torch.Tensor, _Form]] = {}
    maps = []
    for entry in owner_layers(config):
        spec = entry.spec
        file = files.get(entry.name)
        if file is None:
            if entry.name in config.draft_layers:
                continue
            fail(folder, f"layer {entry.name} has no file {entry.name}.safetensors")
        if spec.is_state or kv_apart(spec):
            kind = "a state layer" if spec.is_state else f"layout {spec.layout} keeps K and V apart"
            fail(file, f"layer {entry.name}: {kind}; ExampleConnector saves one kv_cache per layer")
        item = _saved_tensor(file)
        form, tokens = _match(file, entry, item)
        if num_tokens is not None and tokens != num_tokens:
            fail(file, f"holds {tokens} tokens, the folder's other layers hold {num_tokens}")
        num_tokens = tokens
        mapped = map_file(file)
        maps.append(mapped)
        whole = _shapes(spec, form, tokens)[0]
        loaded[entry.name] = (entry, tensor_view(mapped, item).reshape(whole), form)
    num_tokens = num_tokens or 0
    rows = {-(-num_tokens // group.block_size) for group in config.groups}
    if len(rows) > 1:
        fail(folder, "the description's groups have different block sizes; a folder holds one")
    num_rows = rows.pop()
    tensors = {
        name: _blocked(tensor, form.letters, entry.spec, num_rows)
        for name, (entry, tensor, form) in loaded.items()
    }
    layouts = {name: _blocks_layout(form.letters) for name, (_, _, form) in loaded.items()}
    request = DumpRequest(
        num_tokens, {group.id: (0, list(range(num_rows))) for group in config.groups}
    )
    return Dump(
        path=folder,
        worker=WorkerInfo(0, 1, 0, 1, "producer", ENGINE, folder),
        description=_with_layouts(config, layouts),
        tensors=tensors,
        num_rows=num_rows,
        block_ids=list(range(num_rows)),
        requests={request_id_of(folder): request},
        maps=maps,
    )


def _saved_tensor(file: str) -> Entry:
    """A layer file's ``kv_cache`` tensor, the file checked to be as the connector saves
    it: that one tensor and no kvaudit metadata."""
    header = read_header(file)
    if META_FORMAT in header.metadata or set(header.tensors) != {EXAMPLE_CONNECTOR_TENSOR}:
        fail(
            file,
            f"not an ExampleConnector file: expected one {EXAMPLE_CONNECTOR_TENSOR} tensor "
            "and no kvaudit metadata",
        )
    return header.tensors[EXAMPLE_CONNECTOR_TENSOR]


def open_example_connectors(folders: Sequence[str], config: CacheDescription | None) -> Dump:
    """Several request folders as one dump: each folder's rows after the previous one's,
    each folder's name its request id. One folder is viewed in place; several are copied
    into memory together (a connector's folders hold prompts, not a whole cache)."""
    import torch

    dumps = [open_example_connector(folder, config) for folder in folders]
    if len(dumps) == 1:
        return dumps[0]
    first = dumps[0]
    seen: dict[str, str] = {}
    for dump in dumps:
        (request_id,) = dump.requests
        if request_id in seen:
            fail(dump.path, f"request {request_id} is also the folder {seen[request_id]}")
        seen[request_id] = dump.path
        if dump.description != first.description:
            fail(
                dump.path,
                f"its layers are saved in other forms than those of {first.path}; one "
                "connector saves every request alike",
            )
    requests: dict[str, DumpRequest] = {}
    offset = 0
    for dump in dumps:
        for request_id, request in dump.requests.items():
            groups = {
                gid: (start, [offset + row for row in ids])
                for gid, (start, ids) in request.groups.items()
            }
            requests[request_id] = DumpRequest(request.num_tokens, groups)
        assert isinstance(dump.num_rows, int)  # a folder's rows are one space
        offset += dump.num_rows
    tensors = {}
    for entry in owner_layers(first.description):
        if entry.name not in first.tensors:
            continue
        axis = entry.spec.layout.index("N")
        parts = [dump.tensors[entry.name] for dump in dumps]
        tensors[entry.name] = torch.cat(parts, dim=axis)  # type: ignore[arg-type]
    parent = os.path.commonpath([os.path.abspath(dump.path) for dump in dumps])
    return Dump(
        path=parent,
        worker=WorkerInfo(0, 1, 0, 1, "producer", ENGINE, parent),
        description=first.description,
        tensors=tensors,
        num_rows=offset,
        block_ids=list(range(offset)),
        requests=requests,
    )


def _check_files(files: dict[str, str], config: CacheDescription) -> None:
    """Every file is a layer of the description that owns its cache."""
    owners = {entry.name for entry in owner_layers(config)}
    sharing = {entry.name: entry.shares for group in config.groups for entry in group.layers}
    for name, file in files.items():
        if name in owners:
            continue
        if name in sharing:
            fail(file, f"layer {name} shares the cache of {sharing[name]}: it has no file")
        fail(file, f"layer {name} is not a layer of the cache description")


def _blocks_layout(letters: str) -> str:
    """A token-major layout with ``N`` put just outside ``T`` (unchanged if it has ``N``)."""
    if "N" in letters:
        return letters
    axis = letters.index("T")
    return letters[:axis] + "N" + letters[axis:]


def _with_layouts(config: CacheDescription, layouts: dict[str, str]) -> CacheDescription:
    """The description with each read layer in the layout its blocked tensor has (layers
    sharing a cache follow their owner's; unread ones get ``N`` if they lack it); a
    group's spec follows its first read layer."""

    def spec_of(spec: LayerSpec, layout: str | None) -> LayerSpec:
        if spec.is_state:
            return spec
        return dataclasses.replace(spec, layout=layout or _blocks_layout(spec.layout))

    groups = []
    for group in config.groups:
        entries = []
        for entry in group.layers:
            layout = layouts.get(entry.name) or layouts.get(entry.shares or "")
            entries.append(dataclasses.replace(entry, spec=spec_of(entry.spec, layout)))
        first = next((layouts[e.name] for e in group.layers if e.name in layouts), None)
        groups.append(
            dataclasses.replace(group, spec=spec_of(group.spec, first), layers=tuple(entries))
        )
    return dataclasses.replace(config, groups=tuple(groups))


def _blocked(tensor: torch.Tensor, letters: str, spec: LayerSpec, num_rows: int) -> torch.Tensor:
    """A token-major tensor (axes ``letters``) with ``T`` cut into ``N`` kernel blocks of
    ``T`` tokens: a view, or a copy padded with zeros when the tokens do not fill the
    last block."""
    import torch

    axis = letters.index("T")
    tokens = num_rows * spec.block_size
    if tensor.shape[axis] != tokens:
        padded = torch.zeros(
            (*tensor.shape[:axis], tokens, *tensor.shape[axis + 1 :]), dtype=tensor.dtype
        )
        padded.narrow(axis, 0, tensor.shape[axis]).copy_(tensor)
        tensor = padded
    kernel = spec.kernel_block_size
    return tensor.unflatten(axis, (tokens // kernel, kernel))
