"""Groups with block spaces of their own (a group's ``num_blocks``; ``kvaudit.blocks`` per
group): the same KV described with one block space and with two checksums alike, equal to
the tests' reference; dumps written whole and per group read back; diff, numeric diff,
``corrupt`` and bad input handle them.

The model: a full-attention group of 64 blocks and a sliding-window group. Built once with
one block space (kvbuild), then the sliding-window group's blocks are moved into a space
of 16 blocks of its own (``two_spaces``): the same KV, other block ids and tensors.
"""

from __future__ import annotations

import copy
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import engine_runs as er
from helpers import kvbuild as kb

from kvaudit.checksum import checksum_dump_set
from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.corrupt import corrupt_dump
from kvaudit.description import parse_description
from kvaudit.dumps import open_dump, open_dump_set, write_dump
from kvaudit.formats import record_to_json
from kvaudit.records import WorkerInfo

FULL = "model.layers.0.self_attn.attn"
FULL2 = "model.layers.2.self_attn.attn"
WINDOW = "model.layers.1.self_attn.attn"
WINDOW2 = "model.layers.3.self_attn.attn"
MODEL = kb.Model(
    (
        kb.GroupModel(0, (kb.Attn(FULL, heads=4), kb.Attn(FULL2, heads=4)), block_size=4),
        kb.GroupModel(
            1,
            (
                kb.Attn(WINDOW, heads=4, type="sliding_window", sliding_window=8),
                kb.Attn(WINDOW2, heads=4, type="sliding_window", sliding_window=8),
            ),
            block_size=4,
            kernel_block_size=2,
        ),
    )
)
TOKENS = {"req-a": 22, "req-b": 13}
SPACE = 16  # the sliding-window group's own blocks
# The window group lists only its last blocks (what a window transfer moves).
WINDOW_SPANS = {"req-a": (3, 3), "req-b": (2, 2)}


def build(tp_size: int = 1) -> tuple[dict[str, kb.RequestKV], list[kb.Worker]]:
    requests = {rid: kb.make_request(MODEL, n, seed=i) for i, (rid, n) in enumerate(TOKENS.items())}
    positions = {rid: {1: span} for rid, span in WINDOW_SPANS.items()}
    engine = kb.Engine(tp_size=tp_size, num_blocks=64, seed=3)
    return requests, kb.build_engine(MODEL, requests, engine, positions)


def _n_axis(worker: kb.Worker, name: str) -> int:
    spec = next(
        entry.spec
        for entry in parse_description(worker.description, "test").group(1).layers
        if entry.name == name
    )
    return spec.layout.index("N")


def two_spaces(worker: kb.Worker, seed: int = 7) -> kb.Worker:
    """The worker with group 1's blocks moved into a space of ``SPACE`` blocks of its own
    (fresh random block ids, other rows random): the same KV, described by two spaces."""
    rng = np.random.default_rng(seed)
    used = sorted({b for _, groups in worker.requests.values() for b in groups[1][1]})
    new_ids = [int(i) for i in rng.permutation(SPACE)[: len(used)]]
    mapping = dict(zip(used, new_ids, strict=True))
    description = copy.deepcopy(worker.description)
    description["groups"][1]["num_blocks"] = SPACE
    tensors = dict(worker.tensors)
    r = 2  # kernel blocks per block in group 1
    for layer in (WINDOW, WINDOW2):
        old = worker.tensors[layer]
        assert isinstance(old, torch.Tensor)
        axis = _n_axis(worker, layer)
        shape = list(old.shape)
        shape[axis] = SPACE * r
        noise = rng.integers(0, 256, (int(np.prod(shape)) * old.element_size(),), np.uint8)
        new = torch.from_numpy(noise).view(old.dtype).reshape(shape).clone()
        for before, after in mapping.items():
            for k in range(r):
                new.select(axis, after * r + k).copy_(old.select(axis, before * r + k))
        tensors[layer] = new
    requests = {
        rid: (n, {0: groups[0], 1: (groups[1][0], [mapping[b] for b in groups[1][1]])})
        for rid, (n, groups) in worker.requests.items()
    }
    return kb.Worker(
        worker.tp_rank, worker.tp_size, worker.pp_rank, worker.pp_size, description, tensors,
        requests,
    )  # fmt: skip


def write(worker: kb.Worker, path: Path, role: str, *, whole_cache: bool = False) -> Path:
    blocks = {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in worker.requests.items()}
    info = WorkerInfo(worker.tp_rank, worker.tp_size, worker.pp_rank, worker.pp_size, role, "t")
    path.parent.mkdir(parents=True, exist_ok=True)
    description = parse_description(worker.description, str(path))
    write_dump(path, description, worker.tensors, blocks, worker=info, whole_cache=whole_cache)
    return path


def write_set(workers: list[kb.Worker], folder: Path, role: str, **kw: bool) -> Path:
    for w in workers:
        write(w, folder / f"pp{w.pp_rank}-tp{w.tp_rank}.safetensors", role, **kw)
    return folder


def metadata(path: Path) -> dict[str, str]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size])["__metadata__"]


def set_metadata(path: Path, key: str, value: object) -> None:
    """Rewrite one metadata key of a dump, the header grown by whole 64-byte steps so
    that the tensors keep their alignment."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header["__metadata__"][key] = json.dumps(value, separators=(",", ":"))
    text = json.dumps(header, separators=(",", ":")).encode()
    new_size = size + max(0, -(-(len(text) - size) // 64) * 64)
    path.write_bytes(struct.pack("<Q", new_size) + text.ljust(new_size) + raw[8 + size :])


def checksums(record: object) -> dict:
    """A record's JSON without where it was read from (its workers' sources)."""
    data = record_to_json(record)
    for worker in data["workers"]:
        worker.pop("source")
    return data


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvaudit", *map(str, args)], capture_output=True, text=True
    )


# Checksums.


@pytest.mark.parametrize("tp_size", [1, 2])
def test_one_space_and_two_spaces_checksum_alike_and_as_the_reference(
    tmp_path: Path, tp_size: int
) -> None:
    requests, workers = build(tp_size)
    split = [two_spaces(w) for w in workers]
    assert split[0].description["groups"][1]["num_blocks"] == SPACE
    one = checksum_dump_set(open_dump_set([write_set(workers, tmp_path / "one", "consumer")]))
    listed = write_set(split, tmp_path / "listed", "consumer")
    whole = write_set(split, tmp_path / "whole", "consumer", whole_cache=True)
    meta = metadata(listed / "pp0-tp0.safetensors")
    blocks = json.loads(meta["kvaudit.blocks"])
    assert set(blocks) == {"0", "1"} and max(blocks["1"]) < SPACE
    assert "kvaudit.blocks" not in metadata(whole / "pp0-tp0.safetensors")
    expected = checksums(one)
    for folder in (listed, whole):
        dump_set = open_dump_set([folder])
        assert dump_set.dumps[0].per_group
        assert checksums(checksum_dump_set(dump_set)) == expected
        # Batches of a few rows (space by space), and the torch path, agree.
        small = checksum_dump_set(dump_set, batch_bytes=600)
        assert checksums(small) == expected
        staged = checksum_dump_set(dump_set, backend="torch", batch_bytes=600)
        assert checksums(staged) == expected
    for gid in (0, 1):
        er.assert_matches(one, MODEL, gid, requests, workers, tp_size)
        er.assert_matches(
            checksum_dump_set(open_dump_set([listed])), MODEL, gid, requests, split, tp_size
        )


def test_live_checksummer_takes_each_groups_space() -> None:
    requests, workers = build()
    (worker,) = [two_spaces(w) for w in workers]
    description = parse_description(worker.description, "live")
    assert description.blocks_of(0) == 64 and description.blocks_of(1) == SPACE
    summer = Checksummer(description, worker.tensors)
    assert summer.group_rows == {0: 64, 1: SPACE}
    blocks = {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in worker.requests.items()}
    record = summer.checksum(blocks)
    for gid in (0, 1):
        er.assert_matches(record, MODEL, gid, requests, [worker], 1)
    # A block id past the window group's space is refused for that group.
    start, _ = worker.requests["req-a"][1][1]
    bad = {"req-a": RequestBlocks(22, {1: (start, [SPACE, 0, 1])})}
    with pytest.raises(Exception, match=rf"block id {SPACE} is not in the cache \(0..15\)"):
        summer.checksum(bad)


def test_description_round_trips_a_groups_space() -> None:
    _, workers = build()
    data = two_spaces(workers[0]).description
    description = parse_description(data, "d")
    from kvaudit.description import description_to_dict

    again = description_to_dict(description)
    assert again["groups"][1]["num_blocks"] == SPACE
    assert "num_blocks" not in again["groups"][0]
    assert parse_description(again, "again") == description
    # A group without a space of its own serializes as before: no key.
    plain = description_to_dict(parse_description(workers[0].description, "p"))
    assert all("num_blocks" not in group for group in plain["groups"])


# Diff, locate, numeric, corrupt.


def test_diff_locates_a_fault_in_the_second_groups_space(tmp_path: Path) -> None:
    _, workers = build()
    producer = write_set(workers, tmp_path / "producer", "producer")
    consumer = write_set([two_spaces(w) for w in workers], tmp_path / "consumer", "consumer")
    clean = cli("diff", producer, consumer, "-q", "--device", "cpu")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    dump = consumer / "pp0-tp0.safetensors"
    bad = tmp_path / "bad" / "pp0-tp0.safetensors"
    bad.parent.mkdir()
    position = WINDOW_SPANS["req-a"][0] + 1
    fault = corrupt_dump(
        dump, bad, request_id="req-a", group_id=1, position=position, layer=WINDOW2, mode="flip"
    )
    assert {change.layer for change in fault.changes} == {WINDOW2}
    done = cli("diff", producer, bad.parent, "-q", "--device", "cpu", "--format", "json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    failed = [
        (rid, gid, group["mismatched_positions"])
        for rid, request in report["requests"].items()
        for gid, group in request["groups"].items()
        if group["mismatched_positions"]
    ]
    assert failed == [("req-a", "1", [position])]
    located = report["requests"]["req-a"]["groups"]["1"]["located"]
    assert {(item["layer"], item["position"]) for item in located} == {(WINDOW2, position)}
    assert [(item["group"], item["kind"]) for item in report["diagnosis"]] == [(1, "bit_flip")]
    numeric = cli("diff", producer, bad.parent, "-q", "--device", "cpu", "--numeric")
    assert numeric.returncode == 1, numeric.stderr
    assert WINDOW2 in numeric.stdout


def test_corrupt_plants_into_the_groups_own_rows(tmp_path: Path) -> None:
    _, workers = build()
    dump_path = write(two_spaces(workers[0]), tmp_path / "c.safetensors", "consumer")
    dump = open_dump(dump_path)
    start, ids = dump.requests["req-b"].groups[1]
    block_id = ids[1]
    row = dump.row_of(block_id, 1)
    assert row == dump.space(1).block_ids.index(block_id)
    out = tmp_path / "out.safetensors"
    corrupt_dump(
        dump_path, out, request_id="req-b", group_id=1, position=start + 1, layer=WINDOW,
        mode="zero",
    )  # fmt: skip
    after = open_dump(out)
    # Compared as integers (random bytes make NaNs of bfloat16).
    before_a = np.asarray(dump.layer_arrays[WINDOW])
    after_a = np.asarray(after.layer_arrays[WINDOW])
    axis = _n_axis(workers[0], WINDOW)
    differs = np.moveaxis(before_a != after_a, axis, 0).reshape(before_a.shape[axis], -1)
    changed_rows = sorted({int(i) // 2 for i in np.flatnonzero(differs.any(axis=1))})
    assert changed_rows == [row]
    assert not np.asarray(after_a).take(range(2 * row, 2 * row + 2), axis=axis).any()
    for name in (FULL, FULL2, WINDOW2):
        assert np.array_equal(dump.layer_arrays[name], after.layer_arrays[name])


# Bad input: one line naming the file, exit 2.


def _unused(ids: list[int]) -> int:
    return min(set(range(64)) - set(ids))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: {**b, "7": []}, "group 7 is not a group of the cache description"),
        (lambda b: {**b, "1": list(range(SPACE + 1))}, "more than the 16 blocks of group 1"),
        (lambda b: {**b, "1": [SPACE]}, "kvaudit.blocks.1[0]: expected a block id from 0 to 15"),
        (lambda b: {**b, "1": "x"}, "kvaudit.blocks.1: expected a list of block ids"),
        (lambda b: {**b, "0": [*b["0"], _unused(b["0"])]}, "expected shape"),
    ],
    ids=["unknown group", "too long", "past the space", "not a list", "rows disagree"],
)
def test_bad_group_blocks_are_one_line_errors(tmp_path: Path, change, message: str) -> None:
    _, workers = build()
    path = write(two_spaces(workers[0]), tmp_path / "bad.safetensors", "consumer")
    blocks = json.loads(metadata(path)["kvaudit.blocks"])
    set_metadata(path, "kvaudit.blocks", change(blocks))
    done = cli("checksum", path, "-q", "--device", "cpu")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_tensor_whose_rows_disagree_with_its_groups_space(tmp_path: Path) -> None:
    _, workers = build()
    worker = two_spaces(workers[0])
    tensors = dict(worker.tensors)
    # Group 1's layer given with the top-level space's rows: not its group's.
    tensors[WINDOW] = workers[0].tensors[WINDOW]
    bad = kb.Worker(0, 1, 0, 1, worker.description, tensors, worker.requests)
    with pytest.raises(Exception, match=r"layer|tensor") as error:
        write(bad, tmp_path / "w.safetensors", "consumer")
    assert "\n" not in str(error.value) and "blocks" in str(error.value)
    # A whole-cache dump of two spaces read under a description of one: group 1's N axis
    # disagrees with its rows.
    whole = write(worker, tmp_path / "whole.safetensors", "consumer", whole_cache=True)
    config = tmp_path / "one.json"
    config.write_text(json.dumps(workers[0].description))
    done = cli("checksum", whole, "-c", config, "-q", "--device", "cpu")
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and str(whole) in line and WINDOW in line, line


# The live agent.


def test_live_agent_serves_a_worker_of_two_spaces(tmp_path: Path) -> None:
    import threading

    from kvaudit.live import Agent
    from kvaudit.sources.socket_source import dump_requests

    _, workers = build()
    producer = write_set(workers, tmp_path / "producer", "producer")
    (worker,) = [two_spaces(w) for w in workers]
    description = parse_description(worker.description, "live")
    tensors = {name: tensor.clone() for name, tensor in worker.tensors.items()}

    def tables() -> dict[str, RequestBlocks]:
        return {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in worker.requests.items()}

    folder = Path(tempfile_dir())
    socket = folder / "w.sock"
    served = Agent(str(socket), description, tensors, tables, lock=threading.Lock(), timeout=5.0)
    try:
        live = f"live:{socket}"
        same = cli("diff", producer, live, "-q", "--device", "cpu")
        assert same.returncode == 0, same.stdout + same.stderr
        want = checksums(checksum_dump_set(open_dump_set([producer])))
        got = cli("checksum", live, "-q", "--device", "cpu", "--format", "json")
        assert got.returncode == 0, got.stderr
        data = json.loads(got.stdout)
        assert data["requests"] == want["requests"]
        dumped = tmp_path / "dumped"
        dumped.mkdir()
        (path,) = dump_requests(live, dumped)
        dump = open_dump(path)
        assert dump.per_group and dump.num_rows == {0: 10, 1: 5}
        again = checksums(checksum_dump_set(open_dump_set([dumped])))
        assert again["requests"] == want["requests"]
        # A fault in the window group's own rows: fetched from the agent and located.
        start, ids = worker.requests["req-a"][1][1]
        cache = tensors[WINDOW2]
        axis = _n_axis(worker, WINDOW2)
        cells = cache.select(axis, ids[1] * 2).view(torch.uint8)
        cells.view(-1)[3] ^= 1
        bad = cli("diff", producer, live, "-q", "--device", "cpu", "--format", "json")
        assert bad.returncode == 1, bad.stderr
        report = json.loads(bad.stdout)["requests"]
        assert report["req-a"]["groups"]["1"]["mismatched_positions"] == [start + 1]
        assert not report["req-a"]["groups"]["0"]["mismatched_positions"]
        located = report["req-a"]["groups"]["1"]["located"]
        assert {item["layer"] for item in located} == {WINDOW2}
    finally:
        served.close()
        for leftover in folder.iterdir():
            leftover.unlink()
        folder.rmdir()


def tempfile_dir() -> str:
    import tempfile

    # A short path: unix socket paths are limited to about 100 bytes.
    return tempfile.mkdtemp(prefix="kva-", dir="/tmp")


def test_stored_checksums_need_one_block_space(tmp_path: Path) -> None:
    from kvaudit.core.errors import KvauditError

    _, workers = build()
    worker = two_spaces(workers[0])
    blocks = {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in worker.requests.items()}
    path = tmp_path / "s.safetensors"
    with pytest.raises(KvauditError, match="need one block space for every group"):
        write_dump(
            path,
            parse_description(worker.description, "d"),
            worker.tensors,
            blocks,
            worker=WorkerInfo(0, 1, 0, 1, "offload", "t"),
            stored_checksums=np.zeros(64, dtype=np.int64),
        )
    assert not path.exists()
