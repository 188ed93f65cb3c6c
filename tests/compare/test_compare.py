"""Comparing producer and consumer checksums, the diff report's JSON and JUnit forms,
received wire checksums and stored checksums of offloaded blocks."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import numpy as np
import pytest
from helpers.report_keys import DIFF_KEYS, GROUP_KEYS, OPTIONAL_GROUP_KEYS

from kvaudit.compare import (
    DiffReport,
    GroupComparison,
    StoredCheck,
    compare_records,
    stored_report,
    verify_against_record,
    verify_received,
    verify_stored_blocks,
)
from kvaudit.core.errors import KvauditError, WireFormatError
from kvaudit.formats import diff_junit, diff_to_json
from kvaudit.locate import LocatedDifference
from kvaudit.records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    combine_workers,
)
from kvaudit.records.wire import WireChecksums, WireGroup, encode_wire

MOD = 2**64
FP = {0: 0x9F0C2A61D3B47E18, 1: 0x1A2B3C4D5E6F7081}
PACKED = "its KV heads are packed into head slots"


@dataclass
class Grp:
    """A group's totals (python ints) at positions ``start ..``."""

    block_size: int
    start: int
    totals: list[int]


@dataclass
class Req:
    num_tokens: int
    groups: dict[int, Grp]


def random_totals(rng: random.Random, count: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(count)]


def split(rng: random.Random, value: int, parts: int) -> list[int]:
    """``parts`` random uint64 values whose sum mod 2**64 is ``value``."""
    shares = [rng.getrandbits(64) for _ in range(parts - 1)]
    return [*shares, (value - sum(shares)) % MOD]


def build(
    requests: dict[str, Req],
    *,
    tp_size: int = 1,
    replicated: bool = False,
    positions: str = "request",
    fingerprints: dict[int, int] | None = None,
    not_covered: dict[int, str] | None = None,
    drop: tuple[int, ...] = (),
    seed: int = 0,
    name: str = "engine",
) -> Record:
    """One engine's record from its workers: every total is split over the TP ranks under
    key (1, 0); with ``replicated`` a second part is held whole by every rank under
    ``(tp_size, rank)`` (as MLA), so the totals are (1, 0) + (tp_size, 0)."""
    rng = random.Random(seed)
    fingerprints = dict(FP if fingerprints is None else fingerprints)
    keys = [(1, 0)] + ([(tp_size, 0)] if replicated else [])
    per_rank: dict[int, dict[str, RequestChecksums]] = {r: {} for r in range(tp_size)}
    for rid, request in requests.items():
        for r in range(tp_size):
            per_rank[r][rid] = RequestChecksums(request.num_tokens, {})
        for gid, group in request.groups.items():
            rows: dict[int, list[list[int]]] = {r: [] for r in range(tp_size)}
            for total in group.totals:
                whole = rng.getrandbits(64) if replicated else 0
                shares = split(rng, (total - whole) % MOD, tp_size)
                for r in range(tp_size):
                    rows[r].append([shares[r], whole] if replicated else [shares[r]])
            for r in range(tp_size):
                rank_keys = [(1, 0), (tp_size, r)] if replicated else keys
                values = np.array(rows[r], dtype=np.uint64).reshape(len(group.totals), -1)
                per_rank[r][rid].groups[gid] = GroupChecksums(
                    group.block_size, group.start, rank_keys, values, fingerprints[gid]
                )
    workers = [
        WorkerRecord(
            worker=WorkerInfo(r, tp_size, 0, 1, "consumer", name, f"{name}/rank{r}.safetensors"),
            positions=positions,
            fingerprints=fingerprints,
            not_covered=dict(not_covered or {}),
            requests=per_rank[r],
        )
        for r in range(tp_size)
        if r not in drop
    ]
    return combine_workers(workers)


def standard(seed: int = 0) -> dict[str, Req]:
    """Two requests: req-a with groups 0 (3 blocks, 40 tokens) and 1 (a window, 2 blocks),
    req-b with group 0 only."""
    rng = random.Random(seed)
    return {
        "req-a": Req(
            40,
            {0: Grp(16, 0, random_totals(rng, 3)), 1: Grp(16, 1, random_totals(rng, 2))},
        ),
        "req-b": Req(20, {0: Grp(16, 0, random_totals(rng, 2))}),
    }


def bump(record: Record, rid: str, gid: int, position: int, key: tuple[int, int]) -> None:
    """Adds 1 (mod 2**64) to one value of a record."""
    group = record.requests[rid].groups[gid]
    k = group.replica_keys.index(key)
    row = position - group.start
    group.values[row, k] = np.uint64((int(group.values[row, k]) + 1) % MOD)


# Matching and mismatching.


def test_equal_checksums_across_tp_layouts_are_ok() -> None:
    requests = standard()
    producer = build(requests, tp_size=1, name="prefill")
    consumer = build(requests, tp_size=4, replicated=True, seed=9, name="decode")
    report = compare_records(producer, consumer)
    assert report.ok
    assert report.only_in_producer == [] and report.only_in_consumer == []
    assert set(report.requests) == {"req-a", "req-b"}
    a0 = report.requests["req-a"][0]
    assert (a0.compared, a0.mismatched_positions, a0.replicas_differing) == (3, [], [])
    assert a0.unverified is None and a0.block_size == 16
    assert report.requests["req-a"][1].compared == 2
    # req-b: 20 tokens at B=16 -> positions 0 (16 valid) and 1 (4 valid).
    assert report.requests["req-b"][0].compared == 2


def test_one_position_off_is_listed() -> None:
    requests = standard(1)
    producer = build(requests)
    requests["req-a"].groups[0].totals[2] ^= 1 << 63
    consumer = build(requests, tp_size=2, replicated=True, seed=3)
    report = compare_records(producer, consumer)
    assert not report.ok
    group = report.requests["req-a"][0]
    assert group.mismatched_positions == [2]
    assert group.compared == 3
    assert group.replicas_differing == []
    assert group.unverified is None
    assert report.requests["req-a"][1].ok and report.requests["req-b"][0].ok


def test_replica_column_off_is_listed_even_when_totals_match() -> None:
    requests = standard(2)
    producer = build(requests)
    consumer = build(requests, tp_size=2, replicated=True, seed=4)
    bump(consumer, "req-a", 0, 1, (2, 1))
    report = compare_records(producer, consumer)
    group = report.requests["req-a"][0]
    assert group.mismatched_positions == []
    assert group.replica_mismatches == [(1, 2, 1)]
    assert group.replicas_differing == [(2, 1)]
    assert not group.ok and not report.ok


def test_replica_zero_column_off_changes_totals() -> None:
    requests = standard(3)
    producer = build(requests)
    consumer = build(requests, tp_size=2, replicated=True, seed=4)
    bump(consumer, "req-a", 0, 0, (2, 0))
    group = compare_records(producer, consumer).requests["req-a"][0]
    # The total moved, and replica 1 no longer equals replica 0.
    assert group.mismatched_positions == [0]
    assert group.replica_mismatches == [(0, 2, 1)]
    assert group.replicas_differing == [(2, 1)]


def test_producer_replicas_are_not_checked() -> None:
    requests = standard(4)
    producer = build(requests, tp_size=2, replicated=True, seed=1)
    bump(producer, "req-a", 0, 1, (2, 1))
    consumer = build(requests, tp_size=2, seed=2)
    assert compare_records(producer, consumer).ok


# Groups that cannot be compared.


def test_fingerprints_differ() -> None:
    requests = standard(5)
    producer = build(requests)
    consumer = build(requests, fingerprints={0: 0x1A2B000000000001, 1: FP[1]})
    report = compare_records(producer, consumer)
    group = report.requests["req-a"][0]
    assert group.unverified == (
        "fingerprints differ (producer 9f0c2a61d3b47e18, consumer 1a2b000000000001): "
        "the layers, specs or dtypes differ"
    )
    assert group.compared == 0 and group.mismatched_positions == []
    assert report.requests["req-a"][1].ok
    assert not report.ok


def test_group_covered_on_one_side_only() -> None:
    requests = standard(6)
    producer = build(requests)
    without = standard(6)
    del without["req-a"].groups[1]
    consumer = build(without, not_covered={1: PACKED})
    group = compare_records(producer, consumer).requests["req-a"][1]
    assert group.unverified is not None
    assert group.unverified.startswith("covered on the producer only")
    assert PACKED in group.unverified
    # The other direction, with no reason known.
    reverse = compare_records(build(without), build(requests)).requests["req-a"][1]
    assert reverse.unverified is not None
    assert reverse.unverified.startswith("covered on the consumer only")
    assert not compare_records(build(without), build(requests)).ok


def test_worker_missing_on_the_consumer() -> None:
    requests = standard(7)
    producer = build(requests)
    consumer = build(requests, tp_size=4, drop=(3,))
    report = compare_records(producer, consumer)
    assert not report.ok
    for _, _, group in report.groups():
        assert group.unverified == "a worker is missing on the consumer (pp 0, tp 3)"
        assert group.compared == 0
    # Both sides.
    both = compare_records(build(requests, tp_size=2, drop=(0,)), consumer)
    reason = both.requests["req-b"][0].unverified
    assert reason is not None
    assert "missing on the producer (pp 0, tp 0)" in reason
    assert "missing on the consumer (pp 0, tp 3)" in reason


def test_no_common_block() -> None:
    rng = random.Random(8)
    producer = build({"r": Req(200, {0: Grp(16, 0, random_totals(rng, 2))})})
    consumer = build({"r": Req(200, {0: Grp(16, 5, random_totals(rng, 3))})})
    report = compare_records(producer, consumer)
    group = report.requests["r"][0]
    # The producer's positions 0 and 1 hold tokens the consumer's blocks do not list.
    assert group.missing_positions == [0, 1] and group.unverified is None
    assert group.compared == 0 and group.mismatched_positions == []
    assert group.held == (2, 3)
    assert not report.ok


# Block sizes.


def coarse_sums(fine: list[int], ratio: int) -> list[int]:
    """Python-int sums of consecutive runs of ``ratio`` fine totals, mod 2**64."""
    return [sum(fine[i : i + ratio]) % MOD for i in range(0, len(fine), ratio)]


@pytest.mark.parametrize("consumer_finer", [False, True])
def test_block_sizes_16_and_64_compare_at_64(consumer_finer: bool) -> None:
    rng = random.Random(9)
    # 100 tokens: seven 16-blocks (the last with 4 tokens), two 64-blocks (64 and 36).
    fine = random_totals(rng, 7)
    coarse = coarse_sums(fine, 4)
    assert len(coarse) == 2
    fine_req = {"r": Req(100, {0: Grp(16, 0, fine)})}
    coarse_req = {"r": Req(100, {0: Grp(64, 0, coarse)})}
    sides = (build(fine_req, tp_size=2), build(coarse_req, tp_size=2, replicated=True))
    producer, consumer = sides[::-1] if consumer_finer else sides
    report = compare_records(producer, consumer)
    group = report.requests["r"][0]
    assert report.ok
    assert (group.compared, group.block_size) == (2, 64)

    # One 16-block off: its 64-block (position 5 -> 1) is reported.
    fine_bad = list(fine)
    fine_bad[5] = (fine_bad[5] + 12345) % MOD
    bad_fine = build({"r": Req(100, {0: Grp(16, 0, fine_bad)})})
    good_coarse = build(coarse_req)
    pair = (good_coarse, bad_fine) if consumer_finer else (bad_fine, good_coarse)
    group = compare_records(*pair).requests["r"][0]
    assert group.mismatched_positions == [1]
    assert group.compared == 2


def test_finer_consumer_replicas_are_reported_in_coarse_positions() -> None:
    rng = random.Random(33)
    fine = random_totals(rng, 8)  # 128 tokens
    producer = build({"r": Req(128, {0: Grp(64, 0, coarse_sums(fine, 4))})})
    consumer = build({"r": Req(128, {0: Grp(16, 0, fine)})}, tp_size=2, replicated=True)
    bump(consumer, "r", 0, 5, (2, 1))
    group = compare_records(producer, consumer).requests["r"][0]
    # 16-block 5 lies in 64-block 1; the totals (replica 0) still match.
    assert group.replica_mismatches == [(1, 2, 1)]
    assert (group.compared, group.mismatched_positions) == (2, [])


def test_coarse_block_needs_every_fine_position_with_tokens() -> None:
    rng = random.Random(10)
    fine = random_totals(rng, 8)  # 128 tokens: eight full 16-blocks
    coarse = coarse_sums(fine, 4)
    # The finer side lacks position 0: 64-block 0 cannot be formed, 64-block 1 can. The
    # producer's tokens 16..63, which the consumer holds too, are then never compared.
    producer = build({"r": Req(128, {0: Grp(16, 1, fine[1:])})})
    consumer = build({"r": Req(128, {0: Grp(64, 0, coarse)})})
    report = compare_records(producer, consumer)
    group = report.requests["r"][0]
    assert (group.compared, group.mismatched_positions, group.missing_positions) == (1, [], [])
    assert group.unverified == (
        "not compared at position 0: a side holds only its last 16-token blocks from token 16, "
        "and the 64-token block's checksum cannot be formed from them"
    )
    assert not report.ok


def test_fine_positions_past_num_tokens_may_be_absent() -> None:
    rng = random.Random(11)
    fine = random_totals(rng, 3)  # 40 tokens: 16-blocks 0..2; block 3 has no token
    producer = build({"r": Req(40, {0: Grp(16, 0, fine)})})
    consumer = build({"r": Req(40, {0: Grp(64, 0, [sum(fine) % MOD])})})
    group = compare_records(producer, consumer).requests["r"][0]
    assert (group.compared, group.unverified) == (1, None)


def test_block_sizes_16_and_48_divide() -> None:
    rng = random.Random(12)
    fine = random_totals(rng, 6)  # 96 tokens
    producer = build({"r": Req(96, {0: Grp(16, 0, fine)})})
    consumer = build({"r": Req(96, {0: Grp(48, 0, coarse_sums(fine, 3))})})
    report = compare_records(producer, consumer)
    assert report.ok
    assert (report.requests["r"][0].compared, report.requests["r"][0].block_size) == (2, 48)


def test_block_sizes_16_and_24_do_not_divide() -> None:
    rng = random.Random(13)
    producer = build({"r": Req(96, {0: Grp(16, 0, random_totals(rng, 6))})})
    consumer = build({"r": Req(96, {0: Grp(24, 0, random_totals(rng, 4))})})
    report = compare_records(producer, consumer)
    group = report.requests["r"][0]
    assert group.unverified is not None and "neither divides" in group.unverified
    assert group.compared == 0 and not report.ok


def test_block_numbering_does_not_add_up_across_block_sizes() -> None:
    rng = random.Random(14)
    fine = random_totals(rng, 4)
    producer = build({"r": Req(64, {0: Grp(16, 0, fine)})}, positions="block")
    consumer = build({"r": Req(64, {0: Grp(64, 0, [sum(fine) % MOD])})}, positions="block")
    group = compare_records(producer, consumer).requests["r"][0]
    assert group.unverified is not None and "per block" in group.unverified


# Token counts.


def test_consumer_record_decoded_further_leaves_the_last_block_unverified() -> None:
    rng = random.Random(15)
    shared = random_totals(rng, 2)
    # Producer: 40 tokens (last block 8 valid). Consumer decoded 5 more (13 valid): a
    # record cannot be checksummed again over 40 tokens, so position 2 is not compared,
    # and it is not missing either (the consumer holds all 40 tokens).
    producer = build({"r": Req(40, {0: Grp(16, 0, [*shared, rng.getrandbits(64)])})})
    consumer = build({"r": Req(45, {0: Grp(16, 0, [*shared, rng.getrandbits(64)])})})
    report = compare_records(producer, consumer)
    group = report.requests["r"][0]
    assert (group.compared, group.mismatched_positions, group.missing_positions) == (2, [], [])
    assert group.unverified is not None and group.unverified.startswith(
        "not compared at position 2"
    )
    assert not report.ok
    # Checksummed over the producer's 40 tokens (as a diff of dumps does), it matches.
    last = rng.getrandbits(64)
    producer = build({"r": Req(40, {0: Grp(16, 0, [*shared, last])})})
    consumer = build({"r": Req(40, {0: Grp(16, 0, [*shared, last])})})
    report = compare_records(producer, consumer, token_counts=({}, {"r": 45}))
    group = report.requests["r"][0]
    assert (group.compared, group.missing_positions, group.unverified) == (3, [], None)
    assert report.ok and report.num_tokens == {"r": (40, 45)}


def test_positions_without_valid_tokens_are_not_compared() -> None:
    rng = random.Random(16)
    totals = random_totals(rng, 3)
    # 32 tokens: position 2 holds none on either side, even with different values.
    producer = build({"r": Req(32, {0: Grp(16, 0, totals)})})
    consumer = build({"r": Req(32, {0: Grp(16, 0, [*totals[:2], totals[2] ^ 1])})})
    group = compare_records(producer, consumer).requests["r"][0]
    assert (group.compared, group.mismatched_positions) == (2, [])


def test_differing_valid_tokens_everywhere_is_unverified() -> None:
    rng = random.Random(17)
    producer = build({"r": Req(10, {0: Grp(16, 0, random_totals(rng, 1))})})
    consumer = build({"r": Req(12, {0: Grp(16, 0, random_totals(rng, 1))})})
    group = compare_records(producer, consumer).requests["r"][0]
    assert group.unverified is not None and group.unverified.startswith("not compared at")
    assert group.compared == 0 and group.missing_positions == []


# Missing positions.


def expected_missing(
    n_p: int, n_c: int, block: int, p_held: range, c_held: range, window: int | None = None
) -> list[int]:
    """The positions the producer holds with valid tokens (inside the window of both
    sides' last tokens) whose tokens the consumer does not hold, token by token."""
    lowest = 0 if window is None else max(0, max(n_p, n_c) - window + 1)
    result = []
    for q in p_held:
        tokens = range(q * block, min((q + 1) * block, n_p))
        if not tokens or (q + 1) * block - 1 < lowest:
            continue
        if any(t >= n_c or t // block not in c_held for t in tokens):
            result.append(q)
    return result


@pytest.mark.parametrize(
    ("n_c", "c_start", "c_count"),
    [(100, 0, 6), (100, 1, 6), (90, 0, 7), (100, 0, 7), (120, 0, 8), (30, 0, 2), (100, 3, 0)],
)
def test_missing_positions(n_c: int, c_start: int, c_count: int) -> None:
    """The consumer's block list stops early, skips a position or holds fewer tokens."""
    rng = random.Random(n_c + c_start + c_count)
    totals = random_totals(rng, 8)
    producer = build({"r": Req(100, {0: Grp(16, 0, totals[:7])})})
    shared = min(n_c, 100)
    held = totals[c_start : c_start + c_count]
    # The consumer's checksums cover the tokens both hold: a diff checksums its dumps so.
    consumer = build(
        {"r": Req(shared, {0: Grp(16, c_start, held)})} if c_count else {"r": Req(shared, {})}
    )
    cut_producer = build({"r": Req(shared, {0: Grp(16, 0, totals[:7])})})
    want = expected_missing(100, n_c, 16, range(7), range(c_start, c_start + c_count))
    for left in (producer, cut_producer):
        report = compare_records(left, consumer, token_counts=({"r": 100}, {"r": n_c}))
        group = report.requests["r"][0]
        assert group.missing_positions == want
        assert group.mismatched_positions == []
        assert report.ok is (not want)
        report.allow_missing = True
        assert report.ok is (group.compared > 0 and group.unverified is None)


def test_positions_beyond_the_producer_are_never_missing_nor_different() -> None:
    rng = random.Random(41)
    totals = random_totals(rng, 3)
    producer = build({"r": Req(40, {0: Grp(16, 0, totals)})})
    # The consumer decoded 60 more tokens into 4 more blocks (other values past token 40).
    consumer = build({"r": Req(40, {0: Grp(16, 0, [*totals, *random_totals(rng, 4)])})})
    report = compare_records(producer, consumer, token_counts=({}, {"r": 100}))
    group = report.requests["r"][0]
    assert (group.compared, group.missing_positions, group.mismatched_positions) == (3, [], [])
    assert group.held == (3, 7) and report.ok


@pytest.mark.parametrize(("n_p", "n_c"), [(100, 100), (100, 130), (100, 200), (70, 70)])
def test_sliding_window_expects_the_positions_inside_the_window(n_p: int, n_c: int) -> None:
    rng = random.Random(n_p + n_c)
    window = 40
    totals = random_totals(rng, 13)
    # Each side holds only the blocks of its own window (vLLM frees the others).
    p_first = max(0, n_p - window + 1) // 16
    c_first = max(0, n_c - window + 1) // 16
    p_count = -(-n_p // 16) - p_first
    c_count = -(-n_c // 16) - c_first
    producer = build({"r": Req(n_p, {0: Grp(16, p_first, totals[p_first : p_first + p_count])})})
    consumer_totals = totals[c_first : c_first + c_count]
    consumer = build({"r": Req(n_p, {0: Grp(16, c_first, consumer_totals)})})
    p_held = range(p_first, p_first + p_count)
    c_held = range(c_first, c_first + c_count)
    want = expected_missing(n_p, n_c, 16, p_held, c_held, window)
    report = compare_records(producer, consumer, token_counts=({}, {"r": n_c}), windows={0: window})
    group = report.requests["r"][0]
    assert want == [] and group.missing_positions == []
    # Without the window, the producer's blocks the consumer freed would be missing.
    plain = compare_records(producer, consumer, token_counts=({}, {"r": n_c}))
    assert plain.requests["r"][0].missing_positions == expected_missing(
        n_p, n_c, 16, p_held, c_held
    )
    # A consumer that drops its first block: missing even with the window, where that
    # block holds some of the producer's tokens.
    dropped = build({"r": Req(n_p, {0: Grp(16, c_first + 1, consumer_totals[1:])})})
    report = compare_records(producer, dropped, token_counts=({}, {"r": n_c}), windows={0: window})
    want = expected_missing(n_p, n_c, 16, p_held, range(c_first + 1, c_first + c_count), window)
    assert report.requests["r"][0].missing_positions == want
    assert (want != []) is (c_first * 16 < n_p)
    if want:
        assert not report.ok


@pytest.mark.parametrize("fine_side", ["consumer", "producer"])
def test_a_window_starting_inside_a_coarse_block_is_never_passed(fine_side: str) -> None:
    # Window 4, 10 tokens: the next token attends to tokens 7..10. At block size 4 a side
    # keeps blocks 1 and 2 (tokens 4..11), at block size 8 blocks 0 and 1; the 8-token
    # block 0 holds window token 7 but cannot be formed from the 4-token side's blocks.
    rng = random.Random(44)
    fine = random_totals(rng, 3)  # 4-token blocks 0..2 of the same KV
    fine_group = Grp(4, 1, fine[1:])
    coarse_group = Grp(8, 0, coarse_sums([*fine, 0], 2))
    sides = {"producer": coarse_group, "consumer": coarse_group, fine_side: fine_group}
    producer = build({"r": Req(10, {0: sides["producer"]})})
    consumer = build({"r": Req(10, {0: sides["consumer"]})})
    report = compare_records(producer, consumer, windows={0: 4})
    group = report.requests["r"][0]
    assert (group.compared, group.mismatched_positions, group.missing_positions) == (1, [], [])
    assert group.unverified is not None and group.unverified.startswith(
        "not compared at position 0: a side holds only its last 4-token blocks from token 4"
    )
    assert not report.ok
    report.allow_missing = True
    assert not report.ok  # nothing is missing: the window's tokens are unverified
    if fine_side == "consumer":
        # A consumer that freed its block 1 as well lacks window token 7.
        lacking = build({"r": Req(10, {0: Grp(4, 2, fine[2:])})})
        group = compare_records(producer, lacking, windows={0: 4}).requests["r"][0]
        assert (group.missing_positions, group.compared) == ([0], 1)


def test_huge_token_counts_cost_only_the_blocks_held() -> None:
    """A record of 10**15 tokens holding two blocks: two positions expected and held, in
    time bounded by the blocks held."""
    rng = random.Random(43)
    totals = random_totals(rng, 2)
    producer = build({"r": Req(10**15, {0: Grp(16, 0, totals)})})
    consumer = build({"r": Req(10**15, {0: Grp(16, 0, totals[:1])})})
    group = compare_records(producer, consumer).requests["r"][0]
    assert (group.compared, group.missing_positions, group.held) == (1, [1], (2, 1))


def test_a_group_the_consumer_holds_no_block_of_is_missing() -> None:
    requests = standard(42)
    without = standard(42)
    del without["req-a"].groups[1]
    report = compare_records(build(requests), build(without))
    group = report.requests["req-a"][1]
    # req-a group 1 holds positions 1 and 2 of 40 tokens.
    assert (group.missing_positions, group.unverified, group.compared) == ([1, 2], None, 0)
    assert not report.ok
    report.allow_missing = True
    assert report.ok


# Requests.


def test_requests_on_one_side_only() -> None:
    requests = standard(18)
    extra = dict(requests)
    extra["req-local"] = Req(16, {0: Grp(16, 0, [5])})
    # Only on the consumer: informational.
    report = compare_records(build(requests), build(extra))
    assert report.only_in_consumer == ["req-local"] and report.only_in_producer == []
    assert "req-local" not in report.requests
    assert report.ok
    # Only on the producer: the consumer never got it.
    report = compare_records(build(extra), build(requests))
    assert report.only_in_producer == ["req-local"] and report.only_in_consumer == []
    assert not report.ok


def test_request_ids_select_and_unknown_ids_raise() -> None:
    requests = standard(19)
    producer, consumer = build(requests), build(requests)
    report = compare_records(producer, consumer, request_ids=["req-b"])
    assert list(report.requests) == ["req-b"] and report.ok
    with pytest.raises(KvauditError) as caught:
        compare_records(producer, consumer, request_ids=["req-b", "req-nowhere"])
    assert "req-nowhere" in str(caught.value) and "\n" not in str(caught.value)


def test_different_position_numberings_raise() -> None:
    requests = standard(20)
    with pytest.raises(KvauditError) as caught:
        compare_records(build(requests), build(requests, positions="block"))
    message = str(caught.value)
    assert "request" in message and "block" in message and "\n" not in message


# Report forms.


def check_json_shape(data: dict) -> None:
    assert set(data) == DIFF_KEYS
    assert data["format"] == "kvaudit.diff/1"
    assert isinstance(data["ok"], bool)
    assert data["positions"] in ("request", "block")
    for name in ("only_in_producer", "only_in_consumer"):
        assert all(isinstance(item, str) for item in data[name])
    for request in data["requests"].values():
        assert set(request) == {"num_tokens", "groups"}
        assert set(request["num_tokens"]) == {"producer", "consumer"}
        for gid, group in request["groups"].items():
            assert gid.isdigit()
            assert GROUP_KEYS <= set(group) <= GROUP_KEYS | OPTIONAL_GROUP_KEYS
            assert type(group["compared"]) is int
            assert all(type(p) is int for p in group["mismatched_positions"])
            for pair in group["replicas_differing"]:
                assert isinstance(pair, list) and len(pair) == 2
                assert all(type(v) is int for v in pair)
            assert group["unverified"] is None or isinstance(group["unverified"], str)
            assert isinstance(group["located"], list)
            assert all(type(p) is int for p in group["missing_positions"])
            assert isinstance(group["stale_sources"], dict)


def mixed_report() -> tuple[DiffReport, Record, Record]:
    """req-a group 0: position 2 off and replica (1, 1) off; req-a group 1: covered on
    the producer only; req-b: fine; req-gone: only on the producer."""
    requests = standard(21)
    requests["req-gone"] = Req(16, {0: Grp(16, 0, [7])})
    producer = build(requests)
    consumer_requests = standard(21)
    consumer_requests["req-a"].groups[0].totals[2] += 1
    del consumer_requests["req-a"].groups[1]
    consumer = build(consumer_requests, tp_size=2, replicated=True, not_covered={1: PACKED})
    bump(consumer, "req-a", 0, 1, (2, 1))
    return compare_records(producer, consumer), producer, consumer


def test_json_shape_and_values() -> None:
    report, _, _ = mixed_report()
    located = LocatedDifference(
        position=2,
        layer="model.layers.1.self_attn.attn",
        head=3,
        tokens=[35],
        first_byte=1234,
        max_abs_error=0.5,
        max_rel_error=0.01,
    )
    report.requests["req-a"][0].located.append(located)
    data = json.loads(json.dumps(diff_to_json(report)))
    check_json_shape(data)
    assert data["ok"] is False and data["ok"] == report.ok
    assert data["positions"] == "request"
    assert data["only_in_producer"] == ["req-gone"] and data["only_in_consumer"] == []
    a0 = data["requests"]["req-a"]["groups"]["0"]
    assert data["requests"]["req-a"]["num_tokens"] == {"producer": 40, "consumer": 40}
    # Records built by hand carry the seed lane alone, and the report says so.
    assert data["warnings"] == [
        "compared by the seed lane only: neither side carries the strong lane"
    ]
    assert a0 == {
        "seed_lane_only": "neither side carries the strong lane",
        "compared": 3,
        "mismatched_positions": [2],
        "missing_positions": [],
        "replicas_differing": [[2, 1]],
        "unverified": None,
        "positions": {"producer": 3, "consumer": 3},
        "stale_sources": {},
        "token_runs": [],
        "located": [
            {
                "position": 2,
                "layer": "model.layers.1.self_attn.attn",
                "head": 3,
                "tokens": [35],
                "first_byte": 1234,
                "max_abs_error": 0.5,
                "max_rel_error": 0.01,
                "scaled_error": 0.0,
                "differing_bytes": 0,
                "differing_bits": 0,
                "consumer_zeros": False,
                "nonfinite": 0,
            }
        ],
    }
    a1 = data["requests"]["req-a"]["groups"]["1"]
    assert a1["unverified"].startswith("covered on the producer only") and a1["compared"] == 0
    assert data["requests"]["req-b"]["groups"]["0"]["unverified"] is None


def test_json_ok_true_when_everything_matches() -> None:
    requests = standard(22)
    data = diff_to_json(compare_records(build(requests), build(requests, tp_size=2)))
    check_json_shape(data)
    assert data["ok"] is True


def test_junit_counts_and_messages() -> None:
    report, _, _ = mixed_report()
    root = ET.fromstring(diff_junit(report))
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = suite.findall("testcase")
    by_name = {(case.get("classname"), case.get("name")): case for case in cases}
    # Three groups plus the request missing on the consumer.
    assert ("kvaudit.req-a", "group 0") in by_name
    assert ("kvaudit.req-a", "group 1") in by_name
    assert ("kvaudit.req-b", "group 0") in by_name
    failures = [case for case in cases if case.find("failure") is not None]
    errors = [case for case in cases if case.find("error") is not None]
    assert int(suite.get("tests")) == len(cases)
    assert int(suite.get("failures")) == len(failures)
    assert int(suite.get("errors")) == len(errors)
    assert len(errors) == 1
    assert (
        by_name[("kvaudit.req-a", "group 1")]
        .find("error")
        .get("message")
        .startswith("covered on the producer only")
    )
    message = by_name[("kvaudit.req-a", "group 0")].find("failure").get("message")
    assert "2" in message and "1 (2:1)" in message
    assert by_name[("kvaudit.req-b", "group 0")].find("failure") is None
    assert by_name[("kvaudit.req-b", "group 0")].find("error") is None
    assert any(case.get("classname") == "kvaudit.req-gone" for case in failures)


def test_junit_escapes_awkward_request_ids() -> None:
    awkward = "a<b>&\"c'\x01"
    report = DiffReport(
        "request",
        {awkward: {0: GroupComparison(unverified='fingerprints <differ> & "so"', block_size=16)}},
    )
    root = ET.fromstring(diff_junit(report))
    case = root.iter("testcase").__next__()
    assert case.get("classname").startswith("kvaudit.a<b>&\"c'")
    assert case.find("error").get("message") == 'fingerprints <differ> & "so"'


def test_empty_report_fails_unless_allowed() -> None:
    report = DiffReport("request")
    assert not report.ok
    data = diff_to_json(report)
    check_json_shape(data)
    assert data["ok"] is False and "no request in common" in data["unverified"]
    root = ET.fromstring(diff_junit(report))
    suite = next(root.iter("testsuite"))
    assert (suite.get("tests"), suite.get("errors")) == ("1", "1")
    report.allow_empty = True
    assert report.ok and diff_to_json(report)["unverified"] is None
    assert int(next(ET.fromstring(diff_junit(report)).iter("testsuite")).get("tests")) == 0


def test_nothing_compared_fails() -> None:
    # A producer record with no request: every consumer request is on the consumer only.
    requests = standard(40)
    report = compare_records(build({}), build(requests))
    assert report.only_in_consumer == ["req-a", "req-b"] and report.requests == {}
    assert not report.ok and report.empty_reason is not None
    # A request neither side checksums any group of.
    both = {"r": Req(16, {})}
    report = compare_records(build(both), build(both))
    assert report.requests == {"r": {}} and not report.ok
    assert "request r" in (report.empty_reason or "")


# Regression checks against a saved record.


def test_verify_against_record_checks_every_column() -> None:
    requests = standard(23)
    saved = build(requests, tp_size=2, replicated=True, seed=5)
    current = build(requests, tp_size=2, replicated=True, seed=5)
    assert verify_against_record(current, saved).ok
    # Move 1 from the replicated part to the split part at req-b position 0, in both
    # replicas: the totals and the replicas stay consistent within ``current``.
    group = current.requests["req-b"].groups[0]
    k10, k20, k21 = (group.replica_keys.index(key) for key in [(1, 0), (2, 0), (2, 1)])
    for k, delta in ((k10, 1), (k20, -1), (k21, -1)):
        group.values[0, k] = np.uint64((int(group.values[0, k]) + delta) % MOD)
    # The totals still match: a producer/consumer diff sees nothing ...
    assert compare_records(saved, current).ok
    # ... but against the same engine's saved record every column must match.
    report = verify_against_record(current, saved)
    result = report.requests["req-b"][0]
    assert result.mismatched_positions == [0]
    assert result.replica_mismatches == [(0, 2, 1)]
    assert not report.ok


def test_verify_against_record_with_another_layout_compares_totals() -> None:
    requests = standard(24)
    saved = build(requests, tp_size=1)
    current = build(requests, tp_size=2, replicated=True)
    assert verify_against_record(current, saved).ok
    requests["req-a"].groups[1].totals[0] ^= 4
    report = verify_against_record(build(requests, tp_size=2, replicated=True), saved)
    assert report.requests["req-a"][1].mismatched_positions == [1]


# Received producer checksums.


def wire_of(request: Req) -> bytes:
    """The wire bytes of a request's totals, built from the test's own ints."""
    groups = [
        WireGroup(gid, FP[gid], group.block_size, group.start, np.array(group.totals, np.uint64))
        for gid, group in sorted(request.groups.items())
    ]
    return encode_wire(WireChecksums(request.num_tokens, "request", groups))


def test_verify_received_round_trip() -> None:
    requests = standard(25)
    consumer = build(requests, tp_size=2, replicated=True)
    received = {rid: wire_of(request) for rid, request in requests.items()}
    report = verify_received(consumer, received, source="decode/")
    assert report.ok
    assert report.requests["req-a"][0].compared == 3
    assert report.requests["req-b"][0].compared == 2


def test_verify_received_mismatch_and_missing_bytes() -> None:
    requests = standard(26)
    consumer = build(requests, tp_size=2)
    sent = standard(26)
    sent["req-a"].groups[0].totals[1] ^= 1
    report = verify_received(consumer, {"req-a": wire_of(sent["req-a"])}, source="decode/")
    assert report.requests["req-a"][0].mismatched_positions == [1]
    assert report.requests["req-a"][1].ok
    assert report.requests["req-b"][0].unverified == "no producer checksums received"
    assert report.only_in_consumer == [] and not report.ok


def test_verify_received_uses_the_consumer_token_count() -> None:
    rng = random.Random(27)
    fine = random_totals(rng, 3)
    # The producer's 16-blocks of 40 tokens against a consumer's 64-block.
    consumer = build({"r": Req(40, {0: Grp(64, 0, [sum(fine) % MOD])})})
    report = verify_received(consumer, {"r": wire_of(Req(40, {0: Grp(16, 0, fine)}))}, source="x")
    assert report.ok and report.requests["r"][0].compared == 1


def test_verify_received_group_not_sent() -> None:
    requests = standard(28)
    consumer = build(requests)
    only_group0 = Req(40, {0: requests["req-a"].groups[0]})
    report = verify_received(
        consumer, {"req-a": wire_of(only_group0), "req-b": wire_of(requests["req-b"])}, source="x"
    )
    reason = report.requests["req-a"][1].unverified
    assert reason is not None and reason.startswith("covered on the consumer only")


def test_verify_received_bad_bytes_name_the_source() -> None:
    requests = standard(29)
    consumer = build(requests)
    with pytest.raises(WireFormatError) as caught:
        verify_received(consumer, {"req-a": b"KVC2\x00\x00"}, source="decode/rank0.safetensors")
    message = str(caught.value)
    assert "decode/rank0.safetensors" in message and "req-a" in message
    assert "\n" not in message


# Stored checksums.


def reference_tag(block_hash: bytes, fingerprint: int) -> int:
    digest = hashlib.sha256(block_hash + struct.pack("<Q", fingerprint)).digest()
    return int.from_bytes(digest[:8], "little")


def stored_case(seed: int) -> tuple[list[int], np.ndarray, list[bytes], list[int], int]:
    """Positions, per-key partial sums, block hashes, stored values, fingerprint."""
    rng = random.Random(seed)
    positions = [3, 4, 5, 6]
    partial = [[rng.getrandbits(64) for _ in range(3)] for _ in positions]
    hashes = [rng.getrandbits(256).to_bytes(32, "big") for _ in positions]
    fingerprint = rng.getrandbits(64)
    stored = [
        (sum(row) % MOD) ^ reference_tag(h, fingerprint)
        for row, h in zip(partial, hashes, strict=True)
    ]
    return positions, np.array(partial, dtype=np.uint64), hashes, stored, fingerprint


def test_stored_checksums_pass_and_fail() -> None:
    positions, partial, hashes, stored, fingerprint = stored_case(30)
    stored_array = np.array(stored, dtype=np.uint64)
    assert verify_stored_blocks("r", 0, positions, partial, stored_array, hashes, fingerprint) == []
    # Already summed, and stored as int64 as the dump holds it.
    summed = np.array([sum(int(v) for v in row) % MOD for row in partial], dtype=np.uint64)
    as_int64 = stored_array.view(np.int64)
    assert verify_stored_blocks("r", 0, positions, summed, as_int64, hashes, fingerprint) == []
    # Corrupted KV at position 4; a stale block (another hash) at position 6.
    corrupted = partial.copy()
    corrupted[1, 2] = np.uint64((int(corrupted[1, 2]) + 1) % MOD)
    wrong_hashes = [*hashes[:3], b"another block"]
    failed = verify_stored_blocks(
        "r", 0, positions, corrupted, stored_array, wrong_hashes, fingerprint
    )
    assert failed == [4, 6]
    # A different fingerprint (other layers) fails every block.
    failed = verify_stored_blocks("r", 0, positions, partial, stored_array, hashes, fingerprint ^ 1)
    assert failed == positions


def test_stored_checksums_length_mismatch_raises() -> None:
    positions, partial, hashes, stored, fingerprint = stored_case(31)
    with pytest.raises(KvauditError) as caught:
        verify_stored_blocks(
            "req-9", 2, positions, partial, np.array(stored[:3], np.uint64), hashes, fingerprint
        )
    assert "req-9" in str(caught.value) and "group 2" in str(caught.value)


def test_stored_report_merges_workers() -> None:
    checks = [
        StoredCheck("r", 0, 16, checked=[0, 1, 2], failed=[]),
        StoredCheck("r", 0, 16, checked=[0, 1, 2], failed=[1]),
        StoredCheck("r", 1, 16, checked=[0], failed=[]),
        StoredCheck("s", 0, 16, unverified="the dump has no stored checksums"),
        StoredCheck("t", 0, 16),
    ]
    report = stored_report(checks, positions="request")
    r0 = report.requests["r"][0]
    assert (r0.compared, r0.mismatched_positions, r0.unverified) == (3, [1], None)
    assert report.requests["r"][1].ok
    assert report.requests["s"][0].unverified == "the dump has no stored checksums"
    assert report.requests["t"][0].unverified is not None
    assert not report.ok
    check_json_shape(diff_to_json(report))
    assert stored_report(checks[2:3], positions="request").ok
