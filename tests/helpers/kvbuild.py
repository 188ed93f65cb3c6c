"""Builders: a model's global KV as each worker of an engine holds it, with its description.

A ``Model`` names the layers of each group in global form (global KV heads, global state
shapes); ``make_request`` draws one request's KV; ``build_engine`` shards it by TP and PP,
pages it into random block ids (junk in unused blocks and past ``num_tokens``), lays it
out as the description says and writes each worker's description dict.
``reference_group`` turns the same KV into ``tests.reference`` form. Nothing here imports
kvaudit: the builders are part of the tests' independent reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from helpers import reference

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}
MLA = ("mla", "sliding_window_mla")
SLIDING = ("sliding_window", "sliding_window_mla")


def dtype_size(name: str) -> int:
    """Bytes per element of a dtype name."""
    return DTYPES[name].itemsize


@dataclass(frozen=True)
class Attn:
    """An attention layer in global form: its global KV heads (MLA: 1) and spec."""

    name: str
    heads: int = 1
    head_size: int = 8
    head_size_v: int | None = None  # None: head_size (MLA: 0)
    type: str = "full_attention"
    dtype: str = "bfloat16"
    max_tp_shards: int | None = None
    layout: str | None = None  # None: the engine's layout for the group
    sliding_window: int | None = None
    attention_chunk_size: int | None = None  # chunked_local_attention only
    shares: str | None = None  # the layer whose cache this one aliases

    @property
    def is_mla(self) -> bool:
        return self.type in MLA

    @property
    def value_size(self) -> int:
        if self.head_size_v is not None:
            return self.head_size_v
        return 0 if self.is_mla else self.head_size

    @property
    def cell_bytes(self) -> int:
        return (self.head_size + self.value_size) * dtype_size(self.dtype)


@dataclass(frozen=True)
class Mamba:
    """A Mamba layer. Unsplit: ``shapes`` are each rank's states. Split: ``shapes`` are
    the global states and ``splits`` per state ``(axis, ((global_rows, max_shards), ...))``;
    a segment is held by ``min(tp_size, max_shards)`` shards."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    checksummed_states: int | None = None
    tp_replicated: bool = False
    splits: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] | None = None
    page_pad: int = 8  # junk bytes after the states in each page

    @property
    def covered(self) -> int:
        return len(self.shapes) if self.checksummed_states is None else self.checksummed_states


LayerModel = Attn | Mamba


@dataclass(frozen=True)
class GroupModel:
    """A group of layers with its default block size, kernel block size and layout."""

    id: int
    layers: tuple[LayerModel, ...]
    block_size: int = 8
    kernel_block_size: int | None = None
    layout: str = "NTHC"
    transfer: bool = True
    host_resident: bool = False


@dataclass(frozen=True)
class Model:
    """A model's KV cache groups, the model's KV head count and its drafter layers."""

    groups: tuple[GroupModel, ...]
    model_kv_heads: int | None = None
    draft_layers: tuple[str, ...] = ()

    def group(self, group_id: int) -> GroupModel:
        return next(g for g in self.groups if g.id == group_id)

    def layer(self, name: str) -> LayerModel:
        return next(layer for g in self.groups for layer in g.layers if layer.name == name)


@dataclass(frozen=True)
class Engine:
    """How one engine holds the model: TP and PP sizes, per group block size, kernel block
    size and layout (defaults: the model's), memory order per layout, KV sharing mode."""

    tp_size: int = 1
    pp_size: int = 1
    block_sizes: dict[int, int] = field(default_factory=dict)
    kernel_block_sizes: dict[int, int] = field(default_factory=dict)
    layouts: dict[int, str] = field(default_factory=dict)
    # layout -> the order of its letters in memory (a non-contiguous live tensor).
    physical: dict[str, str] = field(default_factory=dict)
    num_blocks: int | None = None
    share_mode: str = "description"  # "description": shares:, "tensor": one tensor object
    state_dtype: str = "uint8"  # the dtype a Mamba layer's page tensor is viewed as
    state_rows: int = 1  # > 1: each page as [state_rows, -1] (a 3-D page tensor)
    seed: int = 0

    def block_size(self, group: GroupModel) -> int:
        return self.block_sizes.get(group.id, group.block_size)

    def kernel_block_size(self, group: GroupModel) -> int:
        default = group.kernel_block_size or self.block_size(group)
        return self.kernel_block_sizes.get(group.id, default)

    def layout(self, group: GroupModel, layer: Attn) -> str:
        return layer.layout or self.layouts.get(group.id, group.layout)


@dataclass
class RequestKV:
    """One request's KV in global form: per layer, uint8 cells ``[num_tokens, heads,
    cell_bytes]``; unsplit Mamba: ``[positions, heads, states_bytes]``; split Mamba: per
    state ``[positions, *global_shape]`` of unsigned integers of the state's size."""

    num_tokens: int
    data: dict[str, np.ndarray | tuple[np.ndarray, ...]]


@dataclass
class Worker:
    """What one worker holds: its ranks, description dict, tensors and request blocks."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    description: dict
    tensors: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    requests: dict[str, tuple[int, dict[int, tuple[int, list[int]]]]]


def replicas(layer: Attn, tp_size: int) -> int:
    """How many consecutive ranks hold the same heads of an attention layer."""
    if layer.max_tp_shards is not None:
        return tp_size // min(tp_size, layer.max_tp_shards)
    if layer.is_mla:
        return tp_size
    return tp_size // layer.heads if layer.heads < tp_size else 1


def local_heads(layer: Attn, tp_size: int) -> int:
    """The heads of an attention layer on each rank."""
    heads = layer.heads * replicas(layer, tp_size)
    assert heads % tp_size == 0, (layer.name, tp_size)
    return heads // tp_size


def segment_replicas(max_shards: int, tp_size: int) -> int:
    """How many consecutive ranks hold the same rows of a split state's segment."""
    return tp_size // min(tp_size, max_shards)


def _state_bytes(shapes: tuple[tuple[int, ...], ...], dtypes: tuple[str, ...]) -> int:
    return sum(int(np.prod(s)) * dtype_size(d) for s, d in zip(shapes, dtypes, strict=True))


def local_state_shapes(layer: Mamba, tp_size: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's state shapes."""
    if layer.splits is None:
        return layer.shapes
    shapes = []
    for shape, (axis, segments) in zip(layer.shapes, layer.splits, strict=True):
        rows = 0
        for global_rows, max_shards in segments:
            rows += global_rows // min(tp_size, max_shards)
        shapes.append((*shape[:axis], rows, *shape[axis + 1 :]))
    return tuple(shapes)


def positions_of(num_tokens: int, block_size: int) -> int:
    """Block positions that hold at least one token."""
    return -(-num_tokens // block_size)


def make_request(
    model: Model, num_tokens: int, seed: int, tp_size: int = 1, block_size: int | None = None
) -> RequestKV:
    """Random KV of one request for every layer of the model (drafters included).

    Unsplit Mamba layers hold one head per rank (one when TP-replicated), so their KV
    depends on ``tp_size``; state layers have one state per position of ``block_size``
    (default: their group's).
    """
    rng = np.random.default_rng(seed)
    data: dict[str, np.ndarray | tuple[np.ndarray, ...]] = {}
    for group in model.groups:
        positions = positions_of(num_tokens, block_size or group.block_size)
        for layer in group.layers:
            if isinstance(layer, Attn):
                if layer.shares is None:
                    shape = (num_tokens, layer.heads, layer.cell_bytes)
                    data[layer.name] = rng.integers(0, 256, shape, dtype=np.uint8)
            elif layer.splits is None:
                heads = 1 if layer.tp_replicated else tp_size
                shape = (positions, heads, _state_bytes(layer.shapes, layer.dtypes))
                data[layer.name] = rng.integers(0, 256, shape, dtype=np.uint8)
            else:
                states = []
                for shape, dtype in zip(layer.shapes, layer.dtypes, strict=True):
                    size = dtype_size(dtype)
                    raw = rng.integers(0, 256, (positions, *shape, size), dtype=np.uint8)
                    states.append(raw.view(f"<u{size}").reshape(positions, *shape))
                data[layer.name] = tuple(states)
    return RequestKV(num_tokens, data)


def reference_group(
    model: Model, group_id: int, request: RequestKV, tp_size: int, block_size: int | None = None
) -> reference.Group:
    """The request's KV of one group in ``tests.reference`` form (drafters left out)."""
    group = model.group(group_id)
    aliases: dict[str, list[str]] = {}
    for layer in group.layers:
        if isinstance(layer, Attn) and layer.shares is not None:
            aliases.setdefault(layer.shares, []).append(layer.name)
    caches: list[reference.Cache] = []
    for layer in group.layers:
        if layer.name in model.draft_layers:
            continue
        names = tuple(aliases.get(layer.name, ()))
        if isinstance(layer, Attn):
            if layer.shares is not None:
                continue
            cells = request.data[layer.name]
            caches.append(reference.Layer(layer.name, cells, replicas(layer, tp_size), names))
        elif layer.splits is None:
            covered = _state_bytes(layer.shapes[: layer.covered], layer.dtypes[: layer.covered])
            cells = request.data[layer.name][:, :, :covered]
            r = tp_size if layer.tp_replicated else 1
            caches.append(reference.UnsplitState(layer.name, cells, r, names))
        else:
            segments = tuple(
                tuple((g, segment_replicas(s, tp_size)) for g, s in segs)
                for _, segs in layer.splits
            )
            axes = tuple(axis for axis, _ in layer.splits)
            states = request.data[layer.name]
            caches.append(reference.SplitState(layer.name, states, axes, segments, names))
    return reference.Group(block_size or group.block_size, tuple(caches))


def stage_of(model: Model, pp_size: int) -> dict[str, int]:
    """Each layer's PP stage: layer numbers split into ``pp_size`` contiguous ranges;
    a layer that shares a cache goes with its target."""
    names = [layer.name for g in model.groups for layer in g.layers]
    if pp_size == 1:
        return dict.fromkeys(names, 0)
    numbers = sorted({reference.layer_number(name) for name in names})
    stage = {n: i * pp_size // len(numbers) for i, n in enumerate(numbers)}
    result = {name: stage[reference.layer_number(name)] for name in names}
    for g in model.groups:
        for layer in g.layers:
            if isinstance(layer, Attn) and layer.shares is not None:
                result[layer.name] = result[layer.shares]
    return result


def _spec_dict(
    model: Model, group: GroupModel, layer: LayerModel, engine: Engine, tp_size: int
) -> dict:
    """A layer's spec as this engine's worker describes it."""
    spec: dict = {"block_size": engine.block_size(group)}
    if isinstance(layer, Mamba):
        spec["type"] = "mamba"
        spec["shapes"] = [list(s) for s in local_state_shapes(layer, tp_size)]
        spec["dtypes"] = list(layer.dtypes)
        if layer.checksummed_states is not None:
            spec["checksummed_states"] = layer.checksummed_states
        spec["tp_replicated"] = layer.tp_replicated
        if layer.splits is not None:
            spec["state_splits"] = [
                {
                    "axis": axis,
                    "segments": [
                        [g // min(tp_size, s), segment_replicas(s, tp_size)] for g, s in segs
                    ],
                }
                for axis, segs in layer.splits
            ]
        return spec
    if layer.shares is not None:
        layer = model.layer(layer.shares)
    spec["type"] = layer.type
    spec["kernel_block_size"] = engine.kernel_block_size(group)
    spec["num_kv_heads"] = local_heads(layer, tp_size)
    spec["head_size"] = layer.head_size
    spec["head_size_v"] = layer.value_size
    spec["dtype"] = layer.dtype
    spec["layout"] = engine.layout(group, layer)
    if layer.max_tp_shards is not None:
        spec["max_tp_shards"] = layer.max_tp_shards
    if layer.type in SLIDING:
        spec["sliding_window"] = layer.sliding_window or 4096
    if layer.attention_chunk_size is not None:
        spec["attention_chunk_size"] = layer.attention_chunk_size
    return spec


def _arrange(tensor: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Permute a tensor whose axes are the letters ``src`` into the order ``dst``."""
    return tensor.permute([src.index(letter) for letter in dst])


def to_layout(
    cells: np.ndarray,
    layout: str,
    kernel_block_size: int,
    dtype: str,
    physical: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged cells uint8 ``[num_blocks, block_size, heads, cell_bytes]`` as a layer tensor
    in ``layout`` (K and V tensors for a layout with D and no K), its memory in the letter
    order ``physical`` when given."""
    num_blocks, block_size, heads, cell_bytes = cells.shape
    kernel_blocks = num_blocks * (block_size // kernel_block_size)
    x = cells.reshape(kernel_blocks, kernel_block_size, heads, cell_bytes)
    if "D" in layout:
        x = x.reshape(kernel_blocks, kernel_block_size, heads, 2, cell_bytes // 2)
        src = "NTHKD"
    else:
        src = "NTHC"
    t = torch.from_numpy(np.ascontiguousarray(x)).view(DTYPES[dtype])
    if "H" not in layout:
        assert heads == 1, layout
        t = t.squeeze(2)
        src = src.replace("H", "")

    def arrange(part: torch.Tensor, letters: str) -> torch.Tensor:
        if physical is None:
            return _arrange(part, letters, layout).contiguous()
        stored = _arrange(part, letters, physical).contiguous()
        return _arrange(stored, physical, layout)

    if "D" in layout and "K" not in layout:
        k_axis = src.index("K")
        letters = src.replace("K", "")
        return arrange(t.select(k_axis, 0), letters), arrange(t.select(k_axis, 1), letters)
    return arrange(t, src)


def _local_states(
    layer: Mamba,
    value: np.ndarray | tuple[np.ndarray, ...],
    position: int,
    tp_rank: int,
    tp_size: int,
) -> bytes:
    """The bytes a rank's page holds for one position: its states back to back."""
    if layer.splits is None:
        head = 0 if layer.tp_replicated else tp_rank
        return value[position, head].tobytes()
    parts = []
    for state, (axis, segments) in zip(value, layer.splits, strict=True):
        rows = np.moveaxis(state[position], axis, 0)
        offset = 0
        pieces = []
        for global_rows, max_shards in segments:
            r = segment_replicas(max_shards, tp_size)
            local = global_rows * r // tp_size
            first = offset + (tp_rank // r) * local
            pieces.append(rows[first : first + local])
            offset += global_rows
        local_state = np.moveaxis(np.concatenate(pieces), 0, axis)
        parts.append(np.ascontiguousarray(local_state).tobytes())
    return b"".join(parts)


def _head_range(layer: Attn, tp_rank: int, tp_size: int) -> slice:
    """The global heads a rank holds: shard ``tp_rank // R``."""
    n = local_heads(layer, tp_size)
    shard = tp_rank // replicas(layer, tp_size)
    return slice(shard * n, shard * n + n)


def build_engine(
    model: Model,
    requests: dict[str, RequestKV],
    engine: Engine,
    positions: dict[str, dict[int, tuple[int, int]]] | None = None,
) -> list[Worker]:
    """Every worker of an engine holding the requests' KV, PP stage by stage, TP rank by
    TP rank. ``positions[req][group] = (start, count)`` lists only those block positions
    (default: every position holding a token); all workers share one block table."""
    rng = np.random.default_rng(engine.seed)
    tables: dict[str, dict[int, tuple[int, list[int]]]] = {rid: {} for rid in requests}
    needed = 1
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for group in model.groups:
        block_size = engine.block_size(group)
        used = 0
        for rid, request in requests.items():
            default = (0, positions_of(request.num_tokens, block_size))
            span = (positions or {}).get(rid, {}).get(group.id, default)
            spans[rid, group.id] = span
            used += span[1]
        needed = max(needed, used)
    num_blocks = engine.num_blocks or needed + 3
    for group in model.groups:
        ids = [int(i) for i in rng.permutation(num_blocks)]
        for rid in requests:
            start, count = spans[rid, group.id]
            tables[rid][group.id] = (start, ids[:count])
            ids = ids[count:]

    stages = stage_of(model, engine.pp_size)
    workers = []
    for pp_rank in range(engine.pp_size):
        for tp_rank in range(engine.tp_size):
            workers.append(
                _build_worker(
                    model, requests, engine, tables, num_blocks, stages, pp_rank, tp_rank, rng
                )
            )
    return workers


def _build_worker(
    model: Model,
    requests: dict[str, RequestKV],
    engine: Engine,
    tables: dict[str, dict[int, tuple[int, list[int]]]],
    num_blocks: int,
    stages: dict[str, int],
    pp_rank: int,
    tp_rank: int,
    rng: np.random.Generator,
) -> Worker:
    tp_size = engine.tp_size
    groups = []
    tensors: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
    for group in model.groups:
        layers = [layer for layer in group.layers if stages[layer.name] == pp_rank]
        if not layers:
            continue
        block_size = engine.block_size(group)
        specs = [_spec_dict(model, group, layer, engine, tp_size) for layer in layers]
        group_spec = specs[0]
        entries: list = []
        for layer, spec in zip(layers, specs, strict=True):
            override = {k: v for k, v in spec.items() if group_spec.get(k) != v}
            override.update({k: None for k in group_spec if k not in spec})
            shares = isinstance(layer, Attn) and layer.shares is not None
            if shares and engine.share_mode == "description":
                entry: dict = {"name": layer.name, "shares": layer.shares}
                if override:
                    entry["spec"] = override
                entries.append(entry)
                continue
            entries.append({"name": layer.name, "spec": override} if override else layer.name)
            if shares:
                continue
            tensors[layer.name] = _layer_tensor(
                layer, group, engine, requests, tables, num_blocks, block_size, tp_rank, rng
            )
        if engine.share_mode == "tensor":
            for layer in layers:
                if isinstance(layer, Attn) and layer.shares is not None:
                    tensors[layer.name] = tensors[layer.shares]
        groups.append(
            {
                "id": group.id,
                "transfer": group.transfer,
                "host_resident": group.host_resident,
                "spec": group_spec,
                "layers": entries,
            }
        )
    description: dict = {"kvaudit": 1, "num_blocks": num_blocks, "groups": groups}
    if model.model_kv_heads is not None:
        description["model_kv_heads"] = model.model_kv_heads
    drafts = [name for name in model.draft_layers if stages.get(name) == pp_rank]
    if drafts:
        description["draft_layers"] = drafts
    present = {g["id"] for g in groups}
    blocks = {
        rid: (
            requests[rid].num_tokens,
            {gid: table for gid, table in table_by_group.items() if gid in present},
        )
        for rid, table_by_group in tables.items()
    }
    return Worker(tp_rank, tp_size, pp_rank, engine.pp_size, description, tensors, blocks)


def _layer_tensor(
    layer: LayerModel,
    group: GroupModel,
    engine: Engine,
    requests: dict[str, RequestKV],
    tables: dict[str, dict[int, tuple[int, list[int]]]],
    num_blocks: int,
    block_size: int,
    tp_rank: int,
    rng: np.random.Generator,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One layer's tensor on one worker: junk everywhere, then each request's KV."""
    tp_size = engine.tp_size
    if isinstance(layer, Mamba):
        local = _state_bytes(local_state_shapes(layer, tp_size), layer.dtypes)
        page = -(-(local + layer.page_pad) // 16) * 16
        pages = rng.integers(0, 256, (num_blocks, page), dtype=np.uint8)
        for rid, request in requests.items():
            start, ids = tables[rid][group.id]
            for i, block_id in enumerate(ids):
                position = start + i
                if position * block_size >= request.num_tokens:
                    continue
                states = _local_states(layer, request.data[layer.name], position, tp_rank, tp_size)
                pages[block_id, : len(states)] = np.frombuffer(states, dtype=np.uint8)
        tensor = torch.from_numpy(pages).view(DTYPES[engine.state_dtype])
        if engine.state_rows > 1:
            tensor = tensor.reshape(num_blocks, engine.state_rows, -1)
        return tensor
    heads = _head_range(layer, tp_rank, tp_size)
    n = heads.stop - heads.start
    cells = rng.integers(0, 256, (num_blocks, block_size, n, layer.cell_bytes), dtype=np.uint8)
    for rid, request in requests.items():
        start, ids = tables[rid][group.id]
        kv = request.data[layer.name]
        for i, block_id in enumerate(ids):
            first = (start + i) * block_size
            valid = reference.valid_tokens(request.num_tokens, block_size, start + i)
            cells[block_id, :valid] = kv[first : first + valid, heads]
    layout = engine.layout(group, layer)
    return to_layout(
        cells, layout, engine.kernel_block_size(group), layer.dtype, engine.physical.get(layout)
    )


def gather_cells(
    tensor: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    layout: str,
    block_size: int,
    block_ids: list[int],
) -> np.ndarray:
    """The inverse of paging: uint8 ``[len(block_ids) * block_size, heads, cell_bytes]``
    read back from a layer tensor in ``layout``."""
    if isinstance(tensor, tuple):
        target = "NTHD" if "H" in layout else "NTD"
        t = torch.stack([_arrange(part, layout, target) for part in tensor], dim=-2)
    else:
        target = "NTHKD" if "K" in layout else "NTHC"
        if "H" not in layout:
            target = target.replace("H", "")
        t = _arrange(tensor, layout, target)
    if "H" not in layout:
        t = t.unsqueeze(2)
    raw = t.contiguous().view(torch.uint8).numpy()
    heads = raw.shape[2]
    raw = raw.reshape(-1, block_size, heads, int(np.prod(raw.shape[3:])))
    return raw[list(block_ids)].reshape(-1, heads, raw.shape[3])


def slot_rows(
    worker: Worker, layer_name: str, block_id: int, slot: int, head: int
) -> list[torch.Tensor]:
    """uint8 views (no copy) of one token's cell in a worker's live layer tensor: the K and
    V rows, or the whole row; writing them writes the tensor."""
    spec = _worker_spec(worker, layer_name)
    layout = spec["layout"]
    kernel = spec.get("kernel_block_size", spec["block_size"])
    index = {"N": block_id * (spec["block_size"] // kernel) + slot // kernel, "T": slot % kernel}
    index["H"] = head
    tensor = worker.tensors[layer_name]

    def row(t: torch.Tensor, letters: str, plane: int | None) -> torch.Tensor:
        for letter in reversed(letters[:-1]):
            axis = letters.index(letter)
            position = plane if letter == "K" else index[letter]
            t = t.select(axis, position)
        return t.view(torch.uint8)

    if isinstance(tensor, tuple):
        return [row(tensor[0], layout, None), row(tensor[1], layout, None)]
    if "K" in layout:
        return [row(tensor, layout, 0), row(tensor, layout, 1)]
    return [row(tensor, layout, None)]


def _worker_spec(worker: Worker, layer_name: str) -> dict:
    """A layer's merged spec dict in a worker's description."""
    for group in worker.description["groups"]:
        for entry in group["layers"]:
            name = entry if isinstance(entry, str) else entry["name"]
            if name == layer_name:
                spec = dict(group["spec"])
                if isinstance(entry, dict):
                    for key, value in entry.get("spec", {}).items():
                        if value is None:
                            spec.pop(key, None)
                        else:
                            spec[key] = value
                return spec
    raise KeyError(layer_name)


def replace_layers(model: Model, group_id: int, layers: tuple[LayerModel, ...]) -> Model:
    """The model with one group's layers replaced."""
    groups = tuple(
        dataclasses.replace(g, layers=layers) if g.id == group_id else g for g in model.groups
    )
    return dataclasses.replace(model, groups=groups)


def write_workers(workers: list[Worker], folder: Path, role: str, source: str = "test") -> Path:
    """Each worker's dump in ``folder`` (``pp{P}-tp{T}.safetensors``) with its own
    description and every request's blocks, ``role`` and ``source`` in its worker info;
    the folder."""
    from kvaudit.checksum.checksummer import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.dumps import write_dump
    from kvaudit.records import WorkerInfo

    folder.mkdir(parents=True)
    for w in workers:
        path = folder / f"pp{w.pp_rank}-tp{w.tp_rank}.safetensors"
        blocks = {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in w.requests.items()}
        info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, role, source)
        write_dump(
            path, parse_description(w.description, str(path)), w.tensors, blocks, worker=info
        )
    return folder
