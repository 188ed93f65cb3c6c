"""Dump sets of one model, dumped by a TP=2, PP=2 producer and a TP=4 consumer in other
block sizes, kernel blocks and layouts, and decoded independently of kvaudit (safetensors,
the tests' own layout inverse and the spec's rules): what the locate and corrupt tests
share. Three groups: attention (bf16 and fp32), MLA (fp8 e4m3 and e5m2, held whole by
every rank) and TP-split Mamba states.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from helpers import kvbuild as kb
from helpers import reference as ref
from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.locate import ElementChange, LocatedDifference
from kvaudit.records import WorkerInfo

ATTN = "model.layers.{}.self_attn.attn"
L0, L1, L2, L3 = (ATTN.format(i) for i in range(4))
MIXER = "model.layers.4.mixer"

MODEL = kb.Model(
    (
        kb.GroupModel(0, (kb.Attn(L0, 4, 8), kb.Attn(L1, 4, 8, dtype="float32")), 8),
        kb.GroupModel(
            1,
            (
                kb.Attn(L2, 1, 16, type="mla", dtype="float8_e4m3fn"),
                kb.Attn(L3, 1, 16, type="mla", dtype="float8_e5m2"),
            ),
            8,
        ),
        kb.GroupModel(
            2,
            (
                kb.Mamba(
                    MIXER,
                    shapes=((3, 8), (8, 4)),
                    dtypes=("float16", "float32"),
                    splits=((1, ((8, 8),)), (0, ((8, 8),))),
                ),
            ),
            8,
        ),
    ),
    model_kv_heads=4,
)
TOKENS = {"req-a": 45, "req-b": 30}
PRODUCER = kb.Engine(
    tp_size=2,
    pp_size=2,
    block_sizes={0: 16},
    kernel_block_sizes={0: 8},
    layouts={0: "NHTC", 1: "NTC"},
    seed=5,
)
CONSUMER = kb.Engine(
    tp_size=4,
    block_sizes={0: 4},
    kernel_block_sizes={0: 2},
    layouts={0: "KNTHD", 1: "NTHC"},
    state_dtype="int16",
    state_rows=2,
    seed=6,
)
COMPARED = {0: 16, 1: 8, 2: 8}
"""The compared (coarser) block size of each group."""


# Building and decoding dump sets.


@dataclass
class DumpedSet:
    """One engine's workers and the paths of their dumps."""

    workers: list[kb.Worker]
    paths: list[str]


@dataclass(frozen=True)
class Cell:
    """One decoded cell: the worker's replica index, its bytes and its element dtype."""

    replica: int
    data: np.ndarray
    dtype: torch.dtype
    worker: tuple[int, int] = (0, 0)
    file: str = ""


CellKey = tuple[str, str, int, int]
"""``(request, layer, global head, request position)``."""


def make_requests() -> dict[str, kb.RequestKV]:
    return {rid: kb.make_request(MODEL, n, seed=i + 1) for i, (rid, n) in enumerate(TOKENS.items())}


def dump_engine(
    requests: dict[str, kb.RequestKV], engine: kb.Engine, role: str, folder: Path
) -> DumpedSet:
    """Every worker of an engine dumped to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    workers = kb.build_engine(MODEL, requests, engine)
    paths = []
    for w in workers:
        path = folder / f"pp{w.pp_rank}-tp{w.tp_rank}.safetensors"
        blocks = {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in w.requests.items()}
        info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, role, "test")
        description = parse_description(w.description, str(path))
        write_dump(path, description, w.tensors, blocks, worker=info)
        paths.append(str(path))
    return DumpedSet(workers, paths)


def decode(worker: kb.Worker, path: str) -> dict[CellKey, Cell]:
    """Every cell of every listed block of a dump file (slots past ``num_tokens``
    included), read with safetensors and the tests' own layout rules."""
    with safe_open(path, framework="pt") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
    rows = {block: row for row, block in enumerate(json.loads(metadata["kvaudit.blocks"]))}
    cells: dict[CellKey, Cell] = {}
    for group in worker.description["groups"]:
        for entry in group["layers"]:
            name = entry if isinstance(entry, str) else entry["name"]
            layer = MODEL.layer(name)
            spec = kb._worker_spec(worker, name)
            for rid, (_, groups) in worker.requests.items():
                start, block_ids = groups[group["id"]]
                block_rows = [rows[block] for block in block_ids]
                if isinstance(layer, kb.Attn):
                    found = _attention_cells(worker, layer, spec, tensors, start, block_rows)
                else:
                    found = _state_cells(worker, layer, spec, tensors[name], start, block_rows)
                for (head, token), cell in found.items():
                    cells[rid, name, head, token] = cell
    return cells


def _attention_cells(
    worker: kb.Worker,
    layer: kb.Attn,
    spec: dict,
    tensors: dict[str, torch.Tensor],
    start: int,
    block_rows: list[int],
) -> dict[tuple[int, int], Cell]:
    layout, block_size = spec["layout"], spec["block_size"]
    apart = "D" in layout and "K" not in layout
    tensor = (
        (tensors[layer.name + "/k"], tensors[layer.name + "/v"]) if apart else tensors[layer.name]
    )
    paged = kb.gather_cells(tensor, layout, block_size, block_rows)
    first_head = kb._head_range(layer, worker.tp_rank, worker.tp_size).start
    replica = worker.tp_rank % kb.replicas(layer, worker.tp_size)
    dtype = kb.DTYPES[layer.dtype]
    result = {}
    for i in range(len(block_rows)):
        for u in range(block_size):
            token = (start + i) * block_size + u
            for h in range(paged.shape[1]):
                result[first_head + h, token] = Cell(replica, paged[i * block_size + u, h], dtype)
    return result


def _state_cells(
    worker: kb.Worker,
    layer: kb.Mamba,
    spec: dict,
    tensor: torch.Tensor,
    start: int,
    block_rows: list[int],
) -> dict[tuple[int, int], Cell]:
    """Split-state rows: global row ``h`` of the layer is head ``h``, at the block's first
    position."""
    assert layer.splits is not None
    tp_rank, tp_size = worker.tp_rank, worker.tp_size
    pages = tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], -1).numpy()
    result = {}
    for i, row in enumerate(block_rows):
        token = (start + i) * spec["block_size"]
        offset = 0
        global_first = 0
        local_shapes = kb.local_state_shapes(layer, tp_size)
        for shape, dtype, (axis, segments) in zip(
            local_shapes, layer.dtypes, layer.splits, strict=True
        ):
            size = kb.dtype_size(dtype)
            nbytes = math.prod(shape) * size
            state = pages[row, offset : offset + nbytes].view(f"<u{size}").reshape(shape)
            offset += nbytes
            state_rows = np.moveaxis(state, axis, 0).reshape(shape[axis], -1)
            local_first = 0
            for global_rows, max_shards in segments:
                replicas = kb.segment_replicas(max_shards, tp_size)
                local = global_rows * replicas // tp_size
                first = global_first + (tp_rank // replicas) * local
                for r in range(local):
                    data = np.ascontiguousarray(state_rows[local_first + r]).view(np.uint8)
                    result[first + r, token] = Cell(tp_rank % replicas, data, kb.DTYPES[dtype])
                local_first += local
                global_first += global_rows
    return result


def decode_set(dumped: DumpedSet, paths: list[str] | None = None) -> dict:
    """``(request, layer, head, token, replica) -> Cell`` over a set's files (``paths``
    replaces the set's own, worker by worker)."""
    result = {}
    for worker, path in zip(dumped.workers, paths or dumped.paths, strict=True):
        for (rid, name, head, token), cell in decode(worker, path).items():
            held = dataclasses.replace(cell, worker=(worker.tp_rank, worker.pp_rank), file=path)
            result[rid, name, head, token, cell.replica] = held
    return result


# The expected located entries, from decoded cells and the spec's rules.


def values(raw: np.ndarray, dtype: torch.dtype) -> list:
    """Elements of a dtype given as bytes: Python floats, or ints for integer dtypes."""
    tensor = torch.from_numpy(np.ascontiguousarray(raw)).view(dtype)
    if dtype.is_floating_point:
        return tensor.to(torch.float64).tolist()
    return tensor.to(torch.int64).tolist()


def expected_errors(a: np.ndarray, b: np.ndarray, dtype: torch.dtype) -> tuple[float, float]:
    """Largest absolute and relative (to ``a``) errors over the elements whose bytes
    differ; NaN on one side: infinite, on both: none; a zero reference: infinite."""
    size = dtype.itemsize
    worst_abs, worst_rel = 0.0, 0.0
    for x_raw, y_raw in zip(a.reshape(-1, size), b.reshape(-1, size)):
        if np.array_equal(x_raw, y_raw):
            continue
        (x,), (y,) = values(x_raw, dtype), values(y_raw, dtype)
        if math.isnan(x) and math.isnan(y):
            error = 0.0
        elif math.isnan(x) or math.isnan(y):
            error = math.inf
        else:
            error = abs(x - y)
        if error == 0:
            relative = 0.0
        elif math.isinf(error) or x == 0 or math.isinf(x):
            relative = math.inf
        else:
            relative = error / abs(x)
        worst_abs, worst_rel = max(worst_abs, error), max(worst_rel, relative)
    return worst_abs, worst_rel


def k_bytes(name: str, dtype: torch.dtype) -> int | None:
    """The bytes of an attention layer's K row (its cell: K then V), None for MLA and
    states."""
    layer = next((x for g in MODEL.groups for x in g.layers if x.name == name), None)
    if not isinstance(layer, kb.Attn) or layer.type == "mla":
        return None
    return layer.head_size * dtype.itemsize


def kv_swapped(name: str, differing: list) -> bool:
    """Whether each differing consumer cell is its producer cell with K and V exchanged."""
    half = k_bytes(name, differing[0][1].dtype)
    if half is None:
        return False
    return all(
        np.array_equal(b.data[:half], a.data[half:])
        and np.array_equal(b.data[half:], a.data[:half])
        for _, a, b in differing
    )


def one_element(name: str, differing: list) -> ElementChange | None:
    """The one element that differs, where one token's cell differs in one element."""
    if len(differing) != 1:
        return None
    _, a, b = differing[0]
    size = a.dtype.itemsize
    pairs = list(zip(a.data.reshape(-1, size), b.data.reshape(-1, size)))
    changed = [k for k, (x, y) in enumerate(pairs) if not np.array_equal(x, y)]
    if len(changed) != 1:
        return None
    k = changed[0]
    (before,), (after,) = values(pairs[k][0], a.dtype), values(pairs[k][1], a.dtype)
    half = k_bytes(name, a.dtype)
    part, index = "", k
    if half is not None:
        part, index = ("K", k) if k * size < half else ("V", k - half // size)
    return ElementChange(part, index, str(a.dtype).removeprefix("torch."), before, after)


def expected_located(
    producer: dict,
    consumer: dict,
    request_id: str,
    group_id: int,
    positions: list[int],
    block_size: int,
    num_tokens: int,
) -> list[LocatedDifference]:
    """Per position: producer replica 0 against consumer replica 0, then each consumer
    replica against consumer replica 0, slice by slice."""
    layers = {layer.name for layer in MODEL.group(group_id).layers}
    entries = []
    for position in positions:
        lo, hi = position * block_size, min(position * block_size + block_size, num_tokens)
        slices: dict[tuple[str, int, int], list[int]] = defaultdict(list)
        for rid, name, head, token, replica in consumer:
            if rid == request_id and name in layers and lo <= token < hi:
                slices[name, head, replica].append(token)
        found = []
        for (name, head, replica), tokens in slices.items():
            base = producer if replica == 0 else consumer
            pairs = [
                (
                    base.get((request_id, name, head, t, 0)),
                    consumer[request_id, name, head, t, replica],
                )
                for t in sorted(tokens)
            ]
            differing = [
                (t, a, b)
                for t, (a, b) in zip(sorted(tokens), pairs)
                if a is not None and not np.array_equal(a.data, b.data)
            ]
            if not differing:
                continue
            _, a0, b0 = differing[0]
            errors = [expected_errors(a.data, b.data, a.dtype) for _, a, b in differing]
            worst = max(e[0] for e in errors)
            # The scale: the largest finite producer value at the tokens both hold.
            largest = max(
                (
                    abs(value)
                    for a, _ in pairs
                    if a is not None
                    for value in values(a.data, a.dtype)
                    if math.isfinite(value)
                ),
                default=0.0,
            )
            if worst == 0:
                scaled = 0.0
            elif largest == 0 or not math.isfinite(worst):
                scaled = math.inf
            else:
                scaled = worst / largest
            # Bytes and bits counted with Python integers, element by element.
            xor = [int(x) ^ int(y) for _, a, b in differing for x, y in zip(a.data, b.data)]
            nonfinite = 0
            if a0.dtype.is_floating_point:
                for _, a, b in differing:
                    size = a.dtype.itemsize
                    for x_raw, y_raw in zip(a.data.reshape(-1, size), b.data.reshape(-1, size)):
                        (x,), (y,) = values(x_raw, a.dtype), values(y_raw, a.dtype)
                        nonfinite += math.isfinite(x) and not math.isfinite(y)
            # The other producer slice (replica 0) whose cells at the position's tokens
            # this consumer slice holds, byte for byte (zeros held are no other slice's).
            holds = None
            cells_held = [consumer[request_id, name, head, t, replica] for t in sorted(tokens)]
            if replica == 0 and any(cell.data.any() for _, _, cell in differing):
                producer_slices = sorted(
                    {(n, h) for r, n, h, t, k in producer if r == request_id and k == 0}
                )
                for other in producer_slices:
                    if other == (name, head):
                        continue
                    theirs = [producer.get((request_id, *other, t, 0)) for t in sorted(tokens)]
                    span = {
                        t
                        for r, n, h, t, k in producer
                        if (r, n, h, k) == (request_id, *other, 0) and lo <= t < hi
                    }
                    if span == set(tokens) and all(
                        cell is not None and np.array_equal(cell.data, mine.data)
                        for cell, mine in zip(theirs, cells_held)
                    ):
                        holds = other
                        break
            entry = LocatedDifference(
                position=position,
                layer=name,
                head=head,
                kv_exchanged=kv_swapped(name, differing),
                element=one_element(name, differing),
                tokens=[t for t, _, _ in differing],
                first_byte=int(np.flatnonzero(a0.data != b0.data)[0]),
                max_abs_error=max(e[0] for e in errors),
                max_rel_error=max(e[1] for e in errors),
                scaled_error=scaled,
                replica=replica,
                consumer_worker=b0.worker,
                file=b0.file,
                differing_bytes=sum(1 for value in xor if value),
                differing_bits=sum(bin(value).count("1") for value in xor),
                consumer_zeros=all(not b.data.any() for _, _, b in differing),
                nonfinite=nonfinite,
                holds=holds,
            )
            found.append(entry)
        found.sort(key=lambda e: (e.replica, ref.layer_number(e.layer), e.layer, e.head))
        entries.extend(found)
    return entries


def group_of(name: str) -> kb.GroupModel:
    return next(g for g in MODEL.groups if any(layer.name == name for layer in g.layers))


def all_positions(group_id: int, num_tokens: int) -> list[int]:
    return list(range(-(-num_tokens // COMPARED[group_id]) + 1))


# Fixtures.


@dataclass
class Sets:
    """The clean producer and consumer dumps, their decoded cells and the model's KV."""

    requests: dict[str, kb.RequestKV]
    producer: DumpedSet
    consumer: DumpedSet
    producer_cells: dict
    consumer_cells: dict


def build_sets(folder: Path) -> Sets:
    requests = make_requests()
    producer = dump_engine(requests, PRODUCER, "producer", folder / "producer")
    consumer = dump_engine(requests, CONSUMER, "consumer", folder / "consumer")
    return Sets(requests, producer, consumer, decode_set(producer), decode_set(consumer))


def with_file(dumped: DumpedSet, index: int, path: Path) -> list[str]:
    """The set's paths with worker ``index``'s file replaced."""
    paths = list(dumped.paths)
    paths[index] = str(path)
    return paths
