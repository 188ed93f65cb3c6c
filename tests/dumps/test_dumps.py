"""Dumps: write and read back, strict reading, dump sets, and checksums of dumps that equal
the checksums of the live caches they were written from."""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvaudit.checksum import checksum_dump_set, total_bytes
from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.core.errors import DescriptionError, KvauditError
from kvaudit.description import CacheDescription, parse_description
from kvaudit.dumps import DumpSet, open_dump, open_dump_set, write_dump
from kvaudit.dumps.safetensors_io import read_header
from kvaudit.formats import record_to_json
from kvaudit.records import WorkerInfo, combine_workers
from kvaudit.sources import DumpSource, open_source
from kvaudit.workers import request_rows

NUM_BLOCKS = 16
ATTN = "model.layers.0.attn"
ATTN_KV = "model.layers.1.attn"
ATTN_SHARED = "model.layers.2.attn"
ATTN_PAIR = "model.layers.3.attn"
MAMBA = "model.layers.4.mixer"
MLA = "model.layers.5.mla"
STATE_BYTES = 2 * 4 * 2 + 4 * 4  # shapes [2, 4] float16 and [4] float32
PAGE_BYTES = STATE_BYTES + 8  # junk after the states

# Group 0: four attention layers (NHTC, KNTHD, one sharing, a K/V pair), two kernel
# blocks per block; group 1: a Mamba layer; group 2: an MLA latent of fp8.
DESCRIPTION = {
    "kvaudit": 1,
    "num_blocks": NUM_BLOCKS,
    "groups": [
        {
            "id": 0,
            "spec": {
                "type": "full_attention",
                "block_size": 4,
                "kernel_block_size": 2,
                "num_kv_heads": 2,
                "head_size": 4,
                "dtype": "bfloat16",
                "layout": "NHTC",
            },
            "layers": [
                ATTN,
                {"name": ATTN_KV, "spec": {"layout": "KNTHD"}},
                {"name": ATTN_SHARED, "shares": ATTN},
                {"name": ATTN_PAIR, "spec": {"layout": "NTHD", "dtype": "float16"}},
            ],
        },
        {
            "id": 1,
            "spec": {
                "type": "mamba",
                "block_size": 4,
                "shapes": [[2, 4], [4]],
                "dtypes": ["float16", "float32"],
            },
            "layers": [MAMBA],
        },
        {
            "id": 2,
            "spec": {
                "type": "mla",
                "block_size": 8,
                "head_size": 8,
                "dtype": "fp8_e4m3",
                "layout": "NTC",
            },
            "layers": [MLA],
        },
    ],
}

# Engine block ids; "b" shares block 7 with "a" (prefix caching), "c" lists positions
# 3 and 4 only. Blocks 12..15 are held by no request.
REQUESTS = {
    "a": RequestBlocks(10, {0: (0, [7, 2, 9]), 1: (0, [5, 1, 11]), 2: (0, [3, 6])}),
    "b": RequestBlocks(6, {0: (0, [7, 4]), 1: (0, [0, 10])}),
    "c": RequestBlocks(20, {0: (3, [0, 8])}),
}
DUMPED = sorted({i for r in REQUESTS.values() for _, ids in r.groups.values() for i in ids})
STORED = "kvaudit/stored_checksums"
WORKER = WorkerInfo(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, role="consumer", engine="t")


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of a dtype (NaNs included: compare bits, never values)."""
    generator = torch.Generator().manual_seed(seed)
    count = int(np.prod(shape)) * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def live_tensors(seed: int = 0) -> dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """Whole caches for DESCRIPTION; layer 0 is a non-contiguous view (NTHC memory)."""
    n = NUM_BLOCKS * 2
    physical = random_tensor((n, 2, 2, 8), torch.bfloat16, seed)  # N T H C
    return {
        ATTN: physical.permute(0, 2, 1, 3),  # N H T C
        ATTN_KV: random_tensor((2, n, 2, 2, 4), torch.bfloat16, seed + 1),
        ATTN_PAIR: (
            random_tensor((n, 2, 2, 4), torch.float16, seed + 2),
            random_tensor((n, 2, 2, 4), torch.float16, seed + 3),
        ),
        MAMBA: random_tensor((NUM_BLOCKS, PAGE_BYTES), torch.uint8, seed + 4),
        MLA: random_tensor((NUM_BLOCKS, 8, 8), torch.float8_e4m3fn, seed + 5),
    }


def description(data: dict | None = None) -> CacheDescription:
    return parse_description(data or DESCRIPTION, "test")


def write(path: Path, **kwargs: object) -> dict:
    """A dump of REQUESTS from fresh live tensors; returns the live tensors."""
    tensors = live_tensors()
    write_dump(path, description(), tensors, REQUESTS, worker=WORKER, **kwargs)
    return tensors


def live_record_json(
    desc: CacheDescription,
    tensors: dict,
    requests: dict[str, RequestBlocks],
    worker: WorkerInfo = WORKER,
    positions: str = "request",
) -> dict:
    checksummer = Checksummer(
        desc,
        tensors,
        tp_rank=worker.tp_rank,
        tp_size=worker.tp_size,
        role=worker.role,
        backend="torch",
    )
    return record_to_json(combine_workers([checksummer.checksum(requests, positions)]))


# Writing and reading back.


def test_round_trip_holds_the_requests_blocks(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    hashes = {"a": {0: [b"\x01" * 8, b"\x02" * 8, b"\x03" * 8]}, "b": {1: [b"\xff"]}}
    received = {"a": b"KVC1\x00\x00"}
    stored = torch.arange(NUM_BLOCKS, dtype=torch.int64) * 3 - 7
    tensors = write(path, block_hashes=hashes, received=received, stored_checksums=stored)
    dump = open_dump(path)

    assert dump.path == str(path)
    assert dump.worker == WorkerInfo(0, 1, 0, 1, "consumer", "t", str(path))
    assert dump.description == description()
    assert dump.block_ids == DUMPED
    assert dump.num_rows == len(DUMPED)
    for request_id, request in REQUESTS.items():
        got = dump.requests[request_id]
        assert got.num_tokens == request.num_tokens
        assert got.groups == request.groups
    assert dump.requests["a"].block_hashes == {0: hashes["a"][0]}
    assert dump.requests["b"].block_hashes == {1: hashes["b"][1]}
    assert dump.requests["c"].block_hashes == {}
    assert dump.requests["a"].received == received["a"]
    assert dump.requests["b"].received is None
    assert dump.stored_checksums is not None
    assert dump.stored_checksums.dtype == np.uint64
    expected = [(3 * b - 7) % 2**64 for b in DUMPED]
    assert dump.stored_checksums.tolist() == expected

    # Row i holds engine block DUMPED[i]: kernel blocks 2b, 2b+1 of attention layers.
    assert set(dump.tensors) == {ATTN, ATTN_KV, ATTN_PAIR, MAMBA, MLA}
    for row, block in enumerate(DUMPED):
        assert dump.row_of(block) == row
        for k in range(2):
            live_kb, dump_kb = block * 2 + k, row * 2 + k
            assert torch.equal(bits(dump.tensors[ATTN][dump_kb]), bits(tensors[ATTN][live_kb]))
            assert torch.equal(
                bits(dump.tensors[ATTN_KV][:, dump_kb]), bits(tensors[ATTN_KV][:, live_kb])
            )
            for part in range(2):
                assert torch.equal(
                    bits(dump.tensors[ATTN_PAIR][part][dump_kb]),
                    bits(tensors[ATTN_PAIR][part][live_kb]),
                )
        assert torch.equal(bits(dump.tensors[MAMBA][row]), bits(tensors[MAMBA][block]))
        assert torch.equal(bits(dump.tensors[MLA][row]), bits(tensors[MLA][block]))
    with pytest.raises(KvauditError, match="does not hold block 12"):
        dump.row_of(12)

    blocks = request_rows(dump, ["c"])
    assert blocks["c"].num_tokens == 20
    assert blocks["c"].groups == {0: (3, [DUMPED.index(0), DUMPED.index(8)])}


def _shifted(path: Path, target: Path, shift: int) -> None:
    """Rewrite a dump with its data starting ``shift`` bytes past an 8-byte boundary (the
    header padded with spaces): every tensor then sits at an odd offset."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(json.loads(raw[8 : 8 + length])).encode()
    text += b" " * ((shift - 8 - len(text)) % 8)
    target.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


@pytest.mark.parametrize("shift", [1, 3, 4])
def test_tensors_at_any_byte_offset_give_the_same_checksums(tmp_path: Path, shift: int) -> None:
    # Other writers (safetensors.torch.save_file) align nothing: the file is read in place
    # all the same, and its checksums are the live cache's.
    path = tmp_path / "aligned.safetensors"
    tensors = write(path, stored_checksums=torch.arange(NUM_BLOCKS, dtype=torch.int64))
    shifted = tmp_path / "rank0.safetensors"
    _shifted(path, shifted, shift)
    with safe_open(str(shifted), framework="np") as reader:
        assert set(reader.keys()) == {
            ATTN,
            ATTN_KV,
            f"{ATTN_PAIR}/k",
            f"{ATTN_PAIR}/v",
            MAMBA,
            MLA,
            STORED,
        }
    assert all(entry.start % 8 == shift for entry in read_header(str(shifted)).tensors.values())
    expected = live_record_json(description(), tensors, REQUESTS)
    for native in ("1", "0"):
        os.environ["KVAUDIT_NATIVE"] = native
        try:
            got = record_to_json(checksum_dump_set(open_dump_set([shifted])))
        finally:
            del os.environ["KVAUDIT_NATIVE"]
        assert got["requests"] == expected["requests"]
        assert got["workers"][0]["not_covered"] == expected["workers"][0]["not_covered"]
    staged = record_to_json(checksum_dump_set(open_dump_set([shifted]), backend="torch"))
    assert staged["requests"] == expected["requests"]


def test_written_file_is_aligned_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    write(path, stored_checksums=np.zeros(NUM_BLOCKS, dtype=np.uint64))
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    # Only the spec's tensors, end to end from the header to the file's end (safetensors
    # allows no gap); a tensor of whole 64-byte (8-byte) units starts 64 (8) byte aligned.
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    pair = [f"{ATTN_PAIR}/k", f"{ATTN_PAIR}/v"]
    assert set(entries) == {ATTN, ATTN_KV, *pair, MAMBA, MLA, STORED}
    spans = sorted(tuple(e["data_offsets"]) for e in entries.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert (8 + length) % 64 == 0
    for begin, end in spans:
        for unit in (64, 8):
            if (end - begin) % unit == 0:
                assert (8 + length + begin) % unit == 0
    metadata = header["__metadata__"]
    assert metadata["kvaudit.format"] == "1"
    assert json.loads(metadata["kvaudit.blocks"]) == DUMPED
    assert json.loads(metadata["kvaudit.worker"]) == {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "role": "consumer",
        "engine": "t",
    }
    assert json.loads(metadata["kvaudit.requests"])["c"] == {
        "num_tokens": 20,
        "groups": {"0": [3, [0, 8]]},
    }

    dump = open_dump(path)
    with safe_open(str(path), framework="pt") as reader:
        names = set(reader.keys())
        assert {ATTN, ATTN_KV, f"{ATTN_PAIR}/k", f"{ATTN_PAIR}/v", MAMBA, MLA} <= names
        assert torch.equal(bits(reader.get_tensor(ATTN)), bits(dump.tensors[ATTN]))
        assert torch.equal(
            bits(reader.get_tensor(f"{ATTN_PAIR}/v")), bits(dump.tensors[ATTN_PAIR][1])
        )
        assert reader.get_tensor("kvaudit/stored_checksums").dtype == torch.int64


def test_file_offset_is_where_the_header_puts_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    write(path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    dump = open_dump(path)
    tensors = {
        ATTN: dump.tensors[ATTN],
        ATTN_KV: dump.tensors[ATTN_KV],
        f"{ATTN_PAIR}/k": dump.tensors[ATTN_PAIR][0],
        f"{ATTN_PAIR}/v": dump.tensors[ATTN_PAIR][1],
        MAMBA: dump.tensors[MAMBA],
        MLA: dump.tensors[MLA],
    }
    with safe_open(str(path), framework="pt") as reader:
        for name, tensor in tensors.items():
            start = 8 + length + header[name]["data_offsets"][0]
            assert dump.file_offset(tensor) == start
            expected = bits(reader.get_tensor(name)).numpy().tobytes()
            assert raw[start : start + len(expected)] == expected

    # Views of a tensor: a row, an element, another dtype.
    attn_start = 8 + length + header[ATTN]["data_offsets"][0]
    row_bytes = 2 * 2 * 8 * 2  # H T C of bfloat16
    assert dump.file_offset(dump.tensors[ATTN][3]) == attn_start + 3 * row_bytes
    kv_start = 8 + length + header[ATTN_KV]["data_offsets"][0]
    kernel_blocks = 2 * len(DUMPED)
    element = (1 * kernel_blocks + 5) * (2 * 2 * 4) + (1 * 2 + 0) * 4 + 3  # [1, 5, 1, 0, 3]
    assert dump.file_offset(dump.tensors[ATTN_KV][1, 5, 1, 0, 3]) == kv_start + element * 2
    mla_start = 8 + length + header[MLA]["data_offsets"][0]
    assert dump.file_offset(dump.tensors[MLA].view(torch.uint8)[2, 3, 5:]) == mla_start + 157

    # A copy, another opening's mapping, or no element at all is not in this dump's file.
    other = open_dump(path)
    for tensor in (dump.tensors[ATTN].clone(), other.tensors[ATTN], dump.tensors[MLA][:0]):
        with pytest.raises(KvauditError, match="not a view of this dump's file mapping") as error:
            dump.file_offset(tensor)
        assert str(error.value).startswith(f"{path}: ")


def test_whole_cache_dump(tmp_path: Path) -> None:
    path = tmp_path / "whole.safetensors"
    tensors = write(path, whole_cache=True)
    dump = open_dump(path)
    assert dump.block_ids is None
    assert dump.num_rows == NUM_BLOCKS
    assert dump.row_of(15) == 15
    assert torch.equal(bits(dump.tensors[ATTN]), bits(tensors[ATTN]))
    assert torch.equal(bits(dump.tensors[MAMBA]), bits(tensors[MAMBA]))
    assert "kvaudit.blocks" not in _header(path)["__metadata__"]


# Checksums of dumps.


@pytest.mark.parametrize("positions", ["request", "block"])
@pytest.mark.parametrize("batch_bytes", [1, 700, 64 << 20])
def test_dump_checksums_equal_the_live_checksums(
    tmp_path: Path, positions: str, batch_bytes: int
) -> None:
    path = tmp_path / "rank0.safetensors"
    tensors = write(path)
    live = live_record_json(description(), tensors, REQUESTS, positions=positions)
    dump_set = open_dump_set([path])
    done: list[int] = []
    record = checksum_dump_set(
        dump_set, positions=positions, batch_bytes=batch_bytes, progress=done.append
    )
    got = record_to_json(record)
    assert got["requests"] == live["requests"]
    assert got["workers"][0]["fingerprints"] == live["workers"][0]["fingerprints"]
    assert got["workers"][0]["not_covered"] == {}
    assert got["complete"] is True
    # Every group is checksummed, and not to zeros.
    assert set(got["requests"]["a"]["groups"]) == {"0", "1", "2"}
    assert all(v != "0" * 16 for v in got["requests"]["a"]["groups"]["0"]["totals"])
    assert sum(done) == total_bytes(dump_set) > 0
    if batch_bytes == 1:
        assert len(done) > 10


def test_checksum_of_some_requests(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    tensors = write(path)
    dump_set = open_dump_set([path])
    subset = {"c": REQUESTS["c"], "a": REQUESTS["a"]}
    got = record_to_json(checksum_dump_set(dump_set, request_ids=["c", "a"]))
    assert list(got["requests"]) == ["c", "a"]
    assert got["requests"] == live_record_json(description(), tensors, subset)["requests"]
    assert total_bytes(dump_set, ["c"]) < total_bytes(dump_set)
    with pytest.raises(KvauditError, match="'zzz'"):
        checksum_dump_set(dump_set, request_ids=["zzz"])


def test_one_tensor_under_two_names_is_dumped_once(tmp_path: Path) -> None:
    # Layer 2 does not declare `shares`; the caller passes layer 0's tensor under its name.
    data = copy.deepcopy(DESCRIPTION)
    data["groups"][0]["layers"][2] = ATTN_SHARED
    desc = description(data)
    tensors = live_tensors()
    tensors[ATTN_SHARED] = tensors[ATTN]
    path = tmp_path / "rank0.safetensors"
    write_dump(path, desc, tensors, REQUESTS, worker=WORKER)
    dump = open_dump(path)
    assert ATTN_SHARED not in dump.tensors
    shared = next(e for e in dump.description.groups[0].layers if e.name == ATTN_SHARED)
    assert shared.shares == ATTN
    got = record_to_json(checksum_dump_set(open_dump_set([path])))
    assert got["requests"] == live_record_json(desc, tensors, REQUESTS)["requests"]


def test_checksummer_over_a_dumps_mapped_rows(tmp_path: Path) -> None:
    # A Checksummer reads a dump's memory-mapped rows in place, its requests as rows.
    path = tmp_path / "rank0.safetensors"
    tensors = write(path)
    dump = open_dump(path)
    worker = dump.worker
    summer = Checksummer(
        dump.description,
        dump.tensors,
        tp_rank=worker.tp_rank,
        tp_size=worker.tp_size,
        role=worker.role,
        backend="torch",
        num_blocks=dump.num_rows,
    )
    record = summer.checksum(request_rows(dump))
    got = record_to_json(combine_workers([record]))
    assert got["requests"] == live_record_json(description(), tensors, REQUESTS)["requests"]


def test_whole_cache_dump_checksums(tmp_path: Path) -> None:
    path = tmp_path / "whole.safetensors"
    tensors = write(path, whole_cache=True)
    got = record_to_json(checksum_dump_set(open_dump_set([path]), batch_bytes=2000))
    assert got["requests"] == live_record_json(description(), tensors, REQUESTS)["requests"]


def test_dump_without_blocks(tmp_path: Path) -> None:
    # A request with no blocks listed: every layer tensor has no rows.
    path = tmp_path / "empty.safetensors"
    requests = {"e": RequestBlocks(0, {0: (0, []), 1: (2, [])})}
    write_dump(path, description(), live_tensors(), requests, worker=WORKER)
    dump = open_dump(path)
    assert dump.num_rows == 0
    assert dump.block_ids == []
    assert dump.tensors[ATTN].shape == (0, 2, 2, 8)
    got = record_to_json(checksum_dump_set(open_dump_set([path])))
    assert got["requests"] == live_record_json(description(), live_tensors(), requests)["requests"]
    assert got["requests"]["e"]["groups"]["1"]["start"] == 2
    assert got["requests"]["e"]["groups"]["1"]["values"] == []


def _tp_engine(
    tp_size: int, kv: dict[str, dict[str, np.ndarray]], seed: int
) -> list[tuple[dict, dict[str, torch.Tensor], dict[str, RequestBlocks]]]:
    """Each worker of a TP engine holding the requests' global KV ``[tokens, 4 heads, 8]``
    (uint16 bits of bf16) split by heads, paged into this engine's own block ids, with
    junk in every other slot."""
    num_blocks, block_size, heads = 12, 4, 4
    rng = np.random.default_rng(seed)
    order = [int(i) for i in rng.permutation(num_blocks)]
    tables: dict[str, list[int]] = {}
    for request_id, layers in kv.items():
        tokens = next(iter(layers.values())).shape[0]
        count = -(-tokens // block_size)
        tables[request_id], order = order[:count], order[count:]
    local = heads // tp_size
    workers = []
    for rank in range(tp_size):
        tensors = {}
        for layer in ("model.layers.0.attn", "model.layers.1.attn"):
            cache = rng.integers(0, 2**16, (num_blocks, block_size, local, 8), dtype=np.uint16)
            for request_id, layers in kv.items():
                cells = layers[layer][:, rank * local : (rank + 1) * local]
                for position, block in enumerate(tables[request_id]):
                    chunk = cells[position * block_size : (position + 1) * block_size]
                    cache[block, : len(chunk)] = chunk
            tensors[layer] = torch.from_numpy(cache.astype(np.int16)).view(torch.bfloat16)
        desc = {
            "kvaudit": 1,
            "num_blocks": num_blocks,
            "groups": [
                {
                    "spec": {
                        "type": "full_attention",
                        "block_size": block_size,
                        "num_kv_heads": local,
                        "head_size": 4,
                        "dtype": "bfloat16",
                        "layout": "NTHC",
                    },
                    "layers": ["model.layers.0.attn", "model.layers.1.attn"],
                }
            ],
        }
        requests = {
            request_id: RequestBlocks(next(iter(layers.values())).shape[0], {0: (0, table)})
            for request_id, (layers, table) in zip(kv, zip(kv.values(), tables.values()))
        }
        workers.append((desc, tensors, requests))
    return workers


def _write_engine(directory: Path, tp_size: int, kv: dict, seed: int) -> list[Path]:
    directory.mkdir()
    paths = []
    for rank, (desc, tensors, requests) in enumerate(_tp_engine(tp_size, kv, seed)):
        worker = WorkerInfo(rank, tp_size, 0, 1, "producer", f"tp{tp_size}")
        path = directory / f"rank{rank}.safetensors"
        write_dump(path, parse_description(desc, "t"), tensors, requests, worker=worker)
        paths.append(path)
    return paths


def test_tp2_dump_set_sums_to_the_tp1_checksums(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    kv = {
        request_id: {
            layer: rng.integers(0, 2**16, (tokens, 4, 8), dtype=np.uint16)
            for layer in ("model.layers.0.attn", "model.layers.1.attn")
        }
        for request_id, tokens in (("r1", 10), ("r2", 5))
    }
    _write_engine(tmp_path / "tp1", 1, kv, seed=1)
    _write_engine(tmp_path / "tp2", 2, kv, seed=2)
    one = record_to_json(checksum_dump_set(open_dump_set([tmp_path / "tp1"])))
    two_set = open_dump_set([tmp_path / "tp2"])
    assert [d.worker.tp_rank for d in two_set.dumps] == [0, 1]
    two = record_to_json(checksum_dump_set(two_set))
    assert two["complete"] is True
    assert two["requests"] == one["requests"]
    assert len(one["requests"]["r1"]["groups"]["0"]["totals"]) == 3

    # One rank's partial sums alone differ: the ranks' shares add up.
    alone = checksum_dump_set(open_dump_set([tmp_path / "tp2" / "rank0.safetensors"]))
    assert record_to_json(alone)["requests"] != one["requests"]


def test_incomplete_set(tmp_path: Path) -> None:
    kv = {
        "r": {
            layer: np.ones((4, 4, 8), np.uint16)
            for layer in ("model.layers.0.attn", "model.layers.1.attn")
        }
    }
    paths = _write_engine(tmp_path / "tp2", 2, kv, seed=3)
    dump_set = open_dump_set([paths[1]])
    assert dump_set.complete is False
    assert dump_set.missing == [(0, 0)]
    assert dump_set.request_ids == ["r"]
    record = checksum_dump_set(dump_set)
    assert record.complete is False
    assert record.missing_workers == [(0, 0)]


# Strict reading.


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])


def _rewrite(path: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite a dump's header (the data bytes stay where they are)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _meta(key: str, value: object) -> Callable[[Path], None]:
    def edit(header: dict) -> None:
        if value is None:
            del header["__metadata__"][key]
        else:
            header["__metadata__"][key] = value if isinstance(value, str) else json.dumps(value)

    return lambda path: _rewrite(path, edit)


def _requests(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(header: dict) -> None:
        requests = json.loads(header["__metadata__"]["kvaudit.requests"])
        change(requests)
        header["__metadata__"]["kvaudit.requests"] = json.dumps(requests)

    return lambda path: _rewrite(path, edit)


def _tensor(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(header: dict) -> None:
        change(header[name])

    return lambda path: _rewrite(path, edit)


def _drop(name: str) -> Callable[[Path], None]:
    """Take a tensor out of a dump, its bytes with it (the others move up)."""

    def drop(path: Path) -> None:
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        data = raw[8 + length :]
        begin, end = header.pop(name)["data_offsets"]
        for key, entry in header.items():
            if key != "__metadata__" and entry["data_offsets"][0] >= end:
                entry["data_offsets"] = [n - (end - begin) for n in entry["data_offsets"]]
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[:begin] + data[end:])

    return drop


def _drop_first_entry(header: dict) -> None:
    """Leave the first tensor's bytes in place, the tensor gone: a gap."""
    first = next(k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][0] == 0)
    header.pop(first)


def _doubled_key(name: str) -> Callable[[Path], None]:
    """The header names tensor ``name`` twice."""

    def double(path: Path) -> None:
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        text = json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}}}"
        data = text.encode()
        path.write_bytes(struct.pack("<Q", len(data)) + data + raw[8 + length :])

    return double


def _doubled_request(request_id: str) -> Callable[[Path], None]:
    """``kvaudit.requests`` names a request twice (the second one with no blocks)."""

    def edit(header: dict) -> None:
        text = header["__metadata__"]["kvaudit.requests"]
        extra = json.dumps({"num_tokens": 1, "groups": {}})
        header["__metadata__"]["kvaudit.requests"] = (
            f"{text[:-1]},{json.dumps(request_id)}:{extra}}}"
        )

    return lambda path: _rewrite(path, edit)


def _drop_in(name: str, entry: dict) -> Callable[[Path], None]:
    return lambda path: _rewrite(path, lambda header: header.__setitem__(name, entry))


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda entry: entry.__setitem__(key, value)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def _swap_shape(entry: dict) -> None:
    entry["shape"] = entry["shape"][::-1]


def _overlap(header: dict) -> None:
    begin, end = header[MAMBA]["data_offsets"]
    header[MAMBA]["data_offsets"] = [begin - 64, end - 64]


STRICT_CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("truncated", _truncate, "truncated"),
    ("tiny", lambda p: p.write_bytes(b"abc"), "not a safetensors file"),
    ("text", lambda p: p.write_bytes(b"hello world, not a dump" * 3), "not a safetensors"),
    (
        "header not json",
        lambda p: p.write_bytes(p.read_bytes()[:8] + b"x" * 64 + p.read_bytes()[72:]),
        "header is not JSON",
    ),
    ("overlap", lambda p: _rewrite(p, _overlap), "overlap"),
    ("no format", _meta("kvaudit.format", None), "no kvaudit.format"),
    ("wrong format", _meta("kvaudit.format", "2"), "unknown kvaudit.format '2'"),
    ("unknown key", _meta("kvaudit.extra", "1"), "unknown metadata key kvaudit.extra"),
    ("requests not json", _meta("kvaudit.requests", "{"), "kvaudit.requests: not valid JSON"),
    ("requests list", _meta("kvaudit.requests", [1]), "kvaudit.requests: expected a JSON object"),
    ("no requests", _meta("kvaudit.requests", None), "no kvaudit.requests"),
    ("no worker", _meta("kvaudit.worker", None), "no kvaudit.worker"),
    (
        "bad role",
        _meta(
            "kvaudit.worker",
            {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "role": "boss"},
        ),
        "kvaudit.worker.role",
    ),
    (
        "rank out of range",
        _meta(
            "kvaudit.worker",
            {"tp_rank": 2, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "role": "producer"},
        ),
        "kvaudit.worker.tp_rank",
    ),
    ("no description", _meta("kvaudit.cache", None), "no cache description"),
    ("blocks not list", _meta("kvaudit.blocks", 5), "kvaudit.blocks: expected a list"),
    ("blocks twice", _meta("kvaudit.blocks", [*DUMPED[:-1], DUMPED[0]]), "listed twice"),
    ("block out of cache", _meta("kvaudit.blocks", [*DUMPED[:-1], 99]), "kvaudit.blocks[11]"),
    ("missing layer", _drop(ATTN_KV), f"layer {ATTN_KV} has no tensor"),
    ("missing v", _drop(f"{ATTN_PAIR}/v"), f"{ATTN_PAIR}/v"),
    ("missing state", _drop(MAMBA), f"layer {MAMBA} has no tensor"),
    ("wrong shape", _tensor(ATTN_KV, _swap_shape), "expected shape (2, 24, 2, 2, 4)"),
    (
        "wrong dtype",
        _tensor(f"{ATTN_PAIR}/k", _set("dtype", "BF16")),
        "expected dtype float16, got bfloat16",
    ),
    (
        "state rows",
        _tensor(MAMBA, _swap_shape),
        f"layer {MAMBA}: expected a state tensor of 12 rows",
    ),
    ("unknown dtype", _tensor(MLA, _set("dtype", "Q4")), "unknown dtype"),
    (
        "extra tensor",
        _drop_in("model.layers.9.attn", {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}),
        "tensor model.layers.9.attn is not a layer",
    ),
    (
        "tensor of a sharing layer",
        _drop_in(ATTN_SHARED, {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}),
        f"layer {ATTN_SHARED} shares the cache of {ATTN} (shares:) and has no tensor",
    ),
    ("gap", lambda p: _rewrite(p, _drop_first_entry), "bytes 0 to "),
    ("bytes after the tensors", lambda p: p.write_bytes(p.read_bytes() + b"x"), "1 bytes follow"),
    ("tensor named twice", _doubled_key(ATTN), f'key "{ATTN}" appears twice'),
    ("request named twice", _doubled_request("a"), 'kvaudit.requests: key "a" appears twice'),
    (
        "huge shape of no bytes",
        _tensor(MLA, _set("shape", [0, 2**40, 2**40])),
        "is too large",
    ),
    (
        "stored shape",
        _tensor(STORED, lambda e: e.update(dtype="I32", shape=[2 * len(DUMPED)])),
        "kvaudit/stored_checksums: expected int64",
    ),
    (
        "unknown block",
        _requests(lambda r: r["a"]["groups"]["0"][1].append(13)),
        "block 13 is not held",
    ),
    (
        "negative tokens",
        _requests(lambda r: r["b"].__setitem__("num_tokens", -1)),
        "num_tokens must be",
    ),
    (
        "float tokens",
        _requests(lambda r: r["b"].__setitem__("num_tokens", 6.5)),
        "num_tokens must be",
    ),
    (
        "float start",
        _requests(lambda r: r["c"]["groups"]["0"].__setitem__(0, 1.5)),
        "start position",
    ),
    (
        "negative start",
        _requests(lambda r: r["c"]["groups"]["0"].__setitem__(0, -3)),
        "start position",
    ),
    (
        "block twice",
        _requests(lambda r: r["a"]["groups"]["0"][1].append(7)),
        "block 7 is listed at two positions",
    ),
    (
        "unknown group",
        _requests(lambda r: r["b"]["groups"].__setitem__("9", [0, [7]])),
        "group 9 is not a group",
    ),
    (
        "group entry",
        _requests(lambda r: r["b"]["groups"].__setitem__("0", [7])),
        "expected [start, [block ids]]",
    ),
    ("no num_tokens", _requests(lambda r: r["b"].pop("num_tokens")), "no num_tokens"),
    ("request key", _requests(lambda r: r["b"].__setitem__("tokens", 3)), "unknown key 'tokens'"),
    (
        "bad base64",
        _requests(lambda r: r["b"].__setitem__("received", "@@@")),
        "received: not valid base64",
    ),
    (
        "bad hash",
        _requests(lambda r: r["b"].__setitem__("block_hashes", {"0": ["zz"]})),
        "not a hex hash",
    ),
    (
        "too many hashes",
        _requests(lambda r: r["c"].__setitem__("block_hashes", {"0": ["00", "01", "02"]})),
        "at most 2 hex hashes",
    ),
]


@pytest.mark.parametrize(
    ("spoil", "expected"), [case[1:] for case in STRICT_CASES], ids=[c[0] for c in STRICT_CASES]
)
def test_strict_reading(tmp_path: Path, spoil: Callable[[Path], None], expected: str) -> None:
    path = tmp_path / "rank0.safetensors"
    write(path, stored_checksums=np.zeros(NUM_BLOCKS, dtype=np.int64))
    spoil(path)
    with pytest.raises(KvauditError) as error:
        open_dump(path)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert expected in message
    # A dump set reports the same problem.
    with pytest.raises(KvauditError, match=str(path).replace(".", r"\.")):
        open_dump_set([tmp_path])


def test_embedded_description_errors_name_the_key_and_config_overrides(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    write(path)
    bad = copy.deepcopy(DESCRIPTION)
    bad["groups"][0]["spec"]["kernel_block_size"] = 3
    _meta("kvaudit.cache", bad)(path)
    with pytest.raises(DescriptionError) as error:
        open_dump(path)
    message = str(error.value)
    assert message.startswith(f"{path} (kvaudit.cache): groups[0].spec.kernel_block_size")
    assert "\n" not in message
    # --config overrides the embedded description (broken or not).
    dump = open_dump(path, config=description())
    assert dump.description == description()
    _meta("kvaudit.cache", None)(path)
    assert open_dump(path, config=description()).num_rows == len(DUMPED)


def test_config_that_does_not_match_is_a_strict_error(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    write(path)
    other = copy.deepcopy(DESCRIPTION)
    other["groups"][0]["spec"]["num_kv_heads"] = 4
    with pytest.raises(KvauditError, match=r"expected shape \(24, 4, 2, 8\)"):
        open_dump(path, config=description(other))


def test_duplicate_workers_in_a_set(tmp_path: Path) -> None:
    first = tmp_path / "a.safetensors"
    write(first)
    second = tmp_path / "b.safetensors"
    shutil.copy(first, second)
    with pytest.raises(KvauditError) as error:
        open_dump_set([tmp_path])
    message = str(error.value)
    assert message.startswith(f"{second}: same worker (pp_rank 0, tp_rank 0) as {first}")
    assert "\n" not in message


def test_workers_that_disagree_on_tp_size(tmp_path: Path) -> None:
    first = tmp_path / "a.safetensors"
    write(first)
    second = tmp_path / "b.safetensors"
    worker = WorkerInfo(1, 2, 0, 1, "consumer", "t")
    write_dump(second, description(), live_tensors(), REQUESTS, worker=worker)
    with pytest.raises(KvauditError) as error:
        open_dump_set([first, second])
    message = str(error.value)
    assert message.startswith(f"{second}: tp_size 2, but {first} has tp_size 1")
    assert "\n" not in message


def test_set_paths_that_do_not_exist_or_hold_nothing(tmp_path: Path) -> None:
    with pytest.raises(KvauditError, match="no such file or directory"):
        open_dump_set([tmp_path / "nope"])
    with pytest.raises(KvauditError, match=r"no \.safetensors files or ExampleConnector folders"):
        open_dump_set([tmp_path])


# Writing is atomic and checked.


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    tensors = live_tensors()
    del tensors[ATTN_KV]
    with pytest.raises(KvauditError, match=f"{path}: layer {ATTN_KV} has no tensor"):
        write_dump(path, description(), tensors, REQUESTS, worker=WORKER)
    assert os.listdir(tmp_path) == []


def test_failure_midway_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    write(path)
    before = path.read_bytes()
    tensors = live_tensors(seed=9)
    # The last layer written cannot be copied to the host: the write fails after the
    # header and the other layers' bytes.
    tensors[MLA] = torch.empty((NUM_BLOCKS, 8, 8), dtype=torch.float8_e4m3fn, device="meta")
    with pytest.raises(NotImplementedError):
        write_dump(path, description(), tensors, REQUESTS, worker=WORKER)
    assert os.listdir(tmp_path) == ["rank0.safetensors"]
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t, r: t.__setitem__(MLA, t[MLA].view(torch.uint8)), "expected dtype float8_e4m3fn"),
        (lambda t, r: t.__setitem__(ATTN, t[ATTN][:-2]), "expected shape (32, 2, 2, 8)"),
        (lambda t, r: t.__setitem__(ATTN_PAIR, t[ATTN_PAIR][0]), "needs a K/V pair"),
        (lambda t, r: r.__setitem__("d", RequestBlocks(4, {0: (0, [16])})), "not in the cache"),
        (lambda t, r: r.__setitem__("d", RequestBlocks(4, {0: (0, [1, 1])})), "two positions"),
        (lambda t, r: r.__setitem__("d", RequestBlocks(-4, {})), "num_tokens"),
        # What only a reader used to refuse: the file would not have opened.
        (lambda t, r: r.__setitem__("d", RequestBlocks(3, {0: (5, [1])})), "beyond the request"),
        (lambda t, r: r.__setitem__("d", RequestBlocks(0, {0: (0, [1])})), "beyond the request"),
        (lambda t, r: r.__setitem__("d", RequestBlocks(2**41, {0: (0, [1])})), "num_tokens must"),
        (lambda t, r: r.__setitem__("d\ud800", RequestBlocks(4, {})), "not Unicode text"),
    ],
)
def test_write_checks_its_input(tmp_path: Path, change: Callable, expected: str) -> None:
    path = tmp_path / "rank0.safetensors"
    tensors = live_tensors()
    requests = dict(REQUESTS)
    change(tensors, requests)
    with pytest.raises(KvauditError) as error:
        write_dump(path, description(), tensors, requests, worker=WORKER)
    assert expected in str(error.value)
    assert str(error.value).startswith(f"{path}: ")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"block_hashes": {"a": {0: [b""]}}}, '"" is not a hex hash'),
        ({"block_hashes": {"a": {7: []}}}, "group 7 is not a group"),
        ({"worker": WorkerInfo(0, 1, 0, 1, "consumer", None)}, "engine: expected a string"),  # type: ignore[arg-type]
    ],
)
def test_write_refuses_what_a_reader_refuses(tmp_path: Path, options: dict, expected: str) -> None:
    path = tmp_path / "rank0.safetensors"
    with pytest.raises(KvauditError) as error:
        write_dump(path, description(), live_tensors(), REQUESTS, **{"worker": WORKER, **options})
    assert expected in str(error.value)
    assert str(error.value).startswith(f"{path}: ")
    assert os.listdir(tmp_path) == []


# vLLM ExampleConnector folders.


def connector_set(folders: list[Path], config: CacheDescription | None = None) -> DumpSet:
    """ExampleConnector folders opened as SOURCE arguments are (``kvaudit.sources``)."""
    source = open_source([str(folder) for folder in folders], config)
    assert isinstance(source, DumpSource)
    return source.dump_set


@pytest.mark.parametrize("token_major", [False, True], ids=["blocked-layout", "token-major"])
@pytest.mark.parametrize(
    ("kind", "tokens"), [("attention", 8), ("attention", 10), ("mla", 8), ("mla", 13)]
)
def test_example_connector_folder(
    tmp_path: Path, kind: str, tokens: int, token_major: bool
) -> None:
    # The description may give the folder's own token-major layout (no N, as the spec
    # says) or the layout of the engine's paged cache.
    heads, head_size, block, kernel, num_blocks = 2, 4, 4, 2, 8
    mla = kind == "mla"
    spec = (
        {"type": "mla", "head_size": 8, "layout": "TC" if token_major else "NTC"}
        if mla
        else {
            "type": "full_attention",
            "num_kv_heads": heads,
            "head_size": head_size,
            "layout": "KTHD" if token_major else "KNTHD",
        }
    )
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    config = parse_description(
        {
            "kvaudit": 1,
            "num_blocks": num_blocks,
            "groups": [
                {
                    "spec": {
                        "block_size": block,
                        "kernel_block_size": kernel,
                        "dtype": "bfloat16",
                        **spec,
                    },
                    "layers": layers,
                }
            ],
        },
        "config",
    )
    folder = tmp_path / "req-42"
    folder.mkdir()
    rng = np.random.default_rng(tokens)
    positions = -(-tokens // block)
    table = [int(i) for i in rng.permutation(num_blocks)[:positions]]
    live = {}
    for index, layer in enumerate(layers):
        # The request's KV, token-major, as the connector saves it.
        shape = (tokens, 8) if mla else (2, tokens, heads, head_size)
        kv = random_tensor(shape, torch.bfloat16, seed=index)
        saved = kv if mla else kv.reshape(2, tokens, heads * head_size)
        save_file({"kv_cache": saved.contiguous()}, str(folder / f"{layer}.safetensors"))
        # The same KV paged into a live cache at the table's blocks, junk elsewhere.
        if mla:
            cache = random_tensor((num_blocks * block, 8), torch.bfloat16, seed=10 + index)
            for position, block_id in enumerate(table):
                n = min(block, tokens - position * block)
                cache[block_id * block : block_id * block + n] = kv[position * block :][:n]
            live[layer] = cache.reshape(num_blocks * 2, kernel, 8)
        else:
            cache = random_tensor(
                (2, num_blocks * block, heads, head_size), torch.bfloat16, 10 + index
            )
            for position, block_id in enumerate(table):
                n = min(block, tokens - position * block)
                cache[:, block_id * block : block_id * block + n] = kv[:, position * block :][:, :n]
            live[layer] = cache.reshape(2, num_blocks * 2, kernel, heads, head_size)

    with pytest.raises(KvauditError, match="--config"):
        connector_set([folder])
    dump_set = connector_set([folder], config)
    (dump,) = dump_set.dumps
    assert dump.path == str(folder)
    assert list(dump.requests) == ["req-42"]
    assert dump.requests["req-42"].num_tokens == tokens
    assert dump.num_rows == positions
    got = record_to_json(checksum_dump_set(dump_set))
    requests = {"req-42": RequestBlocks(tokens, {0: (0, table)})}
    worker = WorkerInfo(0, 1, 0, 1, "producer")
    live_config = parse_description(
        {
            "kvaudit": 1,
            "num_blocks": num_blocks,
            "groups": [
                {
                    "spec": {
                        "block_size": block,
                        "kernel_block_size": kernel,
                        "dtype": "bfloat16",
                        **spec,
                        "layout": "NTC" if mla else "KNTHD",
                    },
                    "layers": layers,
                }
            ],
        },
        "live config",
    )
    want = live_record_json(live_config, live, requests, worker)["requests"]
    assert got["requests"] == want


def test_token_major_layout_only_for_example_connector_folders(tmp_path: Path) -> None:
    """A layout without N is valid in a description, but a dump needs N and live caches
    with it are not covered."""
    description = {
        "kvaudit": 1,
        "num_blocks": 4,
        "groups": [
            {
                "spec": {
                    "type": "full_attention",
                    "block_size": 4,
                    "num_kv_heads": 2,
                    "head_size": 4,
                    "dtype": "bfloat16",
                    "layout": "KTHD",
                },
                "layers": ["model.layers.0.attn"],
            }
        ],
    }
    config = parse_description(description, "config")
    tensors = {"model.layers.0.attn": torch.zeros(2, 16, 2, 4, dtype=torch.bfloat16)}
    checksummer = Checksummer(config, tensors)
    assert "no N" in checksummer.not_covered[0]
    path = tmp_path / "dump.safetensors"
    with pytest.raises(KvauditError, match="no N"):
        write_dump(path, config, tensors, {}, worker=WorkerInfo())
    assert not path.exists()


def test_example_connector_folder_must_match_the_config(tmp_path: Path) -> None:
    folder = tmp_path / "req"
    folder.mkdir()
    save_file(
        {"kv_cache": torch.zeros(2, 8, 6, dtype=torch.bfloat16)},
        str(folder / "model.layers.0.attn.safetensors"),
    )
    config = parse_description(
        {
            "kvaudit": 1,
            "num_blocks": 4,
            "groups": [
                {
                    "spec": {
                        "type": "full_attention",
                        "block_size": 4,
                        "num_kv_heads": 2,
                        "head_size": 4,
                        "dtype": "bfloat16",
                        "layout": "KNTHD",
                    },
                    "layers": ["model.layers.0.attn"],
                }
            ],
        },
        "config",
    )
    with pytest.raises(KvauditError) as error:
        connector_set([folder], config)
    message = str(error.value)
    assert message.startswith(str(folder / "model.layers.0.attn.safetensors"))
    assert (
        "expected kv_cache of shape [Tx2x8] ([tokens, heads, 2*head_size]) or [2xTx8] "
        "([2, tokens, heads*head_size]), bfloat16; got [2, 8, 6] bfloat16"
    ) in message


# GPU.


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dump_checksums_on_the_gpu_equal_the_cpu_ones(tmp_path: Path) -> None:
    path = tmp_path / "rank0.safetensors"
    write(path)
    dump_set = open_dump_set([path])
    cpu = record_to_json(checksum_dump_set(dump_set))
    gpu = record_to_json(checksum_dump_set(dump_set, device="cuda", batch_bytes=700))
    assert gpu["requests"] == cpu["requests"]
