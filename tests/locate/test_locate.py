"""Locating differences between a producer's and a consumer's dumps.

A model's KV (``kvbuild``) is dumped by a TP=2, PP=2 producer and a TP=4 consumer with
other block sizes, kernel blocks and layouts; three groups: attention (bf16 and fp32),
MLA (fp8 e4m3 and e5m2, held whole by every rank) and TP-split Mamba states. The tests'
expectations come from decoding the dump files independently (safetensors, the tests'
own layout inverse and the spec's rules), never from kvaudit's views.

The builders and the decoder live in ``dumped_sets.py``, the ``sets`` fixture in
``conftest.py``; both are shared with ``test_corrupt.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from helpers import kvbuild as kb
from helpers import reference as ref
from helpers.dumped_sets import (
    COMPARED,
    CONSUMER,
    L0,
    L1,
    L2,
    MODEL,
    TOKENS,
    CellKey,
    Sets,
    all_positions,
    decode,
    decode_set,
    expected_errors,
    expected_located,
    group_of,
    with_file,
)

from kvaudit.checksum import checksum_dump_set
from kvaudit.corrupt import PlantedFault, corrupt_dump
from kvaudit.dumps import open_dump_set
from kvaudit.locate import CellSegment, element_errors, locate_differences


def locate(producer_paths: list[str], consumer_paths: list[str], rid: str, gid: int, positions):
    return locate_differences(
        open_dump_set(producer_paths).dumps,
        open_dump_set(consumer_paths).dumps,
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


def test_dumped_blocks_follow_the_definition(sets: Sets) -> None:
    # Each side's checksums (its workers summed) of every block, against the definition
    # over the model's KV: the blocks locate reads are the blocks that were checksummed.
    for dumped in (sets.producer, sets.consumer):
        record = checksum_dump_set(open_dump_set(dumped.paths), backend="torch")
        assert set(record.requests) == set(TOKENS)
        for rid, request in record.requests.items():
            assert set(request.groups) == {0, 1, 2}
            for gid, group in request.groups.items():
                reference = kb.reference_group(
                    MODEL, gid, sets.requests[rid], tp_size=1, block_size=group.block_size
                )
                want = [
                    ref.slow_block_checksum(reference, request.num_tokens, position)
                    for position in range(group.start, group.end)
                ]
                assert [int(v) for v in group.totals()] == want, (dumped.paths, rid, gid)
                assert group.count > 0


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
