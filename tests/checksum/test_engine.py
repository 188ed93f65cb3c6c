"""The checksum engine (torch CPU path) against the tests' independent numpy reference.

Every case builds a model's global KV, lets ``kvbuild`` shard, page and lay it out as each
worker of an engine holds it, runs ``Checksummer`` on every worker, sums the workers with
``combine_workers`` and compares with ``reference.block_checksums`` per replica class.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import engine_runs
from helpers import kvbuild as kb
from helpers import reference as ref
from helpers.engine_runs import (
    ALL_LAYOUTS,
    INDEXER3,
    L0,
    L1,
    L2,
    L3,
    MIXER,
    assert_matches,
    attn_model,
    build,
    check,
    checksummers,
    columns,
    mamba_model,
    run,
)

from kvaudit import Checksummer
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description


@pytest.fixture(autouse=True, params=["numpy", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every engine test runs on both CPU backends: each must equal the reference."""
    monkeypatch.setattr(engine_runs, "BACKEND", request.param)
    return request.param


# The reference itself.


def one_layer_group(number: int, cells: np.ndarray, block_size: int = 2) -> ref.Group:
    return ref.Group(block_size, (ref.Layer(f"model.layers.{number}.attn", cells),))


def words(values: list[list[list[int]]]) -> np.ndarray:
    """uint8 cells from 8-byte words ``[tokens][heads][pieces]``."""
    return np.array(values, dtype="<u8").view(np.uint8).reshape(len(values), len(values[0]), -1)


def test_reference_by_hand() -> None:
    # One piece of one head of layer 0: m = 1, j = t.
    group = one_layer_group(0, words([[[3]], [[5]], [[7]]]))
    assert ref.slow_block_checksum(group, 3, 0) == 3 * 1 + 5 * 3
    assert int(ref.block_checksums(group, 3)[1][1]) == 7 * 5
    # Past num_tokens counts nothing.
    assert int(ref.block_checksums(group, 2, 0, 2)[1][1]) == 0
    assert int(ref.block_checksums(group, 1)[1][0]) == 3
    # Layer 1, head 1, two pieces: m = 2 * (65536 + 1) + 1, j = 2t + p.
    cells = words([[[0, 0], [2, 9]], [[0, 0], [4, 1]]] * 2)
    group = one_layer_group(1, cells)
    m = 2 * (65536 + 1) + 1
    by_request = [int(x) for x in ref.block_checksums(group, 4)[1]]
    assert by_request == [m * (2 * 1 + 9 * 3 + 4 * 5 + 1 * 7), m * (2 * 9 + 9 * 11 + 4 * 13 + 15)]
    # Block numbering restarts j at each block's first token.
    by_block = [int(x) for x in ref.block_checksums(group, 4, positions="block")[1]]
    assert by_block == [by_request[0], by_request[0]]
    # Wrap-around modulo 2**64.
    group = one_layer_group(0, words([[[2**64 - 1]], [[0]]]))
    assert int(ref.block_checksums(group, 2)[1][0]) == 2**64 - 1
    group = ref.Group(2, (ref.Layer("model.layers.0.attn", words([[[0], [2**64 - 1]]])),))
    assert int(ref.block_checksums(group, 1)[1][0]) == (3 * (2**64 - 1)) % 2**64


def test_reference_states_by_hand() -> None:
    # Unsplit: one cell per position at token b*B; counted while v_b > 0.
    cells = words([[[1]], [[2]], [[4]]])
    group = ref.Group(4, (ref.UnsplitState("model.layers.2.mixer", cells),))
    m = 2 * 2 * 65536 + 1
    got = ref.block_checksums(group, 9, 0, 4)[1]
    assert [int(x) for x in got] == [m * 1, m * 2 * 9, m * 4 * 17, 0]
    # Split: rows are heads across states; 2-byte elements zero-extended.
    s0 = np.array([[[1, 2], [3, 0xFFFF]]], dtype=np.uint16)  # global rows 2, cols 2
    s1 = np.array([[[5], [6], [7]]], dtype=np.uint32)  # rows 3 along axis 0
    group = ref.Group(
        4,
        (ref.SplitState("model.layers.0.mixer", (s0, s1), (1, 0), (((1, 1), (1, 2)), ((3, 1),))),),
    )
    got = ref.block_checksums(group, 1)
    # s0 split on axis 1: row 0 = column 0 = [1, 3], row 1 = [2, 0xFFFF].
    assert int(got[1][0]) == 1 * (1 * 1 + 3 * 3) + 5 * 5 + 7 * 6 + 9 * 7
    assert int(got[2][0]) == 3 * (2 * 1 + 0xFFFF * 3)


def mixed_group(seed: int) -> ref.Group:
    rng = np.random.default_rng(seed)

    def cells(*shape: int) -> np.ndarray:
        return rng.integers(0, 256, shape, dtype=np.uint8)

    split = ref.SplitState(
        "model.layers.5.mixer",
        (rng.integers(0, 2**16, (4, 3, 6), dtype=np.uint16),),
        (1,),
        (((4, 1), (2, 2)),),
    )
    return ref.Group(
        4,
        (
            ref.Layer(L0, cells(14, 3, 16), 1, (L2,)),
            ref.Layer(L3, cells(14, 2, 8), 2),
            ref.Layer(INDEXER3, cells(14, 1, 24), 4),
            ref.UnsplitState("model.layers.4.mixer", cells(4, 2, 16)),
            split,
        ),
    )


@pytest.mark.parametrize("positions", ["request", "block"])
def test_reference_vectorised_equals_loops(positions: str) -> None:
    group = mixed_group(3)
    fast = ref.total(ref.block_checksums(group, 14, 0, 5, positions))
    slow = [ref.slow_block_checksum(group, 14, b, positions) for b in range(5)]
    assert [int(x) for x in fast] == slow
    assert slow[4] == 0


def test_reference_heads_of_one_module_are_consecutive() -> None:
    heads = {(p.number, p.first_head, p.pieces.shape[1]) for p in ref.group_slices(mixed_group(1))}
    assert (3, 0, 2) in heads and (3, 2, 1) in heads
    assert (5, 0, 4) in heads and (5, 4, 2) in heads


@pytest.mark.parametrize("layout", [*ALL_LAYOUTS, "NTC"])
@pytest.mark.parametrize("kernel", [8, 2])
def test_builder_round_trip(layout: str, kernel: int) -> None:
    heads = 1 if "H" not in layout else 4
    model = attn_model(heads=heads, layers=1)
    physical = {"NTHC": "NHTC", "KNTHD": "NKTHD", "NTHD": "NHTD"}
    engine = kb.Engine(
        tp_size=1, layouts={0: layout}, kernel_block_sizes={0: kernel}, physical=physical
    )
    requests, workers = build(model, engine, 21)
    (worker,) = workers
    _, ids = worker.requests["req-1"][1][0]
    tensor = worker.tensors[L0]
    got = kb.gather_cells(tensor, layout, 8, ids)
    np.testing.assert_array_equal(got[:21], requests["req-1"].data[L0])
    rows = kb.slot_rows(worker, L0, ids[2], 3, heads - 1)
    cell = np.concatenate([row.numpy() for row in rows])
    np.testing.assert_array_equal(cell, requests["req-1"].data[L0][19, heads - 1])


# Layouts, TP, PP.


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_every_layout(layout: str) -> None:
    check(attn_model(layout=layout), kb.Engine(tp_size=2, seed=7))


@pytest.mark.parametrize(
    ("layout", "physical"),
    [("NTHC", "NHTC"), ("NHTC", "HNTC"), ("KNTHD", "NKTHD"), ("NKHTD", "KNTHD"), ("NTHD", "HNTD")],
)
def test_non_contiguous_live_tensors(layout: str, physical: str) -> None:
    engine = kb.Engine(tp_size=2, layouts={0: layout}, physical={layout: physical})
    requests, workers = build(attn_model(), engine)
    first = workers[0].tensors[L0]
    assert not (first[0] if isinstance(first, tuple) else first).is_contiguous()
    assert_matches(run(workers), attn_model(), 0, requests, workers, 2)


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_tp_shards_sum_to_the_unsharded_value(tp_size: int) -> None:
    model = attn_model(heads=16, layers=2, layout="KNTHD")
    record = check(model, kb.Engine(tp_size=tp_size, seed=tp_size))
    # The whole model's value, computed on one unsharded worker, is the same.
    whole = check(model, kb.Engine(tp_size=1, seed=99))
    np.testing.assert_array_equal(
        record.requests["req-1"].groups[0].totals(), whole.requests["req-1"].groups[0].totals()
    )


@pytest.mark.parametrize(("pp_size", "tp_size"), [(2, 1), (2, 2), (4, 1), (3, 2)])
def test_pp_stages_sum_to_the_whole_model(pp_size: int, tp_size: int) -> None:
    model = attn_model(heads=4, layers=4, layout="NKTHD")
    engine = kb.Engine(tp_size=tp_size, pp_size=pp_size)
    requests, workers = build(model, engine)
    stages = {
        w.pp_rank: {
            e if isinstance(e, str) else e["name"] for e in w.description["groups"][0]["layers"]
        }
        for w in workers
    }
    assert len(stages) == pp_size and len(set.union(*stages.values())) == 4
    assert sum(len(names) for names in stages.values()) == 4
    assert_matches(run(workers), model, 0, requests, workers, tp_size)


@pytest.mark.parametrize(("heads", "model_kv_heads"), [(8, None), (2, 2)], ids=["mha", "gqa"])
def test_producer_tp2_nthc_equals_consumer_tp4_knhtd(
    heads: int, model_kv_heads: int | None
) -> None:
    model = attn_model(heads=heads, layers=3, model_kv_heads=model_kv_heads)
    requests = {"req-1": kb.make_request(model, 45, seed=5)}
    producer = kb.build_engine(model, requests, kb.Engine(tp_size=2, layouts={0: "NTHC"}, seed=1))
    consumer = kb.build_engine(
        model, requests, kb.Engine(tp_size=4, layouts={0: "KNHTD"}, seed=2, num_blocks=40)
    )
    assert producer[0].requests["req-1"][1][0][1] != consumer[0].requests["req-1"][1][0][1]
    sent = run(producer, "producer")
    received = run(consumer, "consumer")
    assert_matches(sent, model, 0, requests, producer, 2, "producer")
    assert_matches(received, model, 0, requests, consumer, 4, "consumer")
    np.testing.assert_array_equal(
        sent.requests["req-1"].groups[0].totals(), received.requests["req-1"].groups[0].totals()
    )


@pytest.mark.parametrize(
    ("layout", "block_size", "kernel"),
    [("NTHC", 8, 4), ("NKTHD", 8, 2), ("KNHTD", 8, 1), ("NTHD", 8, 1), ("NHTC", 16, 4)],
)
def test_kernel_block_splits(layout: str, block_size: int, kernel: int) -> None:
    model = attn_model(layout=layout, block_size=block_size)
    engine = kb.Engine(tp_size=2, kernel_block_sizes={0: kernel})
    record = check(model, engine, 37)
    whole = check(model, kb.Engine(tp_size=1, seed=3), 37)
    np.testing.assert_array_equal(
        record.requests["req-1"].groups[0].totals(), whole.requests["req-1"].groups[0].totals()
    )


# Replicas.


@pytest.mark.parametrize(
    ("heads", "tp_size", "model_kv_heads", "replicas"),
    [(2, 4, 2, 2), (1, 2, 1, 2), (2, 8, 2, 4), (2, 2, 2, 1), (1, 1, None, 1)],
)
def test_gqa_replicas(heads: int, tp_size: int, model_kv_heads: int | None, replicas: int) -> None:
    model = attn_model(heads=heads, model_kv_heads=model_kv_heads, layout="NKTHD")
    assert kb.replicas(model.groups[0].layers[0], tp_size) == replicas
    record = check(model, kb.Engine(tp_size=tp_size), role="consumer")
    assert {key[0] for key in columns(record, "req-1", 0)} == {replicas}
    producer = check(model, kb.Engine(tp_size=tp_size, seed=4), role="producer")
    np.testing.assert_array_equal(
        producer.requests["req-1"].groups[0].totals(), record.requests["req-1"].groups[0].totals()
    )


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("layout", ["NTC", "NTHC"])
def test_mla_is_held_whole_by_every_rank(tp_size: int, layout: str) -> None:
    model = attn_model(heads=1, head_size=16, type="mla", layout=layout, dtype="float8_e4m3fn")
    record = check(model, kb.Engine(tp_size=tp_size), role="consumer")
    assert set(columns(record, "req-1", 0)) == {(tp_size, r) for r in range(tp_size)}
    producer = check(model, kb.Engine(tp_size=tp_size, seed=6), role="producer")
    assert set(columns(producer, "req-1", 0)) == {(tp_size, 0)}


def test_consumer_replicas_each_equal_replica_zero() -> None:
    # A consumer's every (R, r) column, summed over its workers, equals (R, 0).
    model = kb.Model(
        (
            kb.GroupModel(
                0,
                (
                    kb.Attn(L0, heads=8, head_size=8),
                    kb.Attn(L1, heads=2, head_size=8, max_tp_shards=2),
                    kb.Attn(L2, heads=1, head_size=32, type="mla", layout="NTC"),
                ),
                layout="NKTHD",
            ),
        ),
    )
    record = check(model, kb.Engine(tp_size=4), role="consumer")
    got = columns(record, "req-1", 0)
    assert set(got) == {(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)}
    for (r, i), values in got.items():
        np.testing.assert_array_equal(values, got[r, 0], err_msg=f"({r}, {i})")


@pytest.mark.parametrize(
    ("heads", "max_tp_shards", "tp_size", "replicas"),
    [(4, 2, 4, 2), (4, 1, 2, 2), (2, 1, 4, 4), (8, 8, 4, 1), (4, 2, 1, 1)],
)
def test_max_tp_shards(heads: int, max_tp_shards: int, tp_size: int, replicas: int) -> None:
    model = attn_model(heads=heads, max_tp_shards=max_tp_shards, layout="KNTHD")
    assert kb.replicas(model.groups[0].layers[0], tp_size) == replicas
    record = check(model, kb.Engine(tp_size=tp_size))
    assert {key[0] for key in columns(record, "req-1", 0)} == {replicas}
    check(model, kb.Engine(tp_size=tp_size, seed=5), role="producer")


# Shared caches, several caches per layer, drafters.


@pytest.mark.parametrize("mode", ["description", "tensor"])
@pytest.mark.parametrize("alias_first", [False, True], ids=["alias-after", "alias-before"])
def test_kv_sharing_counted_once_under_the_lowest_layer(mode: str, alias_first: bool) -> None:
    # alias-before: layer 0 aliases layer 3's cache, which is counted under layer 0.
    target = kb.Attn(L3 if alias_first else L0, heads=4, head_size=8)
    alias = dataclasses.replace(target, name=L0 if alias_first else L3, shares=target.name)
    layers = (alias, kb.Attn(L1, heads=4, head_size=8), target)
    if not alias_first:
        layers = (target, kb.Attn(L1, heads=4, head_size=8), alias)
    model = kb.Model((kb.GroupModel(0, layers, layout="NKTHD"),))
    engine = kb.Engine(tp_size=2, share_mode=mode)
    requests, workers = build(model, engine)
    if mode == "tensor":
        assert workers[0].tensors[L0] is workers[0].tensors[L3]
    else:
        assert alias.name not in workers[0].tensors
    assert_matches(run(workers), model, 0, requests, workers, 2)
    group = kb.reference_group(model, 0, requests["req-1"], 2)
    owners = [ref.layer_number(c.name) for c in group.caches]
    assert sorted(owners) == sorted([ref.layer_number(target.name), 1])
    assert {p.number for p in ref.group_slices(group)} == {0, 1}


@pytest.mark.parametrize("listed_first", ["attn", "indexer"])
@pytest.mark.parametrize("attn_type", ["full_attention", "mla"])
@pytest.mark.parametrize("latent_layout", ["NTC", "NTHC"])
def test_several_caches_in_one_layer_module(
    listed_first: str, attn_type: str, latent_layout: str
) -> None:
    # The indexer's head follows the attention's last global head (name order).
    if attn_type == "mla":
        attn = kb.Attn(L3, heads=1, head_size=32, type="mla", layout=latent_layout)
    else:
        attn = kb.Attn(L3, heads=4, head_size=8)
    indexer = kb.Attn(
        INDEXER3, heads=1, head_size=16, type="mla", dtype="uint8", layout=latent_layout
    )
    pair = (attn, indexer) if listed_first == "attn" else (indexer, attn)
    layers = (kb.Attn(L0, heads=4, head_size=8), *pair, kb.Attn(L2, heads=4, head_size=8))
    model = kb.Model((kb.GroupModel(0, layers, layout="NKTHD"),))
    check(model, kb.Engine(tp_size=2))
    slices = ref.group_slices(kb.reference_group(model, 0, kb.make_request(model, 4, 0), 2))
    indexer_head = next(p.first_head for p in slices if p.pieces.shape[2] == 2)
    assert indexer_head == (1 if attn_type == "mla" else 4)


def test_drafter_layers_are_left_out() -> None:
    draft = "model.layers.4.self_attn.attn"
    base = attn_model(heads=4, layers=3)
    layers = (*base.groups[0].layers, kb.Attn(draft, heads=4, head_size=8))
    with_draft = dataclasses.replace(kb.replace_layers(base, 0, layers), draft_layers=(draft,))
    engine = kb.Engine(tp_size=2)
    requests, workers = build(with_draft, engine)
    assert draft in workers[0].tensors and workers[0].description["draft_layers"] == [draft]
    record = run(workers)
    assert_matches(record, with_draft, 0, requests, workers, 2)
    # The same KV without the drafter gives the same checksums and fingerprint.
    plain = {
        rid: kb.RequestKV(r.num_tokens, {k: v for k, v in r.data.items() if k != draft})
        for rid, r in requests.items()
    }
    workers_plain = kb.build_engine(base, plain, engine)
    np.testing.assert_array_equal(
        run(workers_plain).requests["req-1"].groups[0].totals(),
        record.requests["req-1"].groups[0].totals(),
    )
    assert checksummers(workers)[0].fingerprints == checksummers(workers_plain)[0].fingerprints


# Mamba states.


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize(
    ("tp_replicated", "checksummed"), [(False, 2), (True, 2), (False, 1), (True, 1)]
)
def test_unsplit_states(tp_size: int, tp_replicated: bool, checksummed: int) -> None:
    model = mamba_model(tp_replicated, checksummed)
    record = check(model, kb.Engine(tp_size=tp_size), 29)
    replicas = tp_size if tp_replicated else 1
    assert {key[0] for key in columns(record, "req-1", 0)} == {replicas}
    check(model, kb.Engine(tp_size=tp_size, seed=8), 29, role="producer")


def test_unsplit_states_ignore_uncovered_states() -> None:
    model = mamba_model(checksummed=1)
    requests, workers = build(model, kb.Engine())
    before = run(workers)
    # Rewrite the third state of the same KV: only the first state is covered.
    data = requests["req-1"].data
    for name in data:
        data[name][..., 48:] ^= 0x5A
    after = run(kb.build_engine(model, requests, kb.Engine(seed=11)))
    np.testing.assert_array_equal(
        before.requests["req-1"].groups[0].totals(), after.requests["req-1"].groups[0].totals()
    )


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
@pytest.mark.parametrize(("state_dtype", "state_rows"), [("uint8", 1), ("int32", 1), ("int16", 2)])
def test_split_states_sum_over_tp(tp_size: int, state_dtype: str, state_rows: int) -> None:
    model = mamba_model(split=True)
    engine = kb.Engine(tp_size=tp_size, state_dtype=state_dtype, state_rows=state_rows)
    record = check(model, engine, 29)
    check(model, kb.Engine(tp_size=tp_size, seed=3), 29, role="producer")
    whole = check(model, kb.Engine(tp_size=1, seed=12), 29)
    np.testing.assert_array_equal(
        record.requests["req-1"].groups[0].totals(), whole.requests["req-1"].groups[0].totals()
    )


def test_states_counted_once_per_block() -> None:
    # A state's value depends on v_b > 0 only: positions with tokens count, the next does not.
    model = mamba_model(split=True)
    requests, workers = build(model, kb.Engine(tp_size=2), 17, positions={"req-1": {0: (1, 3)}})
    record = run(workers)
    assert_matches(record, model, 0, requests, workers, 2)
    totals = record.requests["req-1"].groups[0].totals()
    assert totals[0] != 0 and totals[1] != 0 and totals[2] == 0


# Sensitivity.


def swap(request: kb.RequestKV, kind: str) -> kb.RequestKV:
    data = {name: value.copy() for name, value in request.data.items()}
    if kind == "tokens":
        data[L0][[9, 10]] = data[L0][[10, 9]]
    elif kind == "heads-same-rank":
        data[L1][:, [0, 1]] = data[L1][:, [1, 0]]
    elif kind == "heads-across-ranks":
        data[L1][:, [1, 2]] = data[L1][:, [2, 1]]
    else:
        data[L0], data[L1] = data[L1], data[L0]
    return kb.RequestKV(request.num_tokens, data)


@pytest.mark.parametrize("kind", ["tokens", "heads-same-rank", "heads-across-ranks", "layers"])
def test_swaps_change_the_value(kind: str) -> None:
    model = attn_model(heads=4, layers=2, layout="KNTHD")
    engine = kb.Engine(tp_size=2)
    requests, workers = build(model, engine)
    swapped = {"req-1": swap(requests["req-1"], kind)}
    workers_swapped = kb.build_engine(model, swapped, engine)
    before = run(workers).requests["req-1"].groups[0].totals()
    record = run(workers_swapped)
    assert_matches(record, model, 0, swapped, workers_swapped, 2)
    after = record.requests["req-1"].groups[0].totals()
    assert not np.array_equal(before, after)
    if kind == "tokens":  # tokens 9 and 10 are in block 1 only
        assert before[1] != after[1]
        np.testing.assert_array_equal(np.delete(before, 1), np.delete(after, 1))


@pytest.mark.parametrize("layout", ["NTHC", "KNHTD", "NTHD"])
def test_blind_past_num_tokens_but_not_to_a_bit_flip(layout: str) -> None:
    model = attn_model(heads=4, layers=2, layout=layout, block_size=8)
    engine = kb.Engine(tp_size=2, kernel_block_sizes={0: 4})
    # 29 tokens: position 3 holds 5, position 4 none.
    requests, workers = build(model, engine, 29, positions={"req-1": {0: (0, 5)}})
    sums = checksummers(workers)
    before = run(workers, sums=sums)
    assert_matches(before, model, 0, requests, workers, 2)
    _, ids = workers[0].requests["req-1"][1][0]
    rng = np.random.default_rng(0)
    for worker in workers:
        for name in (L0, L1):
            for slot in range(5, 8):
                for row in kb.slot_rows(worker, name, ids[3], slot, 1):
                    row.copy_(torch.from_numpy(rng.integers(0, 256, row.shape, dtype=np.uint8)))
            for row in kb.slot_rows(worker, name, ids[4], 0, 0):
                row.copy_(torch.from_numpy(rng.integers(0, 256, row.shape, dtype=np.uint8)))
    after = run(workers, sums=sums)
    np.testing.assert_array_equal(
        before.requests["req-1"].groups[0].values, after.requests["req-1"].groups[0].values
    )
    # One bit of a valid slot (the last token, on TP rank 1, in the V row if any).
    rows = kb.slot_rows(workers[1], L1, ids[3], 4, 0)
    rows[-1][-1] ^= 0x10
    flipped = run(workers, sums=sums).requests["req-1"].groups[0].totals()
    totals = before.requests["req-1"].groups[0].totals()
    assert flipped[3] != totals[3]
    np.testing.assert_array_equal(flipped[:3], totals[:3])


# Positions, block sizes, dtypes.


def test_block_size_additivity() -> None:
    # Four 4-token blocks sum to the 16-token block of another engine at the same positions.
    model = attn_model(heads=4, layers=2, block_size=4)
    requests = {"req-1": kb.make_request(model, 45, seed=2)}
    small = kb.build_engine(model, requests, kb.Engine(tp_size=1, seed=1))
    large = kb.build_engine(
        model, requests, kb.Engine(tp_size=2, block_sizes={0: 16}, layouts={0: "KNTHD"}, seed=2)
    )
    fine = run(small).requests["req-1"].groups[0].totals()
    coarse = run(large).requests["req-1"].groups[0].totals()
    assert len(fine) == 12 and len(coarse) == 3
    with np.errstate(over="ignore"):
        summed = fine.reshape(3, 4).sum(axis=1, dtype=np.uint64)
    np.testing.assert_array_equal(summed, coarse)


def test_block_numbering_matches_the_reference() -> None:
    model = kb.Model(
        (
            kb.GroupModel(0, attn_model(heads=4, layers=2).groups[0].layers, 8, 4, "NKHTD"),
            dataclasses.replace(mamba_model(split=True).groups[0], id=1),
        )
    )
    record = check(model, kb.Engine(tp_size=2), 29, positions="block", gids=(0, 1))
    assert record.positions == "block"
    request_numbered = check(model, kb.Engine(tp_size=2), 29, gids=(0, 1))
    first = record.requests["req-1"].groups[0].totals()
    np.testing.assert_array_equal(
        first[0], request_numbered.requests["req-1"].groups[0].totals()[0]
    )
    assert not np.array_equal(first, request_numbered.requests["req-1"].groups[0].totals())


@pytest.mark.parametrize(
    ("dtype", "head_size", "layout"),
    [
        ("float8_e4m3fn", 8, "KNTHD"),
        ("fp8_e4m3", 16, "NTHC"),
        ("float8_e5m2", 8, "NTHD"),
        ("float32", 2, "NKHTD"),
        ("float32", 6, "NTHC"),
        ("float16", 4, "NHTC"),
        ("int8", 8, "NTHC"),
    ],
)
def test_dtypes(dtype: str, head_size: int, layout: str) -> None:
    check(attn_model(dtype=dtype, head_size=head_size, layout=layout), kb.Engine(tp_size=2))


def test_several_requests_and_partial_block_lists() -> None:
    model = kb.Model(
        (
            kb.GroupModel(
                0,
                attn_model(heads=4, type="sliding_window", sliding_window=8).groups[0].layers,
                4,
            ),
            dataclasses.replace(
                mamba_model(tp_replicated=True, checksummed=2).groups[0], id=1, block_size=4
            ),
        )
    )
    tokens = {"a": 1, "b": 17, "c": 40, "z": 0}
    # b lists a sliding window's last blocks; c and z list blocks past their last token.
    positions = {
        "b": {0: (2, 3), 1: (4, 1)},
        "c": {0: (0, 12), 1: (3, 9)},
        "z": {0: (0, 1), 1: (0, 1)},
    }
    requests = {
        rid: kb.make_request(model, n, i, tp_size=2, block_size=4)
        for i, (rid, n) in enumerate(tokens.items())
    }
    workers = kb.build_engine(model, requests, kb.Engine(tp_size=2), positions)
    record = run(workers)
    for gid in (0, 1):
        assert_matches(record, model, gid, requests, workers, 2, block_size=4)
    assert record.requests["b"].groups[0].start == 2
    np.testing.assert_array_equal(record.requests["c"].groups[0].totals()[10:], [0, 0])
    np.testing.assert_array_equal(record.requests["z"].groups[1].values, [[0, 0]])


# Groups that cannot be checksummed.


def good_group() -> kb.GroupModel:
    return kb.GroupModel(
        0, (kb.Attn(L0, heads=16, head_size=8), kb.Attn(L1, heads=16, head_size=8))
    )


UNSUPPORTED: dict[str, tuple[kb.GroupModel, dict]] = {
    "no-layer-number": (kb.GroupModel(1, (kb.Attn("lm_head.attn", heads=4),)), {}),
    "two-layer-numbers": (
        kb.GroupModel(1, (kb.Attn("model.layers.3.experts.1.attn", heads=4),)),
        {},
    ),
    "two-modules-one-number": (
        kb.GroupModel(1, (kb.Attn(L3, heads=4), kb.Attn("model.mtp.3.attn", heads=4))),
        {},
    ),
    "host-resident": (kb.GroupModel(1, (kb.Attn(L3, heads=4),), host_resident=True), {}),
    "cell-not-whole-words": (kb.GroupModel(1, (kb.Attn(L3, heads=4, head_size=3),)), {}),
    "kv-row-not-whole-words": (
        kb.GroupModel(1, (kb.Attn(L3, heads=4, head_size=2),), layout="KNTHD"),
        {},
    ),
    "one-head-per-rank-unknown": (kb.GroupModel(1, (kb.Attn(L3, heads=2),)), {}),
    "too-many-heads": (
        kb.GroupModel(1, (kb.Attn(L3, heads=65544, head_size=4, dtype="float16"),), 2),
        {"tp_size": 8},
    ),
    "too-many-heads-in-module": (
        kb.GroupModel(
            1,
            (
                kb.Attn(L3, heads=65536, head_size=4, dtype="float16"),
                kb.Attn(INDEXER3, head_size=16, type="mla", dtype="uint8", layout="NTC"),
            ),
            2,
        ),
        {"tp_size": 8},
    ),
    "no-state-checksummed": (
        kb.GroupModel(1, (kb.Mamba(MIXER.format(3), ((4, 8),), ("float16",), 0),)),
        {},
    ),
    "state-1-byte": (
        kb.GroupModel(
            1, (kb.Mamba(MIXER.format(3), ((4, 8),), ("uint8",), splits=((0, ((4, 4),)),)),)
        ),
        {},
    ),
    "state-8-byte": (
        kb.GroupModel(
            1, (kb.Mamba(MIXER.format(3), ((4, 2),), ("float64",), splits=((0, ((4, 4),)),)),)
        ),
        {},
    ),
    "state-rows-do-not-sum": (
        kb.GroupModel(
            1,
            (kb.Mamba(MIXER.format(3), ((2, 8),), ("float32",), splits=((1, ((8, 8),)),)),),
        ),
        {"segments": [[3, 1]]},
    ),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_groups_are_left_out_with_a_reason(case: str) -> None:
    bad, options = UNSUPPORTED[case]
    tp_size = options.get("tp_size", 2)
    model = kb.Model((good_group(), bad))
    engine = kb.Engine(tp_size=tp_size)
    requests, workers = build(model, engine, 5 if tp_size == 8 else 21)
    if "segments" in options:
        for worker in workers:
            worker.description["groups"][1]["spec"]["state_splits"][0]["segments"] = options[
                "segments"
            ]
    sums = checksummers(workers)
    for cs in sums:
        reason = cs.not_covered.get(1)
        assert isinstance(reason, str) and reason and "\n" not in reason, case
        assert 0 not in cs.not_covered
    record = run(workers, sums=sums)
    assert 1 not in record.requests["req-1"].groups
    assert_matches(record, model, 0, requests, workers, tp_size)


def test_groups_the_description_cannot_hold_are_reported_not_covered() -> None:
    # An engine's group its integration cannot describe: named, with why, in every record.
    model = kb.Model((good_group(),))
    requests, workers = build(model, kb.Engine(tp_size=2))
    reason = "its heads are packed into head slots"
    sums = [
        Checksummer(
            parse_description(w.description, "w"),
            w.tensors,
            tp_rank=w.tp_rank,
            tp_size=2,
            backend=engine_runs.BACKEND,
            left_out={4: reason},
        )
        for w in workers
    ]
    record = run(workers, sums=sums)
    assert [w.not_covered for w in record.workers] == [{4: reason}] * 2
    assert all(list(w.fingerprints) == [0] for w in record.workers)
    assert_matches(record, model, 0, requests, workers, 2)
    with pytest.raises(KvauditError, match="group 0 is left out, but the description holds it"):
        Checksummer(parse_description(workers[0].description, "w"), {}, left_out={0: reason})


@pytest.mark.parametrize("number", [2**47 - 1, 2**47, 2**63, 2**64 + 3])
def test_layer_numbers_past_int64(number: int) -> None:
    # m(L, h) wraps modulo 2**64 (checksum.md): a large layer number is a checksum too.
    layers = (kb.Attn(f"model.layers.{number}.self_attn.attn", heads=4), kb.Attn(L1, heads=4))
    check(kb.Model((kb.GroupModel(0, layers),)), kb.Engine(tp_size=2), 21)


def test_exactly_65536_heads_are_covered() -> None:
    layer = kb.Attn(L3, heads=65536, head_size=4, dtype="float16")
    model = kb.Model((kb.GroupModel(0, (layer,), block_size=2),))
    check(model, kb.Engine(tp_size=8), 3)


def test_transfer_false_group_is_not_checksummed() -> None:
    model = kb.Model((good_group(), kb.GroupModel(1, (kb.Attn(L3, heads=4),), transfer=False)))
    requests, workers = build(model, kb.Engine(tp_size=2))
    for worker in workers:
        for _, groups in worker.requests.values():
            groups.pop(1)
    record = run(workers)
    assert 1 not in record.requests["req-1"].groups
    assert_matches(record, model, 0, requests, workers, 2)


def test_transfer_false_group_blocks_are_ignored() -> None:
    model = kb.Model((good_group(), kb.GroupModel(1, (kb.Attn(L3, heads=4),), transfer=False)))
    requests, workers = build(model, kb.Engine(tp_size=2))
    record = run(workers)
    assert 1 not in record.requests["req-1"].groups
    assert_matches(record, model, 0, requests, workers, 2)


# Fingerprints through the checksummer.


def test_fingerprints_of_built_workers() -> None:
    draft = "model.layers.4.self_attn.attn"
    shared = dataclasses.replace(kb.Attn(L0, heads=4, dtype="float16"), name=L2, shares=L0)
    model = kb.Model(
        (
            kb.GroupModel(
                0,
                (
                    kb.Attn(L0, heads=4, dtype="float16"),
                    kb.Attn(L1, heads=1, head_size=16, type="mla", dtype="float8_e4m3fn"),
                    shared,
                    kb.Attn(draft, heads=4),
                ),
            ),
            dataclasses.replace(mamba_model(split=True).groups[0], id=1),
            dataclasses.replace(mamba_model(checksummed=2, numbers=(5, 6)).groups[0], id=2),
        ),
        draft_layers=(draft,),
    )
    want = {
        0: ref.fingerprint(
            [
                (L0, "FullAttentionSpec", "torch.float16"),
                (L1, "MLAAttentionSpec", "torch.float8_e4m3fn"),
                (L2, "FullAttentionSpec", "torch.float16"),
            ]
        ),
        1: ref.fingerprint(
            [
                (
                    MIXER.format(i),
                    "MambaSpec",
                    [((16, 4, 4), (3,)), ((8,), (4, 2))],
                    ["torch.bfloat16", "torch.float32"],
                )
                for i in (1, 3)
            ]
        ),
        2: ref.fingerprint(
            [
                (
                    MIXER.format(i),
                    "MambaSpec",
                    ((3, 8), (2, 4, 4)),
                    ["torch.bfloat16", "torch.float32"],
                )
                for i in (5, 6)
            ]
        ),
    }
    for tp_size in (1, 2):
        _, workers = build(model, kb.Engine(tp_size=tp_size))
        assert checksummers(workers)[-1].fingerprints == want
    # PP stages' fingerprints sum to the whole group's.
    _, workers = build(model, kb.Engine(pp_size=2))
    record = run(workers)
    for gid, value in want.items():
        assert record.requests["req-1"].groups[gid].fingerprint == value
