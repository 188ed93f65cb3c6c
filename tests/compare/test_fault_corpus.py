"""The fault corpus: transfers that went wrong the way they go wrong in deployments, and
clean transfers between engines that share nothing but the KV.

Every case builds a producer and a consumer engine from one model's KV (``kvbuild``), the
consumer possibly having decoded further, then injects the fault into the consumer's
live tensors (or block tables) the way it happens. Half the cases go through dumps and the
real command (``kvaudit diff --format json``), the others through live ``Checksummer``s
(``kvaudit.testing.diff_kv``), which locate without writing dumps.

What each case must report is computed independently of kvaudit: every consumer cell of
every listed block is read back with the tests' own layout inverse (``kb.gather_cells``,
raw state pages) and compared with the model's KV (replica 0) or with the consumer's own
replica 0 (other replicas), over the tokens both sides hold; the cells that differ give
the expected mismatched positions, replica differences and located entries (position,
layer, global head, tokens, first differing byte). Each fault also says which cells it
meant to change, and that must be what the comparison finds. The last test asserts 100%
detection and no false positive over the whole corpus.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import kvbuild as kb
from helpers import reference as ref
from safetensors import safe_open

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.cli import main
from kvaudit.description import parse_description
from kvaudit.formats import diff_to_json
from kvaudit.testing import LiveSide, diff_kv

ATTN = "model.layers.{}.self_attn.attn"
INDEXER = "model.layers.{}.self_attn.indexer.k_cache"
MIXER = "model.layers.{}.mixer"

Cell = tuple[str, str, int, int, int]
"""``(request, layer, global head, request position, replica index)``."""


# Models.


def gqa(heads: int = 4, layers: int = 4, kv_heads: int | None = None) -> kb.Model:
    """Attention layers ``0 .. layers-1`` of ``heads`` KV heads, bf16, head size 8."""
    group = kb.GroupModel(
        0, tuple(kb.Attn(ATTN.format(i), heads, 8) for i in range(layers)), block_size=16
    )
    return kb.Model((group,), model_kv_heads=kv_heads or heads)


def mixed() -> kb.Model:
    """GQA (bf16 and fp32), MLA (fp8) and TP-split Mamba states, in three groups."""
    return kb.Model(
        (
            kb.GroupModel(
                0,
                (kb.Attn(ATTN.format(0), 4, 8), kb.Attn(ATTN.format(1), 4, 4, dtype="float32")),
                16,
            ),
            kb.GroupModel(
                1,
                (
                    kb.Attn(ATTN.format(2), 1, 16, type="mla", dtype="float8_e4m3fn"),
                    kb.Attn(ATTN.format(3), 1, 16, type="mla", dtype="float8_e4m3fn"),
                ),
                16,
                layout="NTC",
            ),
            kb.GroupModel(
                2,
                (
                    kb.Mamba(
                        MIXER.format(4),
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


def with_indexer() -> kb.Model:
    """DeepSeek-style MLA layers, each with an indexer cache in the same layer module."""
    layers = []
    for i in range(2):
        layers.append(kb.Attn(ATTN.format(i), 1, 32, type="mla", dtype="float8_e4m3fn"))
        layers.append(kb.Attn(INDEXER.format(i), 1, 16, type="mla", dtype="uint8"))
    return kb.Model((kb.GroupModel(0, tuple(layers), 16, layout="NTC"),))


def with_sliding_window() -> kb.Model:
    """Full attention in group 0, sliding-window attention in group 1."""
    full = tuple(kb.Attn(ATTN.format(i), 4, 8) for i in (0, 2))
    window = tuple(
        kb.Attn(ATTN.format(i), 4, 8, type="sliding_window", sliding_window=32) for i in (1, 3)
    )
    return kb.Model((kb.GroupModel(0, full, 16), kb.GroupModel(1, window, 16)), model_kv_heads=4)


def with_mamba() -> kb.Model:
    """Attention in group 0, unsplit Mamba states (one state set per rank) in group 1."""
    attention = tuple(kb.Attn(ATTN.format(i), 4, 8) for i in (0, 2))
    mamba = tuple(
        kb.Mamba(MIXER.format(i), shapes=((3, 8), (2, 4)), dtypes=("float16", "float32"))
        for i in (1, 3)
    )
    return kb.Model(
        (kb.GroupModel(0, attention, 16), kb.GroupModel(1, mamba, 16)), model_kv_heads=4
    )


# Building the two engines.


@dataclass
class Built:
    """The model, both engines' workers, the model's KV as each engine holds it, and the
    consumer's fault."""

    model: kb.Model
    producer: kb.Engine
    consumer: kb.Engine
    producer_kv: dict[str, kb.RequestKV]
    consumer_kv: dict[str, kb.RequestKV]
    producer_workers: list[kb.Worker]
    consumer_workers: list[kb.Worker]
    planted: set[Cell] = field(default_factory=set)

    def shared(self, rid: str) -> int:
        return min(self.producer_kv[rid].num_tokens, self.consumer_kv[rid].num_tokens)


Fault = Callable[[Built], set[Cell]]
"""Changes the consumer's workers in place; returns the cells it meant to report."""


@dataclass(frozen=True)
class Case:
    """One producer/consumer pair, clean or with one fault."""

    name: str
    model: Callable[[], kb.Model]
    producer: kb.Engine
    consumer: kb.Engine
    tokens: dict[str, int]
    decoded: dict[str, int] = field(default_factory=dict)
    positions: dict[str, dict[int, tuple[int, int]]] | None = None
    fault: Fault | None = None
    via: str = "live"  # "live": Checksummers in memory; "dumps": dump files and the CLI


def truncated(model: kb.Model, request: kb.RequestKV, num_tokens: int) -> kb.RequestKV:
    """The request's first ``num_tokens`` tokens (state layers: the positions they reach)."""
    data: dict[str, np.ndarray | tuple[np.ndarray, ...]] = {}
    for group in model.groups:
        positions = kb.positions_of(num_tokens, group.block_size)
        for layer in group.layers:
            value = request.data.get(layer.name)
            if value is None:
                continue
            if isinstance(layer, kb.Attn):
                data[layer.name] = value[:num_tokens]
            elif isinstance(value, tuple):
                data[layer.name] = tuple(state[:positions] for state in value)
            else:
                data[layer.name] = value[:positions]
    return kb.RequestKV(num_tokens, data)


def build(case: Case) -> Built:
    model = case.model()
    tp = case.consumer.tp_size
    consumer_kv = {
        rid: kb.make_request(model, n + case.decoded.get(rid, 0), seed=i + 1, tp_size=tp)
        for i, (rid, n) in enumerate(case.tokens.items())
    }
    producer_kv = {rid: truncated(model, consumer_kv[rid], n) for rid, n in case.tokens.items()}
    built = Built(
        model,
        case.producer,
        case.consumer,
        producer_kv,
        consumer_kv,
        kb.build_engine(model, producer_kv, case.producer, case.positions),
        kb.build_engine(model, consumer_kv, case.consumer, case.positions),
    )
    if case.fault is not None:
        built.planted = case.fault(built)
    return built


# Reading cells back, independently of kvaudit.


def head_offset(model: kb.Model, name: str) -> int:
    """The global head of a cache's first head: caches of one layer module take
    consecutive heads in layer-name order."""
    module = ref.layer_module(name)
    return sum(
        layer.heads
        for group in model.groups
        for layer in group.layers
        if isinstance(layer, kb.Attn)
        and layer.shares is None
        and ref.layer_module(layer.name) == module
        and layer.name < name
    )


def replica_of(layer: kb.LayerModel, worker: kb.Worker) -> int:
    if isinstance(layer, kb.Attn):
        return worker.tp_rank % kb.replicas(layer, worker.tp_size)
    return worker.tp_rank if layer.tp_replicated else 0


def replica_class(built: Built, name: str, head: int) -> int:
    """``R``: how many consumer ranks hold this global head (or state row) of a layer."""
    tp_size = built.consumer_workers[0].tp_size
    layer = next(lay for lay in group_of(built.model, name).layers if lay.name == name)
    if isinstance(layer, kb.Attn):
        return kb.replicas(layer, tp_size)
    if not layer.splits:
        return tp_size if layer.tp_replicated else 1
    first = 0
    for _, segments in layer.splits:
        for global_rows, max_shards in segments:
            if first <= head < first + global_rows:
                return kb.segment_replicas(max_shards, tp_size)
            first += global_rows
    raise AssertionError(f"{name} has no row {head}")


def worker_cells(built: Built, worker: kb.Worker) -> dict[Cell, np.ndarray]:
    """Every cell of every listed block of a consumer worker, below the shared tokens."""
    model = built.model
    cells: dict[Cell, np.ndarray] = {}
    for group in worker.description["groups"]:
        gid = group["id"]
        for entry in group["layers"]:
            name = entry if isinstance(entry, str) else entry["name"]
            layer = model.layer(name)
            spec = kb._worker_spec(worker, name)
            block_size = spec["block_size"]
            for rid, (_, tables) in worker.requests.items():
                if gid not in tables:
                    continue
                start, block_ids = tables[gid]
                shared = built.shared(rid)
                if isinstance(layer, kb.Attn):
                    paged = kb.gather_cells(
                        worker.tensors[name], spec["layout"], block_size, block_ids
                    )
                    first = (
                        head_offset(model, name)
                        + kb._head_range(layer, worker.tp_rank, worker.tp_size).start
                    )
                    for row in range(paged.shape[0]):
                        token = start * block_size + row
                        if token >= shared:
                            continue
                        for h in range(paged.shape[1]):
                            key = (rid, name, first + h, token, replica_of(layer, worker))
                            cells[key] = paged[row, h]
                else:
                    tensor = worker.tensors[name]
                    pages = tensor.reshape(tensor.shape[0], -1).contiguous()
                    pages = pages.view(torch.uint8).numpy()
                    for i, block_id in enumerate(block_ids):
                        token = (start + i) * block_size
                        if token >= shared:
                            continue
                        for (head, replica), data in state_cells(
                            layer, pages[block_id], worker
                        ).items():
                            cells[rid, name, head, token, replica] = data
    return cells


def state_cells(
    layer: kb.Mamba, page: np.ndarray, worker: kb.Worker
) -> dict[tuple[int, int], np.ndarray]:
    """A state page's cells by (global head, replica): unsplit, the checksummed states
    as one cell of head ``tp_rank`` (head 0 when TP-replicated); split, each global row."""
    tp_rank, tp_size = worker.tp_rank, worker.tp_size
    if layer.splits is None:
        covered = sum(
            math.prod(shape) * kb.dtype_size(dtype)
            for shape, dtype in zip(layer.shapes[: layer.covered], layer.dtypes, strict=False)
        )
        head = 0 if layer.tp_replicated else tp_rank
        return {(head, replica_of(layer, worker)): page[:covered]}
    result = {}
    offset = 0
    global_first = 0
    shapes = kb.local_state_shapes(layer, tp_size)
    for shape, dtype, (axis, segments) in zip(shapes, layer.dtypes, layer.splits, strict=True):
        nbytes = math.prod(shape) * kb.dtype_size(dtype)
        state = page[offset : offset + nbytes].reshape(*shape, kb.dtype_size(dtype))
        offset += nbytes
        rows = np.moveaxis(state, axis, 0).reshape(shape[axis], -1)
        local_first = 0
        for global_rows, max_shards in segments:
            replicas = kb.segment_replicas(max_shards, tp_size)
            local = global_rows * replicas // tp_size
            first = global_first + (tp_rank // replicas) * local
            for r in range(local):
                result[first + r, tp_rank % replicas] = rows[local_first + r]
            local_first += local
            global_first += global_rows
    return result


def model_state_cell(layer: kb.Mamba, value: object, position: int, head: int) -> np.ndarray:
    """The model's state cell of one global head at one block position."""
    if layer.splits is None:
        assert isinstance(value, np.ndarray)
        covered = sum(
            math.prod(shape) * kb.dtype_size(dtype)
            for shape, dtype in zip(layer.shapes[: layer.covered], layer.dtypes, strict=False)
        )
        return value[position, head, :covered]
    assert isinstance(value, tuple)
    rows = []
    for state, (axis, _) in zip(value, layer.splits, strict=True):
        raw = np.ascontiguousarray(state[position]).view(np.uint8)
        size = state.dtype.itemsize
        raw = raw.reshape(*state.shape[1:], size)
        rows.extend(np.moveaxis(raw, axis, 0).reshape(state.shape[1 + axis], -1))
    return rows[head]


def model_cell(built: Built, rid: str, name: str, head: int, token: int) -> np.ndarray:
    """What the producer holds: the model's KV of one cell."""
    layer = built.model.layer(name)
    data = built.producer_kv[rid].data[name]
    if isinstance(layer, kb.Attn):
        return data[token, head - head_offset(built.model, name)]
    block_size = group_of(built.model, name).block_size
    return model_state_cell(layer, data, token // block_size, head)


def group_of(model: kb.Model, name: str) -> kb.GroupModel:
    return next(g for g in model.groups if any(layer.name == name for layer in g.layers))


@dataclass
class Expected:
    """What the report must say of one request's group."""

    mismatched: set[int] = field(default_factory=set)
    replicas: set[tuple[int, int]] = field(default_factory=set)  # replica keys (R, r)
    located: list[dict] = field(default_factory=list)


def differing_cells(built: Built) -> dict[Cell, int]:
    """Each consumer cell that differs from its reference, with its first differing
    byte: replica 0 against the model's KV, replica r against the consumer's replica 0."""
    cells: dict[Cell, np.ndarray] = {}
    for worker in built.consumer_workers:
        cells.update(worker_cells(built, worker))
    found = {}
    for key, data in cells.items():
        rid, name, head, token, replica = key
        if replica == 0:
            reference = model_cell(built, rid, name, head, token)
        else:
            reference = cells[rid, name, head, token, 0]
        differ = np.flatnonzero(reference != data)
        if len(differ):
            found[key] = int(differ[0])
    return found


def coarse_block(built: Built, gid: int) -> int:
    group = built.model.group(gid)
    return max(built.producer.block_size(group), built.consumer.block_size(group))


def expected_report(built: Built) -> dict[tuple[str, int], Expected]:
    """Per (request, group), the expected differences from the cells that differ."""
    slices: dict[tuple[str, int, int, int, str, int], list[tuple[int, int]]] = defaultdict(list)
    for (rid, name, head, token, replica), byte in differing_cells(built).items():
        gid = group_of(built.model, name).id
        position = token // coarse_block(built, gid)
        slices[rid, gid, position, replica, name, head].append((token, byte))
    result: dict[tuple[str, int], Expected] = defaultdict(Expected)
    order = sorted(
        slices, key=lambda k: (k[0], k[1], k[2], k[3], ref.layer_number(k[4]), k[4], k[5])
    )
    for rid, gid, position, replica, name, head in order:
        tokens = sorted(slices[rid, gid, position, replica, name, head])
        entry = {
            "position": position,
            "layer": name,
            "head": head,
            "tokens": [t for t, _ in tokens],
            "first_byte": tokens[0][1],
        }
        expected = result[rid, gid]
        if replica:
            entry["replica"] = replica
            expected.replicas.add((replica_class(built, name, head), replica))
        else:
            expected.mismatched.add(position)
        expected.located.append(entry)
    return dict(result)


def expected_compared(built: Built, rid: str, gid: int) -> int:
    """Coarse positions both engines hold whole, below the shared tokens."""
    group = built.model.group(gid)
    coarse = coarse_block(built, gid)
    shared = built.shared(rid)
    formed = []
    for workers, engine in (
        (built.producer_workers, built.producer),
        (built.consumer_workers, built.consumer),
    ):
        size = engine.block_size(group)
        held = set()
        for worker in workers:
            tables = worker.requests[rid][1]
            if gid in tables:
                start, ids = tables[gid]
                held.update(range(start, start + len(ids)))
        ratio = coarse // size
        spanned = {q // ratio for q in held}
        formed.append(
            {
                p
                for p in spanned
                if all(q in held or q * size >= shared for q in range(p * ratio, p * ratio + ratio))
            }
        )
    return len({p for p in formed[0] & formed[1] if p * coarse < shared})


# Running a case.


def live_side(workers: list[kb.Worker], role: str) -> LiveSide:
    summers = [
        Checksummer(
            parse_description(w.description, f"{role} tp{w.tp_rank} pp{w.pp_rank}"),
            w.tensors,
            tp_rank=w.tp_rank,
            tp_size=w.tp_size,
            pp_rank=w.pp_rank,
            pp_size=w.pp_size,
            role=role,
            backend="torch",
        )
        for w in workers
    ]
    requests = [
        {rid: RequestBlocks(n, dict(tables)) for rid, (n, tables) in w.requests.items()}
        for w in workers
    ]
    return LiveSide(summers, requests, [w.tensors for w in workers], name=role)


@dataclass
class Outcome:
    """A case's report (JSON form, errors as given) and, for dumps, the exit status."""

    built: Built
    report: dict
    status: int | None = None


def run_case(case: Case, folder: Path) -> Outcome:
    built = build(case)
    if case.via == "live":
        report = diff_kv(
            live_side(built.producer_workers, "producer"),
            live_side(built.consumer_workers, "consumer"),
        )
        return Outcome(built, diff_to_json(report))
    producer = kb.write_workers(built.producer_workers, folder / "producer", "producer", "corpus")
    consumer = kb.write_workers(built.consumer_workers, folder / "consumer", "consumer", "corpus")
    result = CliRunner().invoke(
        main, ["diff", str(producer), str(consumer), "--format", "json", "--device", "cpu"]
    )
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.stdout, parse_constant=_no_constants)
    return Outcome(built, report, result.exit_code)


def _no_constants(name: str) -> float:
    raise AssertionError(f"the JSON holds {name}: not strict JSON")


_OUTCOMES: dict[str, Outcome] = {}


def outcome(case: Case, factory: pytest.TempPathFactory) -> Outcome:
    """Each case run once (the corpus totals reuse the per-case runs)."""
    if case.name not in _OUTCOMES:
        _OUTCOMES[case.name] = run_case(case, factory.mktemp(case.name))
    return _OUTCOMES[case.name]


# Faults, each injected the way it happens.


def consumer_table(built: Built, rid: str, gid: int) -> tuple[int, list[int]]:
    """A request's block table in the consumer (every worker shares it)."""
    return built.consumer_workers[0].requests[rid][1][gid]


def cell_of(worker: kb.Worker, name: str, block_id: int, slot: int, head: int) -> np.ndarray:
    """A copy of one cell of a live tensor (K row then V row)."""
    rows = kb.slot_rows(worker, name, block_id, slot, head)
    return np.concatenate([row.numpy().copy() for row in rows])


def write_cell(
    worker: kb.Worker, name: str, block_id: int, slot: int, head: int, data: np.ndarray
) -> None:
    """Overwrite one cell of a live tensor in place."""
    offset = 0
    for row in kb.slot_rows(worker, name, block_id, slot, head):
        count = row.numel()
        row.copy_(torch.from_numpy(np.ascontiguousarray(data[offset : offset + count])))
        offset += count


def attention_layers(worker: kb.Worker, model: kb.Model, gid: int) -> list[kb.Attn]:
    """The worker's attention layers of one group (those its PP stage holds)."""
    names = [
        entry if isinstance(entry, str) else entry["name"]
        for group in worker.description["groups"]
        if group["id"] == gid
        for entry in group["layers"]
    ]
    return [model.layer(name) for name in names if isinstance(model.layer(name), kb.Attn)]


def heads_of(built: Built, worker: kb.Worker, layer: kb.Attn) -> range:
    """The global heads a worker holds of a layer."""
    held = kb._head_range(layer, worker.tp_rank, worker.tp_size)
    offset = head_offset(built.model, layer.name)
    return range(offset + held.start, offset + held.stop)


def slot_reused_in_flight(built: Built) -> set[Cell]:
    """(a) req-a's block holding token 16 was freed and handed to req-b while req-a's
    write was in flight: its first 6 slots hold req-b's KV of the same slots, on every
    rank."""
    start, ids = consumer_table(built, "req-a", 0)
    size = built.consumer.block_size(built.model.group(0))
    position = 16 // size
    block_id = ids[position - start]
    first = position * size
    planted = set()
    for worker in built.consumer_workers:
        for layer in attention_layers(worker, built.model, 0):
            other = built.consumer_kv["req-b"].data[layer.name]
            for slot in range(6):
                for h, head in enumerate(heads_of(built, worker, layer)):
                    token_b = first + slot
                    write_cell(worker, layer.name, block_id, slot, h, other[token_b, head])
                    if replica_of(layer, worker) == 0:
                        planted.add(("req-a", layer.name, head, first + slot, 0))
    return planted


def stale_sender_after_abort(built: Built) -> set[Cell]:
    """(b) an aborted request's sender on one rank kept going: its KV for positions
    32..47 lands in the new request's block after the new request's own KV."""
    old = kb.make_request(built.model, 64, seed=99)
    start, ids = consumer_table(built, "req-a", 0)
    size = built.consumer.block_size(built.model.group(0))
    worker = built.consumer_workers[3]
    planted = set()
    for layer in attention_layers(worker, built.model, 0):
        for token in range(32, 48):
            position, slot = divmod(token, size)
            for h, head in enumerate(heads_of(built, worker, layer)):
                block_id = ids[position - start]
                write_cell(worker, layer.name, block_id, slot, h, old.data[layer.name][token, head])
                if token < built.shared("req-a"):
                    planted.add(("req-a", layer.name, head, token, 0))
    return planted


def block_tail(
    built: Built, rid: str, rank: int, tail: Callable[[int], np.ndarray], tail_bytes: int
) -> set[Cell]:
    """The last ``tail_bytes`` of the request's last block on one rank, in each layer's
    memory, replaced by ``tail(count)``; the planted cells from the layout."""
    start, ids = consumer_table(built, rid, 0)
    worker = built.consumer_workers[rank]
    size = built.consumer.block_size(built.model.group(0))
    position = start + len(ids) - 1
    planted = set()
    for layer in attention_layers(worker, built.model, 0):
        tensor = worker.tensors[layer.name]
        assert isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
        region = tensor[ids[-1]].view(torch.uint8).reshape(-1)
        region[-tail_bytes:] = torch.from_numpy(tail(tail_bytes))
        # Which cells the tail covers, from the layout's memory order.
        layout = kb._worker_spec(worker, layer.name)["layout"]
        heads = list(heads_of(built, worker, layer))
        cell = layer.cell_bytes
        order = [letter for letter in layout if letter in "TH"]
        for index in range(region.numel() - tail_bytes, region.numel()):
            which = index // cell
            if order == ["T", "H"]:
                slot, h = divmod(which, len(heads))
            else:
                h, slot = divmod(which, size)
            token = position * size + slot
            if token < built.shared(rid):
                planted.add((rid, layer.name, heads[h], token, 0))
    return planted


def tail_zero(built: Built) -> set[Cell]:
    """(c) the last bytes of the last block of a transfer to rank 1 not yet visible:
    still zero (freshly allocated memory), head-major layout."""
    return block_tail(built, "req-full", 1, lambda n: np.zeros(n, dtype=np.uint8), 3 * 32 + 5)


def tail_old(built: Built) -> set[Cell]:
    """(c) the same on a token-major layout, the tail holding the slot's old content."""
    rng = np.random.default_rng(5)
    return block_tail(
        built, "req-a", 0, lambda n: rng.integers(0, 256, n, dtype=np.uint8), 10 * 2 * 32
    )


def neighbour_heads(built: Built) -> set[Cell]:
    """(d) producer TP=2 to consumer TP=4: rank 1's slots received rank 2's heads."""
    source, target = built.consumer_workers[2], built.consumer_workers[1]
    planted = set()
    for layer in attention_layers(target, built.model, 0):
        target.tensors[layer.name].copy_(source.tensors[layer.name])
        for rid in target.requests:
            for head in heads_of(built, target, layer):
                for token in range(built.shared(rid)):
                    planted.add((rid, layer.name, head, token, replica_of(layer, target)))
    return planted


def neighbour_heads_replicated(built: Built) -> set[Cell]:
    """(d) 4 KV heads on a TP=8 consumer (each head on two ranks): rank 2 (replica 0 of
    head 1) received rank 4's head 2; its twin rank 3 is right, so it differs too."""
    source, target = built.consumer_workers[4], built.consumer_workers[2]
    planted = set()
    for layer in attention_layers(target, built.model, 0):
        target.tensors[layer.name].copy_(source.tensors[layer.name])
        for rid in target.requests:
            for token in range(built.shared(rid)):
                planted.add((rid, layer.name, 1, token, 0))
                planted.add((rid, layer.name, 1, token, 1))
    return planted


def junk_blocks(built: Built, rid: str, gid: int, names: list[str], seed: int) -> None:
    """The request's blocks of the layers left with junk on every consumer rank."""
    rng = np.random.default_rng(seed)
    _, ids = consumer_table(built, rid, gid)
    size = built.consumer.block_size(built.model.group(gid))
    for worker in built.consumer_workers:
        for name in names:
            if name not in worker.tensors:
                continue
            layer = built.model.layer(name)
            if isinstance(layer, kb.Mamba):
                pages = worker.tensors[name]
                for block_id in ids:
                    junk = rng.integers(0, 256, pages.shape[1:], dtype=np.uint8)
                    pages[block_id] = torch.from_numpy(junk)
                continue
            local = len(heads_of(built, worker, layer))
            for block_id in ids:
                for slot in range(size):
                    for h in range(local):
                        junk = rng.integers(0, 256, layer.cell_bytes, dtype=np.uint8)
                        write_cell(worker, name, block_id, slot, h, junk)


def indexer_not_sent(built: Built) -> set[Cell]:
    """(e) the connector moved the MLA latents but not the indexer caches (a second cache
    in the same layer module): each consumer rank's indexer blocks hold junk."""
    names = [INDEXER.format(i) for i in range(2)]
    junk_blocks(built, "req-a", 0, names, seed=3)
    return {
        ("req-a", name, 1, token, replica)
        for name in names
        for token in range(built.shared("req-a"))
        for replica in range(built.consumer.tp_size)
    }


def window_not_sent(built: Built) -> set[Cell]:
    """(e) the sliding-window group's blocks were not transferred: junk on every rank."""
    names = [ATTN.format(i) for i in (1, 3)]
    junk_blocks(built, "req-a", 1, names, seed=4)
    start, ids = consumer_table(built, "req-a", 1)
    size = built.consumer.block_size(built.model.group(1))
    tokens = range(start * size, min((start + len(ids)) * size, built.shared("req-a")))
    return {("req-a", name, head, t, 0) for name in names for head in range(4) for t in tokens}


def mamba_not_sent(built: Built) -> set[Cell]:
    """(e) the Mamba state group was not transferred: every rank's state pages are junk."""
    names = [MIXER.format(i) for i in (1, 3)]
    junk_blocks(built, "req-a", 1, names, seed=5)
    size = built.consumer.block_size(built.model.group(1))
    positions = kb.positions_of(built.shared("req-a"), size)
    return {
        ("req-a", name, rank, p * size, 0)
        for name in names
        for rank in range(built.consumer.tp_size)
        for p in range(positions)
    }


def tables_swapped(built: Built) -> set[Cell]:
    """(f) KV bound to the wrong request: req-a's and req-b's block tables swapped."""
    for worker in built.consumer_workers:
        a, b = worker.requests["req-a"], worker.requests["req-b"]
        worker.requests["req-a"] = (a[0], b[1])
        worker.requests["req-b"] = (b[0], a[1])
    return {
        (rid, ATTN.format(i), head, token, 0)
        for rid in ("req-a", "req-b")
        for i in range(4)
        for head in range(4)
        for token in range(built.shared(rid))
    }


def bit_flip(rank: int, name: str, head: int, token: int) -> Fault:
    """(g) one bit of one cell flipped on one rank."""

    def fault(built: Built) -> set[Cell]:
        worker = built.consumer_workers[rank]
        layer = built.model.layer(name)
        start, ids = consumer_table(built, "req-a", group_of(built.model, name).id)
        size = built.consumer.block_size(group_of(built.model, name))
        position, slot = divmod(token, size)
        local = head - heads_of(built, worker, layer).start
        data = cell_of(worker, name, ids[position - start], slot, local)
        data[5] ^= 1 << 3
        write_cell(worker, name, ids[position - start], slot, local, data)
        return {("req-a", name, head, token, replica_of(layer, worker))}

    return fault


E = kb.Engine
TWO = {"req-a": 45, "req-b": 64}
SAME = {"req-a": 40, "req-b": 40}

FAULTS = [
    Case(
        "slot-reused-in-flight",
        gqa,
        E(2, seed=1),
        E(2, layouts={0: "NHTC"}, seed=2),
        TWO,
        fault=slot_reused_in_flight,
        via="dumps",
    ),
    Case(
        "slot-reused-in-flight-64",
        gqa,
        E(2, seed=1),
        E(4, block_sizes={0: 64}, kernel_block_sizes={0: 16}, layouts={0: "KNHTD"}, seed=2),
        TWO,
        decoded={"req-a": 9},
        fault=slot_reused_in_flight,
    ),
    Case(
        "stale-sender-after-abort",
        lambda: gqa(8),
        E(2, seed=3),
        E(4, layouts={0: "KNTHD"}, seed=4),
        TWO,
        decoded={"req-a": 30},
        fault=stale_sender_after_abort,
        via="dumps",
    ),
    Case(
        "tail-not-visible-zero",
        gqa,
        E(2, seed=5),
        E(2, layouts={0: "NHTC"}, seed=6),
        {"req-full": 64, "req-b": 20},
        fault=tail_zero,
        via="dumps",
    ),
    Case("tail-not-visible-old", gqa, E(1, seed=5), E(2, seed=6), {"req-a": 57}, fault=tail_old),
    Case(
        "neighbour-heads-tp2-tp4",
        lambda: gqa(8),
        E(2, seed=7),
        E(4, layouts={0: "NHTC"}, seed=8),
        TWO,
        fault=neighbour_heads,
        via="dumps",
    ),
    Case(
        "neighbour-heads-tp8-replicated",
        gqa,
        E(2, seed=7),
        E(8, seed=8),
        TWO,
        fault=neighbour_heads_replicated,
    ),
    Case(
        "indexer-not-sent",
        with_indexer,
        E(1, seed=9),
        E(2, layouts={0: "NTHC"}, seed=10),
        TWO,
        fault=indexer_not_sent,
        via="dumps",
    ),
    Case(
        "sliding-window-not-sent",
        with_sliding_window,
        E(2, seed=11),
        E(2, layouts={0: "NHTC", 1: "KNHTD"}, seed=12),
        {"req-a": 70, "req-b": 33},
        positions={"req-a": {1: (2, 3)}, "req-b": {1: (1, 2)}},
        fault=window_not_sent,
        via="dumps",
    ),
    Case(
        "mamba-state-not-sent",
        with_mamba,
        E(2, seed=13),
        E(2, layouts={0: "NHTC"}, seed=14),
        TWO,
        fault=mamba_not_sent,
    ),
    Case(
        "kv-bound-to-wrong-request",
        gqa,
        E(2, seed=15),
        E(4, layouts={0: "NHTC"}, seed=16),
        SAME,
        fault=tables_swapped,
        via="dumps",
    ),
    Case(
        "one-bit-flip",
        gqa,
        E(2, seed=17),
        E(4, seed=18),
        TWO,
        decoded={"req-a": 3},
        fault=bit_flip(2, ATTN.format(1), 2, 37),
    ),
    Case(
        "one-bit-flip-pp2",
        mixed,
        E(2, seed=19),
        E(2, pp_size=2, block_sizes={0: 64}, kernel_block_sizes={0: 32}, seed=20),
        TWO,
        fault=bit_flip(3, ATTN.format(3), 0, 44),
        via="dumps",
    ),
]

CLEAN = [
    Case(
        "tp1-tp2-decoded",
        gqa,
        E(1, seed=1),
        E(2, layouts={0: "NHTC"}, seed=2),
        TWO,
        decoded={"req-a": 5, "req-b": 16},
    ),
    Case(
        "tp2-tp4-bs16-bs64",
        gqa,
        E(2, seed=3),
        E(4, block_sizes={0: 64}, kernel_block_sizes={0: 16}, layouts={0: "KNHTD"}, seed=4),
        TWO,
    ),
    Case(
        "tp4-tp8-replicated",
        gqa,
        E(4, block_sizes={0: 64}, kernel_block_sizes={0: 32}, layouts={0: "NHTC"}, seed=5),
        E(8, kernel_block_sizes={0: 8}, seed=6),
        TWO,
        decoded={"req-b": 20},
    ),
    Case(
        "tp8-tp1-kv-apart",
        gqa,
        E(8, layouts={0: "KNTHD"}, seed=7),
        E(1, block_sizes={0: 64}, layouts={0: "NTHD"}, seed=8),
        {"req-a": 1, "req-b": 130},
    ),
    Case(
        "pp2-tp2-to-tp4-mixed",
        mixed,
        E(2, pp_size=2, seed=9),
        E(4, layouts={0: "NHTC", 1: "NTHC"}, seed=10),
        TWO,
        decoded={"req-a": 3},
    ),
    Case(
        "tp1-to-pp2-tp2-mixed",
        mixed,
        E(1, seed=11),
        E(2, pp_size=2, block_sizes={0: 64}, layouts={0: "KNHTD"}, seed=12),
        TWO,
    ),
    Case(
        "pp2-tp1-to-pp2-tp4",
        gqa,
        E(1, pp_size=2, seed=13),
        E(4, pp_size=2, block_sizes={0: 64}, seed=14),
        TWO,
    ),
    Case("same-engine-other-blocks", gqa, E(2, seed=15), E(2, seed=16), TWO, decoded={"req-a": 40}),
    Case(
        "sliding-window-partial-lists",
        with_sliding_window,
        E(2, seed=17),
        E(4, layouts={0: "NHTC", 1: "NTHD"}, seed=18),
        {"req-a": 70, "req-b": 33},
        positions={"req-a": {1: (2, 3)}, "req-b": {1: (1, 2)}},
    ),
    Case("mamba-states", with_mamba, E(2, seed=19), E(2, layouts={0: "KNHTD"}, seed=20), TWO),
    Case("indexer", with_indexer, E(1, seed=21), E(4, seed=22), TWO, decoded={"req-b": 11}),
    Case(
        "dumps-tp2-to-pp2-tp4-mixed",
        mixed,
        E(2, seed=23),
        E(4, pp_size=2, block_sizes={0: 64}, kernel_block_sizes={0: 16}, seed=24),
        TWO,
        decoded={"req-a": 7},
        via="dumps",
    ),
    Case(
        "dumps-tp1-to-tp8",
        gqa,
        E(1, layouts={0: "NHTC"}, seed=25),
        E(8, block_sizes={0: 64}, layouts={0: "KNHTD"}, seed=26),
        TWO,
        via="dumps",
    ),
    Case(
        "dumps-pp2-tp4-to-tp2",
        mixed,
        E(4, pp_size=2, seed=27),
        E(2, seed=28),
        TWO,
        decoded={"req-b": 2},
        via="dumps",
    ),
]


# A wider grid: every pair of TP sizes 1, 2, 4, 8 (4 KV heads: TP 8 holds each head on two
# ranks), layouts, block sizes and kernel block sizes taken in turn, the consumer decoding
# further on every other pair; each pair clean, and with one bit flipped in a seeded cell.
LAYOUTS = ("NTHC", "NHTC", "KNHTD", "NTHD", "KNTHD", "NKTHD")
SIZES = ((16, 16), (64, 16), (16, 8), (64, 64), (64, 32))


def grid_engine(tp_size: int, index: int, seed: int) -> kb.Engine:
    block, kernel = SIZES[index % len(SIZES)]
    return kb.Engine(
        tp_size,
        pp_size=2 if index % 3 == 0 else 1,
        block_sizes={0: block},
        kernel_block_sizes={0: kernel},
        layouts={0: LAYOUTS[index % len(LAYOUTS)]},
        seed=seed,
    )


def seeded_flip(seed: int) -> Fault:
    """One bit of a seeded cell (request, layer, head, token, byte) on the rank that holds
    replica 0 of that head."""

    def fault(built: Built) -> set[Cell]:
        rng = np.random.default_rng(seed)
        rid = sorted(built.producer_kv)[int(rng.integers(2))]
        name = ATTN.format(int(rng.integers(4)))
        layer = built.model.layer(name)
        head = int(rng.integers(layer.heads))
        token = int(rng.integers(built.shared(rid)))
        worker = next(
            w
            for w in built.consumer_workers
            if name in w.tensors and head in heads_of(built, w, layer) and replica_of(layer, w) == 0
        )
        start, ids = worker.requests[rid][1][0]
        size = built.consumer.block_size(built.model.group(0))
        position, slot = divmod(token, size)
        local = head - heads_of(built, worker, layer).start
        data = cell_of(worker, name, ids[position - start], slot, local)
        byte = int(rng.integers(layer.cell_bytes))
        data[byte] ^= 1 << int(rng.integers(8))
        write_cell(worker, name, ids[position - start], slot, local, data)
        # Where the consumer holds the head on several ranks, the others now differ from it.
        replicas = kb.replicas(layer, worker.tp_size)
        return {(rid, name, head, token, replica) for replica in range(replicas)}

    return fault


GRID = [(p, c) for p in (1, 2, 4, 8) for c in (1, 2, 4, 8)]
CLEAN += [
    Case(
        f"grid-tp{p}-tp{c}",
        gqa,
        grid_engine(p, i, seed=100 + i),
        grid_engine(c, i + 2, seed=200 + i),
        {"req-a": 37 + 8 * i, "req-b": 100 - 3 * i},
        decoded={"req-a": 11} if i % 2 else {},
        via="dumps" if i % 4 == 0 else "live",
    )
    for i, (p, c) in enumerate(GRID)
]
FAULTS += [
    Case(
        f"grid-flip-tp{p}-tp{c}",
        gqa,
        grid_engine(p, i + 1, seed=300 + i),
        grid_engine(c, i + 4, seed=400 + i),
        {"req-a": 29 + 5 * i, "req-b": 77},
        decoded={"req-b": 6} if i % 2 else {},
        fault=seeded_flip(500 + i),
        via="dumps" if i % 2 == 0 else "live",
    )
    for i, (p, c) in enumerate(GRID)
]


# Tests.


def located_without_errors(report: dict, rid: str, gid: int) -> list[dict]:
    """The located entries without their errors and the consumer worker that holds them
    (checked apart, against the file's own metadata)."""
    entries = report["requests"][rid]["groups"][str(gid)]["located"]
    skipped = (
        "consumer_worker",
        "file",
        "scaled_error",
        "differing_bytes",
        "differing_bits",
        "consumer_zeros",
        "nonfinite",
        "holds",
        "kv_exchanged",
        "element",
    )
    return [
        {k: v for k, v in e.items() if not k.startswith("max_") and k not in skipped}
        for e in entries
    ]


def check_consumer_worker(entry: dict) -> None:
    """A located entry names a consumer worker, and where that is a dump file, the
    file's own metadata gives those ranks and holds the layer."""
    worker = entry["consumer_worker"]
    assert set(worker) == {"tp_rank", "pp_rank"}
    if not entry["file"].endswith(".safetensors"):
        return
    with safe_open(entry["file"], framework="pt") as file:
        stated = json.loads(file.metadata()["kvaudit.worker"])
        names = {name.split("/")[0] for name in file.keys()}  # noqa: SIM118
    assert (stated["tp_rank"], stated["pp_rank"]) == (worker["tp_rank"], worker["pp_rank"])
    assert entry["layer"] in names


def detected(result: Outcome) -> bool:
    """Whether the report fails (and the command exits 1 where it ran)."""
    failed = result.report["ok"] is False
    if result.status is not None:
        assert result.status == (1 if failed else 0)
    return failed


@pytest.mark.parametrize("case", FAULTS, ids=[case.name for case in FAULTS])
def test_fault_is_detected_and_located(
    case: Case, tmp_path_factory: pytest.TempPathFactory
) -> None:
    result = outcome(case, tmp_path_factory)
    built, report = result.built, result.report
    assert detected(result)
    # The cells that really differ are exactly those the fault meant to change.
    assert built.planted
    assert set(differing_cells(built)) == built.planted
    expected = expected_report(built)
    for rid, request in report["requests"].items():
        for gid_text, group in request["groups"].items():
            gid = int(gid_text)
            want = expected.get((rid, gid), Expected())
            assert group["unverified"] is None, (rid, gid, group["unverified"])
            assert group["compared"] == expected_compared(built, rid, gid)
            assert set(group["mismatched_positions"]) == want.mismatched, (rid, gid)
            assert {tuple(p) for p in group["replicas_differing"]} == want.replicas, (rid, gid)
            assert located_without_errors(report, rid, gid) == want.located, (rid, gid)
            for entry in group["located"]:
                assert entry["max_abs_error"] is None or entry["max_abs_error"] > 0
                assert entry["scaled_error"] is None or entry["scaled_error"] > 0
                check_consumer_worker(entry)
    assert {key for key in expected} <= {
        (rid, int(gid)) for rid, r in report["requests"].items() for gid in r["groups"]
    }
    assert report["only_in_producer"] == report["only_in_consumer"] == []


@pytest.mark.parametrize("case", CLEAN, ids=[case.name for case in CLEAN])
def test_clean_transfer_is_never_flagged(
    case: Case, tmp_path_factory: pytest.TempPathFactory
) -> None:
    result = outcome(case, tmp_path_factory)
    built, report = result.built, result.report
    assert not detected(result)
    assert differing_cells(built) == {}
    groups = {
        (rid, int(g)): v for rid, r in report["requests"].items() for g, v in r["groups"].items()
    }
    want = {
        (rid, group.id)
        for rid in case.tokens
        for group in built.model.groups
        if expected_compared(built, rid, group.id)
    }
    assert set(groups) == want
    for (rid, gid), group in groups.items():
        assert group["compared"] == expected_compared(built, rid, gid) > 0
        assert group["located"] == group["mismatched_positions"] == []


def test_corpus_detection_rate(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Over the whole corpus: every fault detected, no clean transfer flagged."""
    faults = [detected(outcome(case, tmp_path_factory)) for case in FAULTS]
    false_positives = [detected(outcome(case, tmp_path_factory)) for case in CLEAN]
    assert sum(faults) / len(faults) == 1.0
    assert sum(false_positives) == 0
    # Every kind of fault the corpus names is in it, and at least half go through dumps.
    assert len(FAULTS) >= 7 and len(CLEAN) >= 10
    assert sum(case.via == "dumps" for case in FAULTS) * 2 >= len(FAULTS)


# The diagnosis: each fault named as what it is, by the evidence its injection leaves.

CORPUS_KINDS = {
    "slot-reused-in-flight": {"foreign_tokens"},
    "slot-reused-in-flight-64": {"foreign_tokens"},
    # An aborted request's KV (not on the producer) over req-a's last tokens.
    "stale-sender-after-abort": {"tail_not_written"},
    "tail-not-visible-zero": {"tail_not_written"},
    "tail-not-visible-old": {"tail_not_written"},
    # Rank 1 received rank 2's heads, which stay intact there: copied, not exchanged.
    "neighbour-heads-tp2-tp4": {"heads_duplicated"},
    "neighbour-heads-tp8-replicated": {"heads_duplicated", "replica_differs"},
    "indexer-not-sent": {"untraced", "replica_differs"},
    "sliding-window-not-sent": {"nonfinite", "untraced"},
    # Junk state pages: some of their bytes read as NaN or infinite.
    "mamba-state-not-sent": {"nonfinite", "untraced"},
    "kv-bound-to-wrong-request": {"stale_block"},
    "one-bit-flip": {"bit_flip"},
    # The flipped cell is a replica the consumer holds twice: only its twin disagrees.
    "one-bit-flip-pp2": {"replica_differs"},
}


@pytest.mark.parametrize("case", FAULTS, ids=[case.name for case in FAULTS])
def test_fault_is_named(case: Case, tmp_path_factory: pytest.TempPathFactory) -> None:
    report = outcome(case, tmp_path_factory).report
    findings = report["diagnosis"]
    kinds = {finding["kind"] for finding in findings}
    if case.name.startswith("grid-flip"):
        # One bit: named as such, or, where only a twin replica holds it, as its replica.
        assert kinds in ({"bit_flip"}, {"bit_flip", "replica_differs"}, {"replica_differs"})
        if kinds == {"replica_differs"}:
            assert "one bit of byte" in findings[0]["text"]
    else:
        assert kinds == CORPUS_KINDS[case.name]
    for rid, request in report["requests"].items():
        for gid, group in request["groups"].items():
            mine = [f for f in findings if (f["request"], str(f["group"])) == (rid, gid)]
            # Every located entry is explained by exactly one finding, at its positions.
            assert sum(f["located"] for f in mine) == len(group["located"])
            differing = {*group["mismatched_positions"]} | {e["position"] for e in group["located"]}
            assert all(set(f["positions"]) <= differing for f in mine)
            assert bool(mine) == bool(group["mismatched_positions"] or group["located"])
