"""Faults the seed lane alone can miss, planted by hand in real bf16 KV, and the verdict of
both lanes: every pair of sign flips in one block and every one- and two-bit fault in the
top 8 bits of its pieces is a mismatch (docs/checksum.md, "The strong lane").

The block is small (2 layers x 2 heads x 2 tokens x 4 pieces of 8 bytes: a bf16 cell of
K and V with head size 8), so every fault of each family fits in one engine: the producer
holds the same block once per fault, the consumer each copy with one fault planted, and
the library compares all of them in one call (one request whose position ``i`` holds
fault ``i``: positions are compared one by one). A sample goes through the real ``kvaudit
diff`` and ``kvaudit verify`` (``--against``, ``--received``). The seed lane alone misses
the two sign flips of bit 63 (each adds 2**63 to the sum, two add 2**64 = 0): with
``--seed-lane-only`` that case matches, which is why the strong lane exists.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.cli import main
from kvaudit.compare import compare_records, verify_against_record
from kvaudit.compare.received import verify_received
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import Record, WorkerInfo, combine_workers
from kvaudit.records.wire import WireChecksums, decode_wire, encode_wire

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, TOKENS, HEAD_SIZE, PIECES = 2, 2, 8, 4
"""Per layer ``[blocks, tokens, heads, 2 * head size]`` bf16 (layout NTHC): a cell is K
then V, 32 bytes, 4 pieces."""

Bit = tuple[int, int, int, int, int]
"""``(layer, token, head, piece, bit)``: one bit of one piece of the block."""

SIGN_BITS = (15, 31, 47, 63)
"""The sign bits of the four bf16 elements of a piece."""
TOP_BITS = tuple(range(56, 64))


def description(num_blocks: int) -> dict:
    """The cache description of one attention group of the block's shape."""
    spec = {
        "block_size": TOKENS,
        "type": "full_attention",
        "kernel_block_size": TOKENS,
        "num_kv_heads": HEADS,
        "head_size": HEAD_SIZE,
        "head_size_v": HEAD_SIZE,
        "dtype": "bfloat16",
        "layout": "NTHC",
    }
    group = {"id": 0, "transfer": True, "host_resident": False, "spec": spec}
    return {
        "kvaudit": 1,
        "num_blocks": num_blocks,
        "groups": [{**group, "layers": list(LAYERS)}],
        "model_kv_heads": HEADS,
    }


def every_bit(bits: tuple[int, ...]) -> list[Bit]:
    """Each listed bit of every piece of the block."""
    return list(
        itertools.product(range(len(LAYERS)), range(TOKENS), range(HEADS), range(PIECES), bits)
    )


def fault_families() -> dict[str, list[tuple[Bit, ...]]]:
    """Every pair of sign flips; every one- and two-bit fault in the top 8 bits."""
    signs, top = every_bit(SIGN_BITS), every_bit(TOP_BITS)
    return {
        "sign pairs": list(itertools.combinations(signs, 2)),
        "top single": [(bit,) for bit in top],
        "top pairs": list(itertools.combinations(top, 2)),
    }


def base_block() -> dict[str, torch.Tensor]:
    """One block of real bf16 KV per layer ``[tokens, heads, 2 * head size]``."""
    generator = torch.Generator().manual_seed(37)
    shape = (TOKENS, HEADS, 2 * HEAD_SIZE)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name in LAYERS}


def engine(faults: list[tuple[Bit, ...]] | None, count: int) -> dict[str, torch.Tensor]:
    """``count`` copies of the base block (block ``i`` holds request ``f{i}``); with
    ``faults``, block ``i`` has fault ``i`` planted: each bit flipped in the bytes, by the
    little-endian reading of a piece (bit ``b`` of piece ``p`` is bit ``b % 8`` of byte
    ``8 p + b // 8`` of the cell)."""
    base = base_block()
    tensors = {name: block.unsqueeze(0).repeat(count, 1, 1, 1) for name, block in base.items()}
    if faults is not None:
        raw = {name: tensor.view(torch.uint8) for name, tensor in tensors.items()}  # shares
        for block, fault in enumerate(faults):
            for layer, token, head, piece, bit in fault:
                byte = 8 * piece + bit // 8
                raw[LAYERS[layer]][block, token, head, byte] ^= 1 << (bit % 8)
    return tensors


def blocks_of(count: int, *, one_request: bool = False) -> dict[str, RequestBlocks]:
    """Request ``f{i}``: ``TOKENS`` tokens in block ``i``; ``one_request``: request
    ``all`` with block ``i`` at position ``i``."""
    if one_request:
        return {"all": RequestBlocks(TOKENS * count, {0: (0, list(range(count)))})}
    return {f"f{i}": RequestBlocks(TOKENS, {0: (0, [i])}) for i in range(count)}


def record(
    tensors: dict[str, torch.Tensor],
    role: str,
    *,
    strong_lane: bool = True,
    one_request: bool = False,
) -> Record:
    """The engine's record, computed by the checksummer (one worker)."""
    count = next(iter(tensors.values())).shape[0]
    summer = Checksummer(
        parse_description(description(count), source="test"),
        tensors,
        role=role,
        backend="numpy",
        strong_lane=strong_lane,
    )
    blocks = blocks_of(count, one_request=one_request)
    return combine_workers([summer.checksum(blocks, "request")])


def test_every_small_fault_is_a_mismatch_and_the_seed_lane_alone_misses_bit_63_pairs() -> None:
    families = fault_families()
    faults = [fault for family in families.values() for fault in family]
    assert len(families["sign pairs"]) == 128 * 127 // 2
    assert len(families["top pairs"]) == 256 * 255 // 2
    producer = record(engine(None, len(faults)), "producer", one_request=True)
    consumer = record(engine(faults, len(faults)), "consumer", one_request=True)
    every = list(range(len(faults)))

    report = compare_records(producer, consumer)
    assert not report.warnings
    assert report.compared == len(faults)
    assert report.requests["all"][0].mismatched_positions == every
    # verify --against compares every column as well: the same verdict.
    assert (
        verify_against_record(consumer, producer).requests["all"][0].mismatched_positions == every
    )

    # The seed lane alone: each flip of bit 63 adds 2**63 whatever its (odd) weight, so
    # every pair of them cancels; the report says the verdict rests on it.
    seed = compare_records(producer, consumer, seed_lane_only=True)
    assert seed.warnings == ["compared by the seed lane only: --seed-lane-only was given"]
    missed = set(every) - set(seed.requests["all"][0].mismatched_positions)
    bit_63_pairs = {
        i for i, fault in enumerate(faults) if len(fault) == 2 and {b[4] for b in fault} == {63}
    }
    assert bit_63_pairs <= missed
    assert len(bit_63_pairs) == 32 * 31 // 2 * 2  # in the sign pairs and in the top pairs


def test_a_side_without_the_strong_lane_is_compared_by_the_seed_lane_and_said() -> None:
    fault = ((0, 1, 1, 2, 63), (1, 0, 0, 3, 63))
    producer = record(engine(None, 1), "producer", strong_lane=False)
    consumer = record(engine([fault], 1), "consumer")
    report = compare_records(producer, consumer)
    assert report.ok  # what the seed engine's records can tell
    assert report.warnings == [
        "compared by the seed lane only: the producer carries no strong lane"
    ]
    assert report.requests["f0"][0].seed_lane_only == "the producer carries no strong lane"


def test_received_wire_kvc3_sees_the_fault_and_kvc2_is_the_seed_lane_alone() -> None:
    fault = ((0, 0, 1, 0, 63), (1, 1, 0, 1, 63))
    producer = record(engine(None, 1), "producer")
    consumer = record(engine([fault], 1), "consumer")
    sent = producer.requests["f0"]
    wire = WireChecksums(sent.num_tokens, "request", [sent.groups[0].to_wire(0)])
    data = encode_wire(wire)
    assert data[:4] == b"KVC3"
    assert decode_wire(data) == wire
    strong = verify_received(consumer, {"f0": data}, source="wire")
    assert not strong.ok and strong.requests["f0"][0].mismatched_positions == [0]
    seed_wire = WireChecksums(sent.num_tokens, "request", [sent.groups[0].to_wire(0)])
    seed_wire.groups[0].strong = None
    seed_bytes = encode_wire(seed_wire)
    assert seed_bytes[:4] == b"KVC2"
    seed = verify_received(consumer, {"f0": seed_bytes}, source="wire")
    assert seed.ok
    assert seed.warnings == ["compared by the seed lane only: the producer carries no strong lane"]


# Through the commands.

SAMPLE_SIZE = 20


def sample() -> list[tuple[Bit, ...]]:
    """20 faults of the three families, the two bit-63 sign flips first."""
    families = fault_families()
    rng = np.random.default_rng(37)
    picks: list[tuple[Bit, ...]] = [((0, 0, 0, 0, 63), (1, 1, 1, 3, 63))]
    for family in families.values():
        for index in rng.choice(len(family), size=(SAMPLE_SIZE - 1) // 3 + 1, replace=False):
            if len(picks) < SAMPLE_SIZE:
                picks.append(family[int(index)])
    return picks


def write(path: Path, tensors: dict[str, torch.Tensor], role: str, **extra: object) -> None:
    count = next(iter(tensors.values())).shape[0]
    info = WorkerInfo(0, 1, 0, 1, role, "test")
    parsed = parse_description(description(count), source=str(path))
    write_dump(path, parsed, tensors, blocks_of(count), worker=info, **extra)


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(arg) for arg in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("strong")
    faults = sample()
    producer = engine(None, len(faults))
    paths = {name: folder / f"{name}.safetensors" for name in ("producer", "consumer")}
    write(paths["producer"], producer, "producer")
    sent = record(producer, "producer")
    received = {
        rid: encode_wire(
            WireChecksums(request.num_tokens, "request", [request.groups[0].to_wire(0)])
        )
        for rid, request in sent.requests.items()
    }
    write(paths["consumer"], engine(faults, len(faults)), "consumer", received=received)
    paths["record"] = folder / "producer.json"
    status, output = run("checksum", paths["producer"], "--format", "json", "-o", paths["record"])
    assert status == 0, output
    return paths


def test_diff_and_verify_commands_never_say_match(dumps: dict[str, Path]) -> None:
    ways = {
        "diff": ("diff", dumps["producer"], dumps["consumer"]),
        "against": ("verify", dumps["consumer"], "--against", dumps["record"]),
        "received": ("verify", dumps["consumer"], "--received"),
    }
    for name, args in ways.items():
        status, output = run(*args, "--format", "json", "-q")
        assert status == 1, (name, output)
        data = json.loads(output[output.index("{") :])
        verdicts = {
            rid: group["mismatched_positions"]
            for rid, request in data["requests"].items()
            for group in request["groups"].values()
        }
        assert verdicts == {f"f{i}": [0] for i in range(SAMPLE_SIZE)}, name
        assert not data["warnings"], name


def test_the_seed_lane_alone_misses_two_sign_flips_at_bit_63(dumps: dict[str, Path]) -> None:
    ways = {
        "diff": ("diff", dumps["producer"], dumps["consumer"]),
        "against": ("verify", dumps["consumer"], "--against", dumps["record"]),
        "received": ("verify", dumps["consumer"], "--received"),
    }
    for name, args in ways.items():
        status, output = run(*args, "--request", "f0", "-q")
        assert status == 1, (name, output)
        status, output = run(*args, "--request", "f0", "--seed-lane-only", "-q")
        assert status == 0, (name, output)
        assert "compared by the seed lane only: --seed-lane-only was given" in output
