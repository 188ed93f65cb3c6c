"""Summing one engine's workers into a record, and the record's JSON and CSV forms."""

from __future__ import annotations

import copy
import json
import random
from collections import defaultdict

import numpy as np
import pytest

from kvaudit.core.errors import KvauditError
from kvaudit.formats import record_csv_rows, record_to_json
from kvaudit.records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    combine_workers,
)

MOD = 2**64
TP, PP = 2, 2
# Per stage and TP rank, the fingerprint each worker reports for group 0. Real workers
# of one stage agree; distinct values here show which worker's value is used.
FINGERPRINTS = {(0, 0): 2**64 - 3, (0, 1): 111, (1, 0): 10, (1, 1): 222}

# Reference: (request, group, position, replica key) -> python-int sum mod 2**64.
Reference = dict[tuple[str, int, int, tuple[int, int]], int]


def source(pp: int, tp: int) -> str:
    return f"engine/pp{pp}-tp{tp}.safetensors"


def make_worker(pp: int, tp: int, rng: random.Random, reference: Reference) -> WorkerRecord:
    """A worker with two requests: group 0 replicated as MLA (keys (1, 0) and (2, tp)),
    group 1 a sliding window whose held positions differ between workers."""
    requests: dict[str, RequestChecksums] = {}
    for request_id, num_tokens in (("req-a", 70), ("req-b", 20)):
        groups = {}
        layouts = {0: (16, 0, 5, [(1, 0), (2, tp)]), 1: (16, 2 - tp, 2 + tp, [(1, 0)])}
        if request_id == "req-b":
            layouts = {0: (16, 0, 2, [(1, 0), (2, tp)])}
        for gid, (block_size, start, count, keys) in layouts.items():
            # Large values, many with the top bit set, so that sums wrap.
            ints = [[rng.getrandbits(64) for _ in keys] for _ in range(count)]
            for i, row in enumerate(ints):
                for key, value in zip(keys, row, strict=True):
                    slot = (request_id, gid, start + i, key)
                    reference[slot] = (reference.get(slot, 0) + value) % MOD
            values = np.array(ints, dtype=np.uint64).reshape(count, len(keys))
            fingerprint = FINGERPRINTS[(pp, tp)] if gid == 0 else 1000 + pp
            groups[gid] = GroupChecksums(block_size, start, keys, values, fingerprint)
        requests[request_id] = RequestChecksums(num_tokens, groups)
    return WorkerRecord(
        worker=WorkerInfo(tp, TP, pp, PP, "consumer", "decode", source(pp, tp)),
        positions="request",
        fingerprints={0: FINGERPRINTS[(pp, tp)], 1: 1000 + pp},
        not_covered={2: "its KV heads are packed into head slots"},
        requests=requests,
    )


def make_set(seed: int = 0) -> tuple[list[WorkerRecord], Reference]:
    rng = random.Random(seed)
    reference: Reference = {}
    workers = [make_worker(pp, tp, rng, reference) for pp in range(PP) for tp in range(TP)]
    return workers, reference


def reference_of(workers: list[WorkerRecord]) -> Reference:
    """Python-int sums over the given workers, independent of the code under test."""
    sums: Reference = defaultdict(int)
    for worker in workers:
        for request_id, request in worker.requests.items():
            for gid, group in request.groups.items():
                for i, row in enumerate(group.values.tolist()):
                    for key, value in zip(group.replica_keys, row, strict=True):
                        slot = (request_id, gid, group.start + i, key)
                        sums[slot] = (sums[slot] + int(value)) % MOD
    return dict(sums)


def record_cells(record: Record) -> Reference:
    """Every (request, group, position, key) the record holds, with its value."""
    cells: Reference = {}
    for request_id, request in record.requests.items():
        for gid, group in request.groups.items():
            for i in range(group.count):
                for k, key in enumerate(group.replica_keys):
                    cells[(request_id, gid, group.start + i, key)] = int(group.values[i, k])
    return cells


def expected_cells(reference: Reference) -> Reference:
    """The reference with absent slots of each group's key x position grid filled with 0."""
    grid: dict[tuple[str, int], tuple[set, set]] = defaultdict(lambda: (set(), set()))
    for request_id, gid, position, key in reference:
        grid[(request_id, gid)][0].add(position)
        grid[(request_id, gid)][1].add(key)
    cells: Reference = {}
    for (request_id, gid), (positions, keys) in grid.items():
        for position in range(min(positions), max(positions) + 1):
            for key in keys:
                cells[(request_id, gid, position, key)] = reference.get(
                    (request_id, gid, position, key), 0
                )
    return cells


def test_combine_sums_every_worker_modulo_2_64() -> None:
    workers, reference = make_set()
    record = combine_workers(workers)
    assert record.complete
    assert record.missing_workers == []
    assert record.positions == "request"
    assert record_cells(record) == expected_cells(reference)
    group0 = record.requests["req-a"].groups[0]
    assert group0.replica_keys == [(1, 0), (2, 0), (2, 1)]
    assert (group0.start, group0.count, group0.block_size) == (0, 5, 16)
    group1 = record.requests["req-a"].groups[1]
    # Worker tp 0 holds positions 2..3, tp 1 holds 1..3: the union is 1..3.
    assert (group1.start, group1.count) == (1, 3)
    assert record.requests["req-a"].num_tokens == 70
    assert group0.values.dtype == np.uint64


def test_totals_sum_the_replica_zero_keys() -> None:
    workers, reference = make_set(1)
    record = combine_workers(workers)
    group = record.requests["req-a"].groups[0]
    expected = [
        (reference[("req-a", 0, p, (1, 0))] + reference[("req-a", 0, p, (2, 0))]) % MOD
        for p in range(5)
    ]
    assert group.totals().tolist() == expected


def test_fingerprint_sums_lowest_tp_rank_of_each_stage() -> None:
    workers, _ = make_set()
    record = combine_workers(workers)
    assert record.requests["req-a"].groups[0].fingerprint == (2**64 - 3 + 10) % MOD
    assert record.requests["req-a"].groups[1].fingerprint == 1000 + 1001
    without_tp0_stage0 = [w for w in workers if (w.worker.pp_rank, w.worker.tp_rank) != (0, 0)]
    partial = combine_workers(without_tp0_stage0)
    assert partial.requests["req-a"].groups[0].fingerprint == 111 + 10


def test_stage_without_the_group_counts_zero() -> None:
    workers, _ = make_set()
    for worker in workers:
        if worker.worker.pp_rank == 1:
            worker.fingerprints[0] = 0
    record = combine_workers(workers)
    assert record.requests["req-a"].groups[0].fingerprint == 2**64 - 3


def test_worker_order_does_not_matter() -> None:
    workers, _ = make_set(2)
    shuffled = workers[:]
    random.Random(5).shuffle(shuffled)
    first, second = combine_workers(workers), combine_workers(shuffled)
    assert record_cells(first) == record_cells(second)
    assert record_to_json(first)["requests"] == record_to_json(second)["requests"]


def test_incomplete_set_sums_the_workers_present() -> None:
    workers, _ = make_set(3)
    present = [w for w in workers if (w.worker.pp_rank, w.worker.tp_rank) != (1, 1)]
    record = combine_workers(present)
    assert not record.complete
    assert record.missing_workers == [(1, 1)]
    assert record_cells(record) == expected_cells(reference_of(present))
    assert [s.worker.source for s in record.workers] == [w.worker.source for w in present]


def test_request_held_by_some_workers_only() -> None:
    workers, _ = make_set(4)
    for worker in workers[1:]:
        del worker.requests["req-b"]
    record = combine_workers(workers)
    assert set(record.requests) == {"req-a", "req-b"}
    assert record_cells(record) == expected_cells(reference_of(workers))
    assert record.requests["req-b"].groups[0].replica_keys == [(1, 0), (2, 0)]


def test_duplicate_ranks_name_both_sources() -> None:
    workers, _ = make_set()
    duplicate = copy.deepcopy(workers[0])
    duplicate.worker = WorkerInfo(0, TP, 0, PP, "consumer", "decode", "elsewhere/rank0.st")
    with pytest.raises(KvauditError) as caught:
        combine_workers([*workers, duplicate])
    message = str(caught.value)
    assert source(0, 0) in message and "elsewhere/rank0.st" in message
    assert "\n" not in message


@pytest.mark.parametrize("size", ["tp_size", "pp_size"])
def test_disagreeing_sizes_name_both_sources(size: str) -> None:
    workers, _ = make_set()
    info = workers[3].worker
    sizes = {"tp_size": info.tp_size, "pp_size": info.pp_size, size: 4}
    workers[3].worker = WorkerInfo(
        info.tp_rank,
        sizes["tp_size"],
        info.pp_rank,
        sizes["pp_size"],
        info.role,
        source=info.source,
    )
    with pytest.raises(KvauditError, match=size) as caught:
        combine_workers(workers)
    assert source(0, 0) in str(caught.value) and source(1, 1) in str(caught.value)


def test_other_disagreements_raise() -> None:
    workers, _ = make_set()
    workers[2].positions = "block"
    with pytest.raises(KvauditError, match="positions"):
        combine_workers(workers)

    workers, _ = make_set()
    workers[1].requests["req-a"].num_tokens = 71
    with pytest.raises(KvauditError, match="req-a"):
        combine_workers(workers)

    workers, _ = make_set()
    workers[1].requests["req-a"].groups[0].block_size = 32
    with pytest.raises(KvauditError, match="block size"):
        combine_workers(workers)

    with pytest.raises(KvauditError):
        combine_workers([])


def test_json_shape_and_round_trip() -> None:
    workers, _ = make_set(6)
    record = combine_workers(workers[:3])
    data = record_to_json(record)
    assert data["format"] == "kvaudit.record/1"
    assert data["complete"] is False
    assert data["workers"][1] == {
        "source": source(0, 1),
        "tp_rank": 1,
        "tp_size": 2,
        "pp_rank": 0,
        "pp_size": 2,
        "role": "consumer",
        "fingerprints": {"0": f"{111:016x}", "1": f"{1000:016x}"},
        "not_covered": {"2": "its KV heads are packed into head slots"},
    }
    group = data["requests"]["req-a"]["groups"]["0"]
    assert group["replica_keys"] == [[1, 0], [2, 0], [2, 1]]
    assert group["fingerprint"] == f"{(2**64 - 3 + 10) % MOD:016x}"
    sums = reference_of(workers[:3])
    assert group["values"][4] == [
        f"{sums[('req-a', 0, 4, k)]:016x}" for k in [(1, 0), (2, 0), (2, 1)]
    ]
    total = (sums[("req-a", 0, 4, (1, 0))] + sums[("req-a", 0, 4, (2, 0))]) % MOD
    assert group["totals"][4] == f"{total:016x}"

    text = json.dumps(data)
    back = Record.from_json(json.loads(text), "saved.json")
    assert record_to_json(back) == data
    assert back.missing_workers == [(1, 1)]
    assert record_cells(back) == record_cells(record)
    assert back.workers[0].fingerprints == {0: 2**64 - 3, 1: 1000}


def test_engine_is_optional_when_reading() -> None:
    # Records hold exactly cli.md's worker keys; an "engine" key is still read.
    workers, _ = make_set()
    data = record_to_json(combine_workers(workers))
    assert all("engine" not in worker for worker in data["workers"])
    assert Record.from_json(data, "r.json").workers[0].worker.engine == ""
    data["workers"][0]["engine"] = "decode"
    assert Record.from_json(data, "r.json").workers[0].worker.engine == "decode"


def _group(data: dict) -> dict:
    return data["requests"]["req-a"]["groups"]["0"]


MUTATIONS = [
    ("format", lambda d: d.update(format="kvaudit.record/2")),
    ("positions", lambda d: d.update(positions="token")),
    ("complete", lambda d: d.pop("complete")),
    ("complete", lambda d: d.update(complete=False)),
    ("complete", lambda d: d.update(complete=1)),
    ("surplus", lambda d: d.update(surplus=1)),
    ("workers", lambda d: d.update(workers=[])),
    ("workers[0].tp_rank", lambda d: d["workers"][0].update(tp_rank=True)),
    ("workers[1].fingerprints", lambda d: d["workers"][1]["fingerprints"].update({"0": "12"})),
    ("workers[0].role", lambda d: d["workers"][0].update(role="observer")),
    ("workers", lambda d: d["workers"][3].update(tp_size=4)),
    ("workers", lambda d: d["workers"][3].update(tp_rank=0, pp_rank=0)),
    ('requests["req-a"].num_tokens', lambda d: d["requests"]["req-a"].update(num_tokens=-1)),
    ('requests["req-a"].groups["x"]', lambda d: d["requests"]["req-a"]["groups"].update(x={})),
    ('groups["0"].fingerprint', lambda d: _group(d).update(fingerprint="0" * 15 + "G")),
    (
        'groups["0"].values[1][2]',
        lambda d: _group(d)["values"][1].__setitem__(2, "ABCDEF0123456789"),
    ),
    ('groups["0"].values[0][0]', lambda d: _group(d)["values"][0].__setitem__(0, 5)),
    ('groups["0"].values[3]', lambda d: _group(d)["values"][3].pop()),
    ('groups["0"].totals[2]', lambda d: _group(d)["totals"].__setitem__(2, "0" * 16)),
    ('groups["0"].totals', lambda d: _group(d)["totals"].pop()),
    ('groups["0"].replica_keys[2]', lambda d: _group(d)["replica_keys"].__setitem__(2, [2, 2])),
    ('groups["0"].replica_keys[2]', lambda d: _group(d)["replica_keys"].__setitem__(2, [2, 0])),
    ('groups["0"].replica_keys', lambda d: _group(d).update(replica_keys=[], values=[[]] * 5)),
    ('groups["0"].block_size', lambda d: _group(d).pop("block_size")),
    ('groups["0"].start', lambda d: _group(d).update(start="0")),
]


@pytest.mark.parametrize(("path", "mutate"), MUTATIONS)
def test_from_json_rejects(path: str, mutate) -> None:
    workers, _ = make_set()
    data = record_to_json(combine_workers(workers))
    mutate(data)
    with pytest.raises(KvauditError) as caught:
        Record.from_json(data, "saved/record.json")
    message = str(caught.value)
    assert message.startswith("saved/record.json: ")
    assert path in message
    assert "\n" not in message


def test_from_json_rejects_a_non_object() -> None:
    with pytest.raises(KvauditError, match=r"bad\.json"):
        Record.from_json([], "bad.json")  # type: ignore[arg-type]


def test_csv_rows() -> None:
    workers, reference = make_set(8)
    record = combine_workers(workers)
    rows = record_csv_rows(record)
    assert rows[0] == ["request", "group", "position", "replica_key", "value"]
    body = rows[1:]
    # req-a: group 0 has 5 positions x (3 keys + total), group 1 has 3 x (1 + total);
    # req-b: group 0 has 2 x (3 + total).
    assert len(body) == 5 * 4 + 3 * 2 + 2 * 4
    first = {key: reference[("req-a", 0, 0, key)] for key in [(1, 0), (2, 0), (2, 1)]}
    total = (first[(1, 0)] + first[(2, 0)]) % MOD
    assert body[:4] == [
        ["req-a", "0", "0", "1:0", f"{first[(1, 0)]:016x}"],
        ["req-a", "0", "0", "2:0", f"{first[(2, 0)]:016x}"],
        ["req-a", "0", "0", "2:1", f"{first[(2, 1)]:016x}"],
        ["req-a", "0", "0", "total", f"{total:016x}"],
    ]
    assert ["req-a", "1", "1", "total", f"{reference[('req-a', 1, 1, (1, 0))]:016x}"] in body


def test_a_group_some_covering_workers_lack_is_partial() -> None:
    workers, _ = make_set(6)
    del workers[1].requests["req-b"]
    record = combine_workers(workers)
    assert record.complete
    assert record.requests["req-b"].groups[0].partial == (f"{source(0, 1)} does not hold it")
    # Group 1's workers hold different positions (tp 0: 2..3, tp 1: 1..3).
    partial = record.requests["req-a"].groups[1].partial
    assert partial is not None and partial.startswith("its workers hold different positions")
    assert f"{source(0, 1)}, {source(1, 1)} 1..3" in partial
    assert record.requests["req-a"].groups[0].partial is None
    assert [(rid, gid) for rid, gid, _ in record.partial_groups()] == [
        ("req-a", 1),
        ("req-b", 0),
    ]
    # A worker that does not cover the group is not expected to hold it.
    for worker in workers:
        if worker.worker.tp_rank == 1:
            worker.not_covered[1] = "its KV heads are packed into head slots"
    assert combine_workers(workers).requests["req-a"].groups[1].partial is None
    again = Record.from_json(json.loads(json.dumps(record_to_json(record))), "r.json")
    assert again.partial_groups() == record.partial_groups()
