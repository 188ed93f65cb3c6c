"""Locating differences between a producer's and a consumer's dumps.

A model's KV (``kvbuild``) is dumped by a TP=2, PP=2 producer and a TP=4 consumer with
other block sizes, kernel blocks and layouts; three groups: attention (bf16 and fp32),
MLA (fp8 e4m3 and e5m2, held whole by every rank) and TP-split Mamba states. The tests'
expectations come from decoding the dump files independently (safetensors, the tests'
own layout inverse and the spec's rules), never from kvaudit's views.

The builders and the decoder here are shared with ``test_corrupt.py``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import kvbuild as kb
import numpy as np
import pytest
import reference as ref
import torch
from safetensors import safe_open

from kvaudit.checksummer import RequestBlocks
from kvaudit.compare import LocatedDifference
from kvaudit.corrupt import PlantedFault, corrupt_dump
from kvaudit.description import parse_description
from kvaudit.dumps import open_dump, open_dump_set, write_dump
from kvaudit.locate import CellSegment, element_errors, locate_differences, slice_checksums
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
            result[rid, name, head, token, cell.replica] = cell
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
            entry = LocatedDifference(
                position=position,
                layer=name,
                head=head,
                tokens=[t for t, _, _ in differing],
                first_byte=int(np.flatnonzero(a0.data != b0.data)[0]),
                max_abs_error=max(e[0] for e in errors),
                max_rel_error=max(e[1] for e in errors),
                replica=replica,
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


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Sets:
    return build_sets(tmp_path_factory.mktemp("locate"))


def with_file(dumped: DumpedSet, index: int, path: Path) -> list[str]:
    """The set's paths with worker ``index``'s file replaced."""
    paths = list(dumped.paths)
    paths[index] = str(path)
    return paths


def locate(producer_paths: list[str], consumer_paths: list[str], rid: str, gid: int, positions):
    return locate_differences(
        open_dump_set(producer_paths),
        open_dump_set(consumer_paths),
        rid,
        gid,
        positions,
        COMPARED[gid],
        TOKENS[rid],
    )


def flip(sets: Sets, worker: int, key: CellKey, target: Path) -> tuple[list[str], PlantedFault]:
    """The consumer set with one bit of one cell flipped in worker ``worker``'s dump, and
    what ``corrupt_dump`` says it changed; checked against the decoded files: exactly
    that bit of that cell differs."""
    rid, name, head, token = key
    group = group_of(name)
    block_size = CONSUMER.block_size(group)
    source = sets.consumer.paths[worker]
    result = corrupt_dump(
        source,
        target,
        request_id=rid,
        group_id=group.id,
        position=token // block_size,
        layer=name,
        head=head,
        token=token,
        mode="flip",
        seed=7,
    )
    before = decode(sets.consumer.workers[worker], source)
    after = decode(sets.consumer.workers[worker], str(target))
    changed = [k for k in before if not np.array_equal(before[k].data, after[k].data)]
    assert changed == [key]
    diff = before[key].data ^ after[key].data
    byte = result.flip.byte
    assert np.flatnonzero(diff).tolist() == [byte]
    assert diff[byte] == 1 << result.flip.bit
    return with_file(sets.consumer, worker, target), result


# Tests.


def test_clean_pair_locates_nothing(sets: Sets) -> None:
    for rid, num_tokens in TOKENS.items():
        for gid in COMPARED:
            positions = all_positions(gid, num_tokens)
            assert locate(sets.producer.paths, sets.consumer.paths, rid, gid, positions) == []
    # The decoded cells agree too: the two engines hold the same KV.
    for (rid, name, head, token, _), cell in sets.consumer_cells.items():
        if token < TOKENS[rid]:
            produced = sets.producer_cells[rid, name, head, token, 0]
            assert np.array_equal(produced.data, cell.data)


def test_fault_in_third_finer_block_of_a_coarse_position(sets: Sets, tmp_path: Path) -> None:
    # Consumer blocks of 4 tokens, compared in blocks of 16: position 1 spans consumer
    # positions 4..7; the fault sits in position 6 (tokens 24..27), head 2 of L1 (fp32).
    worker = 2  # TP rank 2 holds global head 2 of the 4-head layers
    key = ("req-a", L1, 2, 26)
    consumer_paths, planted = flip(sets, worker, key, tmp_path / "consumer-tp2.safetensors")
    found = locate(sets.producer.paths, consumer_paths, "req-a", 0, [0, 1, 2])

    cells = decode_set(sets.consumer, consumer_paths)
    expected = expected_located(
        sets.producer_cells, cells, "req-a", 0, [0, 1, 2], COMPARED[0], TOKENS["req-a"]
    )
    assert found == expected
    assert [(e.position, e.layer, e.head, e.tokens) for e in found] == [(1, L1, 2, [26])]
    # The error of the one fp32 element that holds the flipped bit, from the model's KV.
    byte = planted.flip.byte
    assert found[0].first_byte == byte
    a = sets.requests["req-a"].data[L1][26, 2].copy()
    b = a.copy()
    b[byte] ^= 1 << planted.flip.bit
    element = slice(byte // 4 * 4, byte // 4 * 4 + 4)
    assert (found[0].max_abs_error, found[0].max_rel_error) == expected_errors(
        a[element], b[element], torch.float32
    )


def test_replica_difference_is_named(sets: Sets, tmp_path: Path) -> None:
    # MLA is held whole by every consumer rank: rank 3 is replica 3 of the latent.
    worker = 3
    key = ("req-b", L2, 0, 11)
    consumer_paths, _ = flip(sets, worker, key, tmp_path / "consumer-tp3.safetensors")
    positions = all_positions(1, TOKENS["req-b"])
    found = locate(sets.producer.paths, consumer_paths, "req-b", 1, positions)
    assert [(e.position, e.layer, e.head, e.tokens, e.replica) for e in found] == [
        (1, L2, 0, [11], 3)
    ]
    cells = decode_set(sets.consumer, consumer_paths)
    assert found == expected_located(
        sets.producer_cells, cells, "req-b", 1, positions, 8, TOKENS["req-b"]
    )


def test_slice_checksums_follow_the_definition(sets: Sets) -> None:
    # Every worker's slices of every block, against the definition over the model's KV.
    for dumped, engine in ((sets.producer, PRODUCER), (sets.consumer, CONSUMER)):
        for worker, path in zip(dumped.workers, dumped.paths, strict=True):
            dump = open_dump(path)
            for rid, (num_tokens, groups) in worker.requests.items():
                for gid, (start, block_ids) in groups.items():
                    block_size = engine.block_size(MODEL.group(gid))
                    for position in range(start, start + len(block_ids)):
                        got = slice_checksums(dump, rid, gid, position)
                        want = reference_slices(
                            sets.requests[rid], gid, position, block_size, num_tokens
                        )
                        assert got == {key: want[key] for key in got}, (path, rid, gid, position)
                        assert got


def reference_slices(
    request: kb.RequestKV, group_id: int, position: int, block_size: int, num_tokens: int
) -> dict[tuple[str, int], int]:
    """``s(L, h, b)`` of every global (layer, head) of a group, by the definition's loops
    over the tests' reference slices (global form)."""
    group = kb.reference_group(MODEL, group_id, request, tp_size=1, block_size=block_size)
    names = [layer.name for layer in MODEL.group(group_id).layers]
    valid = ref.valid_tokens(num_tokens, block_size, position)
    first = position * block_size
    result = {}
    for part in ref.group_slices(group):
        name = next(n for n in names if ref.layer_number(n) == part.number)
        tokens = [first] if part.per_block and valid else list(range(first, first + valid))
        count = part.pieces.shape[2]
        for h in range(part.pieces.shape[1]):
            total = 0
            for t in tokens:
                item = position if part.per_block else t
                for p in range(count):
                    total += int(part.pieces[item, h, p]) * (2 * (t * count + p) + 1)
            result[name, part.first_head + h] = total % 2**64
    return result


def test_element_errors() -> None:
    def cells(values: list, dtype: torch.dtype) -> np.ndarray:
        return torch.tensor(values, dtype=dtype).view(torch.uint8).numpy()[None]

    def bf16_bits(words: list[int]) -> np.ndarray:
        return np.array(words, dtype="<u2").view(np.uint8)[None]

    nan, inf = math.nan, math.inf
    segment = [_segment(torch.bfloat16, 4)]
    # A NaN on one side only is an infinite error; on both sides (other payloads), none.
    a = cells([1.0, nan, nan, 2.0], torch.bfloat16)
    b = cells([1.0, 3.0, nan, 2.0], torch.bfloat16)
    assert element_errors(a, b, segment) == (inf, inf)
    a = bf16_bits([0x3F80, 0x7FC0, 0x7FC1, 0x4000])
    b = bf16_bits([0x3F80, 0x7FC1, 0xFFC0, 0x4000])
    assert element_errors(a, b, segment) == (0.0, 0.0)
    # -0 and +0 differ in bytes, not in value; a zero reference makes the relative error
    # infinite.
    a = cells([-0.0, 0.0, 4.0, 2.0], torch.bfloat16)
    b = cells([0.0, 0.5, 5.0, 2.0], torch.bfloat16)
    assert element_errors(a, b, segment) == (1.0, inf)
    a = cells([-0.0, 8.0, 4.0, 2.0], torch.bfloat16)
    assert element_errors(a, b, segment) == (7.5, 7.5 / 8.0)
    # fp8 e4m3: 448 is its largest value; e5m2 has infinities.
    a = cells([448.0, 1.0], torch.float8_e4m3fn)
    b = cells([-448.0, 1.0], torch.float8_e4m3fn)
    assert element_errors(a, b, [_segment(torch.float8_e4m3fn, 2)]) == (896.0, 2.0)
    a = cells([inf, 1.0], torch.float8_e5m2)
    b = cells([1.0, 1.0], torch.float8_e5m2)
    assert element_errors(a, b, [_segment(torch.float8_e5m2, 2)]) == (inf, inf)
    # Integers as integers (int64 beyond float precision still differs by 1).
    a = cells([-128, 5], torch.int8)
    b = cells([127, 5], torch.int8)
    assert element_errors(a, b, [_segment(torch.int8, 2)]) == (255.0, 255.0 / 128.0)
    a = cells([2**62 + 1], torch.int64)
    b = cells([2**62], torch.int64)
    assert element_errors(a, b, [_segment(torch.int64, 1)]) == (1.0, 1.0 / float(2**62 + 1))
    # Equal cells: no error.
    assert element_errors(a, a, [_segment(torch.int64, 1)]) == (0.0, 0.0)


def _segment(dtype: torch.dtype, count: int) -> CellSegment:
    return CellSegment(0, count * dtype.itemsize, dtype)


def test_several_faults_in_one_slice(sets: Sets, tmp_path: Path) -> None:
    # Two flipped bits in one slice, at tokens 35 and 33 of head 1 of L0 (consumer rank 1):
    # one entry listing both tokens; the first byte is token 33's.
    source = sets.consumer.paths[1]
    first = tmp_path / "one.safetensors"
    second = tmp_path / "two.safetensors"
    common = {"request_id": "req-a", "group_id": 0, "layer": L0, "head": 1, "mode": "flip"}
    planted = [
        corrupt_dump(source, first, position=8, token=35, seed=1, **common),
        corrupt_dump(first, second, position=8, token=33, seed=2, **common),
    ]
    assert planted[0].flip.byte != planted[1].flip.byte
    consumer_paths = with_file(sets.consumer, 1, second)
    found = locate(sets.producer.paths, consumer_paths, "req-a", 0, [2])
    assert [(e.layer, e.head, e.tokens) for e in found] == [(L0, 1, [33, 35])]
    assert found[0].first_byte == planted[1].flip.byte
    cells = decode_set(sets.consumer, consumer_paths)
    assert found == expected_located(sets.producer_cells, cells, "req-a", 0, [2], 16, 45)
