"""Windowed groups expect only what both sides keep: sliding windows and chunked local
attention (``attention_chunk_size``).

An engine frees the blocks before the one holding the first token its next token attends
to (vLLM 0.33's ``get_num_skipped_tokens`` and ``remove_skipped_blocks``): for chunked
local attention the next token, at position ``n``, attends to its own chunk, from token
``(n // chunk) * chunk`` on. Every expected position below is worked out by hand in the
comment or table beside it; records are built from random totals, dumps from random KV.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import kvbuild as kb

from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.cli import main
from kvaudit.compare import AttentionWindow, compare_records
from kvaudit.compare.model import GroupComparison
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    combine_workers,
)

FP = 0x5EED5EED5EED5EED

# Records.


def record(num_tokens: int, block_size: int, start: int, totals: list[int]) -> Record:
    """One worker's record of request ``r``, group 0: ``totals`` at ``start ..``."""
    values = np.array(totals, dtype=np.uint64).reshape(len(totals), 1)
    group = GroupChecksums(block_size, start, [(1, 0)], values, FP)
    worker = WorkerRecord(
        worker=WorkerInfo(0, 1, 0, 1, "consumer", "test", "test/rank0.safetensors"),
        positions="request",
        fingerprints={0: FP},
        not_covered={},
        requests={"r": RequestChecksums(num_tokens, {0: group})},
    )
    return combine_workers([worker])


def compare(
    producer: Record, consumer: Record, consumer_tokens: int, window: AttentionWindow | None
) -> GroupComparison:
    windows = {} if window is None else {0: window}
    report = compare_records(
        producer, consumer, token_counts=({}, {"r": consumer_tokens}), windows=windows
    )
    return report.requests["r"][0]


# (chunk, tokens, the positions of 16-token blocks inside the current chunk): the next
# token at `tokens` attends to tokens (tokens // chunk) * chunk .. tokens.
CHUNKED = [
    (32, 100, [6]),  # chunk 96..127: block 6 (96..111), tokens 96..99
    (32, 95, [4, 5]),  # chunk 64..95: blocks 4 and 5
    (32, 96, []),  # chunk 96..: block 6 holds no token yet, blocks 0..5 are freed
    (8, 90, [5]),  # chunk 88..95 lies in block 5 (80..95), which is kept whole
    (24, 70, [3, 4]),  # chunk 48..71: blocks 3 (48..63) and 4 (64..69)
    (64, 40, [0, 1, 2]),  # chunk 0..63: every block
]


@pytest.mark.parametrize(("chunk", "tokens", "inside"), CHUNKED)
def test_chunked_groups_expect_the_current_chunk_only(
    chunk: int, tokens: int, inside: list[int]
) -> None:
    rng = random.Random(chunk * 1000 + tokens)
    count = -(-tokens // 16)
    totals = [rng.getrandbits(64) for _ in range(count)]
    window = AttentionWindow(chunk, chunked=True)
    producer = record(tokens, 16, 0, totals)
    # A consumer that freed the earlier chunks, as the engine does.
    first = inside[0] if inside else count
    freed = record(tokens, 16, first, totals[first:])
    group = compare(producer, freed, tokens, window)
    assert (group.missing_positions, group.compared) == ([], len(inside))
    assert group.passes()
    # Without the chunk rule, the freed positions are missing.
    plain = compare(producer, freed, tokens, None)
    assert plain.missing_positions == list(range(first))
    if not inside:
        return
    # A consumer without the chunk's first block lacks a position it should hold.
    lacking = record(tokens, 16, first + 1, totals[first + 1 :])
    group = compare(producer, lacking, tokens, window)
    assert group.missing_positions == [inside[0]] and not group.passes()
    # A differing block inside the chunk differs.
    broken = list(totals[first:])
    broken[-1] ^= 1 << 17
    group = compare(producer, record(tokens, 16, first, broken), tokens, window)
    assert group.mismatched_positions == [inside[-1]] and group.missing_positions == []


def test_chunked_positions_kept_on_both_sides() -> None:
    """Chunk 32: the producer at 100 tokens keeps block 6 on; a consumer that decoded to
    110 is in the same chunk (96..127) and keeps it too, one at 130 is in the next chunk
    (128..159), has freed blocks 0..7 and expects none of the producer's positions."""
    rng = random.Random(5)
    totals = [rng.getrandbits(64) for _ in range(7)]
    window = AttentionWindow(32, chunked=True)
    producer = record(100, 16, 6, totals[6:])
    same_chunk = compare(producer, record(100, 16, 6, totals[6:]), 110, window)
    assert (same_chunk.missing_positions, same_chunk.compared) == ([], 1)
    assert compare(producer, record(100, 16, 6, []), 110, window).missing_positions == [6]
    next_chunk = compare(producer, record(100, 16, 8, []), 130, window)
    assert (next_chunk.missing_positions, next_chunk.compared) == ([], 0)


def test_chunked_across_block_sizes() -> None:
    """Chunk 64, 100 tokens: the producer (16-token blocks) keeps blocks 4..6 (tokens
    64..99), the consumer (64-token blocks) block 1; compared at 64, position 1 is
    expected. Chunk 32: the producer keeps only tokens 96.. of coarse block 1, so no
    coarse position is kept whole on it and none is expected."""
    rng = random.Random(6)
    fine = [rng.getrandbits(64) for _ in range(7)]
    coarse = [sum(fine[4 * q : 4 * q + 4]) % 2**64 for q in range(2)]
    producer = record(100, 16, 4, fine[4:])
    window = AttentionWindow(64, chunked=True)
    group = compare(producer, record(100, 64, 1, coarse[1:]), 100, window)
    assert (group.block_size, group.missing_positions, group.compared) == (64, [], 1)
    group = compare(producer, record(100, 64, 0, coarse[:1]), 100, window)
    assert group.missing_positions == [1]
    narrow = AttentionWindow(32, chunked=True)
    group = compare(record(100, 16, 6, fine[6:]), record(100, 64, 0, []), 100, narrow)
    assert (group.missing_positions, group.compared) == ([], 0)


def test_sliding_window_kept_per_side_at_its_own_block_size() -> None:
    """Window 50. The producer (64-token blocks, 149 tokens) attends from token 100, so it
    keeps its blocks 1 and 2; the consumer (16-token blocks, 49 tokens) keeps everything.
    Positions 1 and 2 (at 64) are kept on both; the consumer lacks their tokens."""
    rng = random.Random(7)
    producer = record(149, 64, 1, [rng.getrandbits(64) for _ in range(2)])
    consumer = record(49, 16, 0, [rng.getrandbits(64) for _ in range(4)])
    group = compare(producer, consumer, 49, AttentionWindow(50))
    assert group.missing_positions == [1, 2]
    # An int is a sliding window's size, as before.
    assert compare(producer, consumer, 49, 50).missing_positions == [1, 2]  # type: ignore[arg-type]


# Dumps through the command line: 16-token blocks, chunks of 32 tokens.

BLOCK = 16
CHUNK = 32
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
TOKENS = {"r1": 40, "r2": 21}  # r1's chunk: tokens 32..63, block 2; r2's: 0..31, blocks 0, 1


def engine(
    chunk: int | None, tp_size: int, seed: int, held: dict[str, tuple[int, int]]
) -> list[kb.Worker]:
    """An engine of two chunked-local layers holding ``held[rid] = (start, count)``."""
    layers = tuple(
        kb.Attn(name, 4, 8, type="chunked_local_attention", attention_chunk_size=chunk)
        for name in LAYERS
    )
    model = kb.Model((kb.GroupModel(0, layers, block_size=BLOCK),), model_kv_heads=4)
    requests = {
        rid: kb.make_request(model, n, seed=i + 3) for i, (rid, n) in enumerate(TOKENS.items())
    }
    positions = {rid: {0: span} for rid, span in held.items()}
    return kb.build_engine(model, requests, kb.Engine(tp_size=tp_size, seed=seed), positions)


def write(workers: list[kb.Worker], folder: Path, role: str, tokens: dict[str, int]) -> Path:
    """Each worker's dump in ``folder``, with the token counts ``tokens`` where given."""
    folder.mkdir(parents=True)
    for w in workers:
        path = folder / f"pp{w.pp_rank}-tp{w.tp_rank}.safetensors"
        blocks = {
            rid: RequestBlocks(tokens.get(rid, n), dict(table))
            for rid, (n, table) in w.requests.items()
        }
        info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, role, "test")
        write_dump(
            path, parse_description(w.description, str(path)), w.tensors, blocks, worker=info
        )
    return folder


def diff(producer: Path, consumer: Path, *extra: str, status: int) -> dict:
    result = CliRunner().invoke(
        main, ["diff", str(producer), str(consumer), "--format", "json", *extra]
    )
    assert result.exit_code == status, result.output
    return json.loads(result.stdout)


def r1(report: dict) -> dict:
    return report["requests"]["r1"]["groups"]["0"]


ALL = {"r1": (0, 3), "r2": (0, 2)}


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(engine(CHUNK, 2, 1, ALL), tmp_path_factory.mktemp("chunked") / "p", "producer", {})


def test_a_consumer_that_freed_the_earlier_chunks_passes(producer: Path, tmp_path: Path) -> None:
    freed = write(engine(CHUNK, 4, 2, {"r1": (2, 1), "r2": (0, 2)}), tmp_path / "c", "consumer", {})
    report = diff(producer, freed, status=0)
    assert (r1(report)["missing_positions"], r1(report)["compared"]) == ([], 1)
    assert report["requests"]["r2"]["groups"]["0"]["compared"] == 2


def test_without_a_chunk_size_the_freed_chunks_are_missing(tmp_path: Path) -> None:
    plain = write(engine(None, 2, 1, ALL), tmp_path / "p", "producer", {})
    freed = write(engine(None, 4, 2, {"r1": (2, 1), "r2": (0, 2)}), tmp_path / "c", "consumer", {})
    assert r1(diff(plain, freed, status=1))["missing_positions"] == [0, 1]
    assert diff(plain, freed, "--allow-missing", status=0)["ok"]


@pytest.mark.parametrize(
    ("held", "tokens"),
    [
        ({"r1": (1, 1), "r2": (0, 2)}, {}),  # holds block 1, not the chunk's block 2
        ({"r1": (2, 1), "r2": (0, 2)}, {"r1": 35}),  # lacks tokens 35..39 of block 2
    ],
)
def test_a_consumer_lacking_the_current_chunk_fails(
    producer: Path, tmp_path: Path, held: dict, tokens: dict
) -> None:
    consumer = write(engine(CHUNK, 4, 2, held), tmp_path / "c", "consumer", tokens)
    assert r1(diff(producer, consumer, status=1))["missing_positions"] == [2]
    assert r1(diff(producer, consumer, "--allow-missing", status=0))["missing_positions"] == [2]


def test_a_corrupted_block_inside_the_chunk_differs(producer: Path, tmp_path: Path) -> None:
    workers = engine(CHUNK, 4, 2, {"r1": (2, 1), "r2": (0, 2)})
    block_id = workers[1].requests["r1"][1][0][1][0]
    tensor = workers[1].tensors[LAYERS[1]]
    assert not isinstance(tensor, tuple)
    tensor[block_id].view(-1)[5] += 1
    report = diff(producer, write(workers, tmp_path / "c", "consumer", {}), status=1)
    group = r1(report)
    assert (group["mismatched_positions"], group["missing_positions"]) == ([2], [])
    assert {entry["layer"] for entry in group["located"]} == {LAYERS[1]}
