"""Planting faults in dumps, and finding them again.

Each mode corrupts one worker's dump of the sets built in ``test_locate``; the test
checks, against the files decoded independently (safetensors and the tests' own layout
rules): the output differs from the input in exactly the bytes and cells the result
names, the cells changed the way the mode says, and ``locate_differences`` on the clean
producer and the corrupted consumer (or the other way round) names exactly the planted
layers, heads and tokens with the right first byte and errors.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import kvbuild as kb
from helpers.dumped_sets import (
    COMPARED,
    CONSUMER,
    L0,
    L1,
    L2,
    L3,
    MIXER,
    MODEL,
    PRODUCER,
    TOKENS,
    Sets,
    decode,
    decode_set,
    expected_located,
    with_file,
)

from kvaudit.core.errors import KvauditError
from kvaudit.corrupt import MODES, PlantedFault, corrupt_dump
from kvaudit.dumps import open_dump_set
from kvaudit.locate import locate_differences

# (mode, side, worker, request, group, position in the side's block size, layer, head, token)
CASES = [
    ("flip", "consumer", 1, "req-a", 0, 10, None, None, None),
    ("flip", "consumer", 0, "req-a", 1, 5, L3, None, 44),
    ("flip", "consumer", 2, "req-b", 2, 1, None, None, None),
    ("flip", "producer", 1, "req-a", 0, 2, L0, 3, None),
    ("zero", "consumer", 0, "req-a", 1, 5, None, None, None),
    ("zero", "consumer", 3, "req-a", 0, 2, L0, None, None),
    ("zero", "consumer", 1, "req-b", 2, 2, MIXER, None, None),
    ("swap-tokens", "consumer", 2, "req-a", 0, 3, L1, None, None),
    ("swap-tokens", "consumer", 0, "req-b", 1, 0, None, None, 7),
    ("swap-heads", "producer", 1, "req-a", 0, 1, L1, None, None),
    ("swap-heads", "consumer", 1, "req-a", 2, 4, None, 10, None),
    ("stale", "consumer", 0, "req-a", 0, 5, None, None, None),
    ("stale", "consumer", 1, "req-b", 1, 2, L2, None, None),
    ("stale", "consumer", 2, "req-a", 2, 0, None, None, None),
    ("shift", "consumer", 3, "req-b", 0, 7, None, None, None),
    ("shift", "producer", 2, "req-b", 1, 1, L3, None, None),
]


def group_block_size(side: str, group_id: int) -> int:
    engine = PRODUCER if side == "producer" else CONSUMER
    return engine.block_size(MODEL.group(group_id))


@pytest.mark.parametrize(
    ("mode", "side", "worker", "rid", "gid", "position", "layer", "head", "token"), CASES
)
def test_planted_fault_is_where_it_says_and_located(
    sets: Sets,
    tmp_path: Path,
    mode: str,
    side: str,
    worker: int,
    rid: str,
    gid: int,
    position: int,
    layer: str | None,
    head: int | None,
    token: int | None,
) -> None:
    dumped = sets.producer if side == "producer" else sets.consumer
    source = dumped.paths[worker]
    out = tmp_path / "corrupted.safetensors"
    result = corrupt_dump(
        source,
        out,
        request_id=rid,
        group_id=gid,
        position=position,
        layer=layer,
        head=head,
        token=token,
        mode=mode,
        seed=11,
    )

    # The file differs in exactly the bytes the result names.
    before_bytes = np.fromfile(source, dtype=np.uint8)
    after_bytes = np.fromfile(out, dtype=np.uint8)
    assert before_bytes.shape == after_bytes.shape
    described = [offset for start, end in result.byte_ranges for offset in range(start, end)]
    assert np.flatnonzero(before_bytes != after_bytes).tolist() == described

    # ... and in exactly the cells it names: (layer, global head, request position).
    w = dumped.workers[worker]
    before, after = decode(w, source), decode(w, str(out))
    changed = {key for key in before if not np.array_equal(before[key].data, after[key].data)}
    named = {
        (rid, change.layer, change.head, t)
        for change in result.changes
        for t in change.tokens + change.tokens_past_end
    }
    assert changed == named
    block_size = group_block_size(side, gid)
    first, end = position * block_size, (position + 1) * block_size
    num_tokens = TOKENS[rid]
    for change in result.changes:
        assert all(first <= t < min(end, num_tokens) for t in change.tokens)
        assert all(num_tokens <= t < end for t in change.tokens_past_end)
    assert result.tokens, "the fault must touch a valid token"
    if layer is not None:
        assert result.layers == [layer]
    if head is not None:
        assert head in result.heads
        assert mode == "swap-heads" or result.heads == [head]
    if token is not None:
        assert token in result.tokens
    check_mode(result, before, after, block_size, min(end, num_tokens))

    # Located: exactly the planted slices, with their first byte and errors.
    producer_paths, consumer_paths = sets.producer.paths, sets.consumer.paths
    producer_cells, consumer_cells = sets.producer_cells, sets.consumer_cells
    if side == "producer":
        producer_paths = with_file(sets.producer, worker, out)
        producer_cells = decode_set(sets.producer, producer_paths)
    else:
        consumer_paths = with_file(sets.consumer, worker, out)
        consumer_cells = decode_set(sets.consumer, consumer_paths)
    compared = COMPARED[gid]
    positions = sorted({t // compared for t in result.tokens})
    found = locate_differences(
        open_dump_set(producer_paths).dumps,
        open_dump_set(consumer_paths).dumps,
        rid,
        gid,
        positions,
        compared,
        num_tokens,
    )
    expected = expected_located(
        producer_cells, consumer_cells, rid, gid, positions, compared, num_tokens
    )
    assert found == expected
    assert found, "a planted fault is always found"
    replica = w.tp_rank % replica_count(result.layers[0], w.tp_size)
    direct = {(e.layer, e.head, tuple(e.tokens)) for e in found if not e.replica}
    planted = {
        (change.layer, change.head, tuple(change.tokens))
        for change in result.changes
        if change.tokens
    }
    if side == "producer" or replica == 0:
        assert direct == planted
    else:
        assert direct == set()
        assert {e.replica for e in found} == {replica}

    # The same seed plants the same fault.
    again = tmp_path / "again.safetensors"
    repeat = corrupt_dump(
        source,
        again,
        request_id=rid,
        group_id=gid,
        position=position,
        layer=layer,
        head=head,
        token=token,
        mode=mode,
        seed=11,
    )
    assert dataclasses.replace(repeat, out=str(out)) == result
    assert again.read_bytes() == out.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["again.safetensors", "corrupted.safetensors"]


def replica_count(name: str, tp_size: int) -> int:
    layer = MODEL.layer(name)
    if isinstance(layer, kb.Attn):
        return kb.replicas(layer, tp_size)
    return 1


def check_mode(
    result: PlantedFault, before: dict, after: dict, block_size: int, valid_end: int
) -> None:
    """The cells changed the way the mode says; ``valid_end`` ends the block's valid tokens."""
    mode, rid = result.mode, result.request
    first = result.position * block_size

    def same_block(token: int) -> bool:
        return token // block_size == result.position

    if mode == "flip":
        flip = result.flip
        key = (rid, flip.layer, flip.head, flip.token)
        diff = before[key].data ^ after[key].data
        assert np.flatnonzero(diff).tolist() == [flip.byte]
        assert diff[flip.byte] == 1 << flip.bit
    elif mode == "zero":
        for (r, name, _, token), cell in after.items():
            if r == rid and name in result.layers and same_block(token):
                assert not cell.data.any()
    elif mode == "swap-tokens":
        swap = result.swap
        t1, t2 = swap.tokens
        key = (rid, swap.layer, swap.head)
        assert np.array_equal(after[(*key, t1)].data, before[(*key, t2)].data)
        assert np.array_equal(after[(*key, t2)].data, before[(*key, t1)].data)
        assert t1 < t2 < valid_end
    elif mode == "swap-heads":
        swap = result.swap
        h1, h2 = swap.heads
        for (r, name, head, token), cell in before.items():
            if r == rid and name == swap.layer and head in (h1, h2) and same_block(token):
                other = h2 if head == h1 else h1
                assert np.array_equal(after[r, name, other, token].data, cell.data)
    elif mode == "stale":
        origin = result.origin
        assert origin.request not in (None, rid)
        for change in result.changes:
            for t in change.tokens + change.tokens_past_end:
                source = origin.position * block_size + (t - first)
                key = (origin.request, change.layer, change.head, source)
                assert np.array_equal(
                    after[rid, change.layer, change.head, t].data, before[key].data
                )
    elif mode == "shift":
        for change in result.changes:
            name, head = change.layer, change.head
            assert change.tokens_past_end == []
            for t in range(first + 1, valid_end):
                assert np.array_equal(
                    after[rid, name, head, t].data, before[rid, name, head, t - 1].data
                )
            assert np.array_equal(
                after[rid, name, head, first].data, before[rid, name, head, first].data
            )


def test_choices_fall_on_valid_tokens(sets: Sets, tmp_path: Path) -> None:
    # Consumer MLA position 5 holds tokens 40..47, of which 40..44 are valid.
    source = sets.consumer.paths[1]
    for seed in range(12):
        for mode in ("flip", "swap-tokens"):
            result = corrupt_dump(
                source,
                tmp_path / "out.safetensors",
                request_id="req-a",
                group_id=1,
                position=5,
                mode=mode,
                seed=seed,
            )
            assert result.tokens and all(40 <= t < 45 for t in result.tokens)
            assert all(not change.tokens_past_end for change in result.changes)


def test_corrupting_in_place_replaces_the_file(sets: Sets, tmp_path: Path) -> None:
    path = tmp_path / "dump.safetensors"
    path.write_bytes(Path(sets.consumer.paths[0]).read_bytes())
    original = path.read_bytes()
    result = corrupt_dump(
        path, path, request_id="req-a", group_id=0, position=0, mode="flip", seed=3
    )
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    differ = np.flatnonzero(data != np.frombuffer(original, dtype=np.uint8))
    assert differ.tolist() == [result.byte_ranges[0][0]]
    assert os.listdir(tmp_path) == ["dump.safetensors"]


BAD = [
    ({"request_id": "req-x"}, "no request 'req-x'"),
    ({"group_id": 7}, "no blocks of group 7"),
    ({"position": 40}, "position 40 is not in this dump"),
    ({"layer": "model.layers.9.mlp"}, "no layer model.layers.9.mlp"),
    ({"layer": L0, "head": 3}, "head 3 of layer model.layers.0.self_attn.attn is not on this"),
    ({"position": 11, "token": 45}, "token 45 is not a valid token"),
    ({"position": 11, "token": 40}, "token 40 is not a valid token"),
    ({"mode": "swap-heads", "layer": L1}, "swap-heads needs two heads"),
    ({"mode": "swap-tokens", "position": 11}, "needs two valid tokens"),
    ({"mode": "bend"}, "unknown mode 'bend'"),
    ({"mode": "zero", "token": 3}, "takes no token"),
    ({"group_id": 2, "mode": "shift"}, "a state block holds one state"),
    ({"group_id": 2, "token": 3}, "not this state block's position"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
def test_bad_arguments(sets: Sets, tmp_path: Path, change: dict, message: str) -> None:
    source = sets.consumer.paths[0]  # TP rank 0 of 4: head 0 of L0 and L1, req-a 45 tokens
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"kept")
    arguments = {"request_id": "req-a", "group_id": 0, "position": 1, **change}
    with pytest.raises(KvauditError) as error:
        corrupt_dump(source, out, **arguments)
    text = str(error.value)
    assert message in text
    assert text.startswith(source) and "\n" not in text
    assert out.read_bytes() == b"kept"
    assert os.listdir(tmp_path) == ["out.safetensors"]


def test_source_and_output_paths(sets: Sets, tmp_path: Path) -> None:
    with pytest.raises(KvauditError, match="is a directory"):
        corrupt_dump(tmp_path, tmp_path / "out", request_id="r", group_id=0, position=0)
    with pytest.raises(KvauditError, match="no such file"):
        corrupt_dump(
            tmp_path / "missing.safetensors",
            tmp_path / "out",
            request_id="r",
            group_id=0,
            position=0,
        )
    with pytest.raises(KvauditError, match="cannot write"):
        corrupt_dump(
            sets.consumer.paths[0],
            tmp_path / "no" / "out",
            request_id="req-a",
            group_id=0,
            position=0,
        )
    assert set(MODES) == {"flip", "zero", "swap-tokens", "swap-heads", "stale", "shift"}
