"""kvaudit's connector driven as vLLM 0.33.0 drives it (see harness.py for the source
lines followed): the cache description from the engine's KVCacheConfig, the producer's
wire in kv_transfer_params, TP sums, the consumer's comparison, its log line, counter and
load errors, and the output folder read back as a record."""

from __future__ import annotations

import base64
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import harness as h
import pytest
import torch
from expected import totals
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvaudit import RequestBlocks
from kvaudit.description import load_description
from kvaudit.output_folders import read_output_folder
from kvaudit.records.wire import (
    WireChecksums,
    WireGroup,
    decode_wire_base64,
    encode_wire_base64,
)

Plant = Callable[[h.Engine, SchedulerOutput], None]
PROMPT = list(range(500, 534))  # 34 tokens: two full 16-token blocks and 2 tokens
PROMPT_B = list(range(900, 934))


def example(tmp_path: Path) -> dict:
    """vLLM's ExampleConnector (its save and load run on CPU tensors), shared storage."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "store")},
    }


@pytest.mark.parametrize(
    ("tp_size", "pp_size", "mla", "layout"),
    [
        (1, 1, False, KVCacheLayout.LBHNC),
        (2, 1, False, KVCacheLayout.BLHNC),
        (2, 1, True, KVCacheLayout.LHBNC),
        (1, 1, False, KVCacheLayout.BLNHC),
        (2, 2, False, KVCacheLayout.LBHNC),
    ],
)
def test_producer_sends_its_totals_in_kv_transfer_params(
    tp_size: int, pp_size: int, mla: bool, layout: KVCacheLayout, tmp_path: Path
) -> None:
    """Standalone (nothing wrapped): the producer's wire, summed over TP ranks and PP
    stages, equals the reference totals of the prompt's tokens; the description is the
    engine's."""
    engine = h.make_engine({"output": str(tmp_path)}, None, tp_size=tp_size, mla=mla,
                           layout=layout, head_size=16 if mla else 8,
                           pp_size=pp_size)  # fmt: skip
    engine.add("req-1", PROMPT)
    params = engine.step()["finished"]["req-1"]
    wire = decode_wire_base64(params["kvaudit"], "params")
    assert params["kvaudit_id"] == "req-1"
    assert (wire.num_tokens, wire.numbering) == (34, "request")
    [group] = wire.groups
    want = totals(PROMPT, 34, layers=2, heads=4, head_size=16 if mla else 8, block_size=16,
                  mla=mla, tp_size=tp_size)  # fmt: skip
    assert group.totals.tolist() == want and (group.start, group.block_size) == (0, 16)
    # KVC3: the strong lane, summed over the ranks modulo 2**64 - 59, after the seed lane.
    assert base64.b64decode(params["kvaudit"])[:4] == b"KVC3"
    strong = totals(PROMPT, 34, layers=2, heads=4, head_size=16 if mla else 8, block_size=16,
                    mla=mla, tp_size=tp_size, strong=True)  # fmt: skip
    assert group.strong is not None and group.strong.tolist() == strong
    described = load_description(tmp_path / "workers" / "pp0-tp0" / "cache.yaml")
    spec = described.groups[0].spec
    assert (spec.type, spec.layout, spec.spec_class) == (
        "mla" if mla else "full_attention",
        "NHTC",
        "MLAAttentionSpec" if mla else "FullAttentionSpec",
    )
    assert spec.num_kv_heads == (1 if mla else 4 // tp_size)
    record = read_output_folder(tmp_path)
    assert record.requests["req-1"].groups[0].totals().tolist() == want
    assert record.complete and len(record.workers) == tp_size * pp_size


def seed_only(params: dict) -> dict:
    """The params with the producer's wire re-encoded as KVC2 (the seed lane alone), as a
    producer without the strong lane sends it."""
    wire = decode_wire_base64(params["kvaudit"], "params")
    groups = [
        WireGroup(g.group_id, g.fingerprint, g.block_size, g.start, g.totals) for g in wire.groups
    ]
    kvc2 = encode_wire_base64(WireChecksums(wire.num_tokens, wire.numbering, groups))
    return {**params, "kvaudit": kvc2}


def run_pair(
    tmp_path: Path, plant: Plant | None = None, policy: str = "log", tp_size: int = 1,
    kvc2: bool = False, **engine: Any,
) -> tuple[h.Engine, h.Engine, dict]:  # fmt: skip
    """A producer and a consumer engine moving one prompt through ExampleConnector
    (``kvc2``: the producer's wire re-encoded with the seed lane alone)."""
    settings = {"dump_sample_rate": 1.0, "max_dump_bytes": 1 << 24, "policy": policy}
    producer = h.make_engine({"output": str(tmp_path / "prefill"), **settings},
                             example(tmp_path), engine_id="P", tp_size=tp_size,
                             **engine)  # fmt: skip
    producer.add("req-b", PROMPT_B)
    params_b = producer.step()["finished"]["req-b"]
    producer.add("req-a", PROMPT)
    params = producer.step()["finished"]["req-a"]
    if kvc2:
        params_b, params = seed_only(params_b), seed_only(params)
    consumer = h.make_engine({"output": str(tmp_path / "decode"), **settings},
                             example(tmp_path), engine_id="D", tp_size=tp_size,
                             **engine)  # fmt: skip
    consumer.before_forward = plant
    consumer.add("d-b", PROMPT_B, params_b)
    consumer.step()
    consumer.add("d-a", PROMPT, params)
    out = consumer.step()
    return producer, consumer, out


def counters(engine: h.Engine) -> dict[str, int]:
    total: dict[str, int] = {}
    for stats in engine.stats:
        if stats is not None:
            for key, value in stats.to_dict()["kvaudit"].items():
                total[key] = total.get(key, 0) + value
    return total


def test_a_clean_transfer_matches(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        producer, consumer, _ = run_pair(tmp_path)
    assert "MISMATCH" not in caplog.text
    assert counters(producer)["producer_requests"] == 2
    got = counters(consumer)
    assert got["consumer_requests"] == 2 and got["mismatched_blocks"] == 0
    # The consumer checked what it loaded: ExampleConnector loads the 32 full-block tokens.
    record = read_output_folder(tmp_path / "decode")
    assert record.requests["req-a"].num_tokens == 32
    want = totals(PROMPT, 32, layers=2, heads=4, head_size=8, block_size=16)
    assert record.requests["req-a"].groups[0].totals().tolist() == want


def corrupt_block(position: int, layer: int = 1, head: int = 2, token: int = 5) -> Plant:
    """Flip one bit of the consumer's loaded KV of request d-a (after the load, before
    the forward), as a broken transfer would."""

    def plant(engine: h.Engine, output: SchedulerOutput) -> None:
        if "d-a" not in output.num_scheduled_tokens:
            return
        block = engine.tables["d-a"][position]
        for worker in engine.workers:
            heads = worker.caches[h.LAYER.format(layer)].shape[1]
            if worker.rank * heads <= head < (worker.rank + 1) * heads:
                cell = worker.caches[h.LAYER.format(layer)][block, head % heads, token]
                cell.view(torch.int16)[3] ^= 0x40

    return plant


def test_a_corrupted_block_is_logged_counted_and_dumped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tp_size = 1
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        _, consumer, _ = run_pair(tmp_path, corrupt_block(1), tp_size=tp_size)
    lines = [r.getMessage() for r in caplog.records if "MISMATCH" in r.getMessage()]
    block = consumer.tables["d-a"][1]
    assert lines == [
        f"kvaudit: MISMATCH request req-a group 0: positions [1] (blocks [{block}]) differ "
        "from the producer's checksums (positions 0-1 compared); looked up among the last "
        "65536 blocks received from the producer: no recent producer block holds these "
        "checksums"
    ]
    got = counters(consumer)
    assert (got["mismatched_requests"], got["mismatched_blocks"]) == (1, 1)
    for side in ("prefill", "decode"):
        dumps = sorted((tmp_path / side / "dumps" / "req-a").glob("*.safetensors"))
        assert [p.name for p in dumps] == [f"pp0-tp{r}.safetensors" for r in range(tp_size)]


def sign_flips(position: int) -> Plant:
    """Flip bit 63 (the top bit of the last byte) of two 8-byte pieces of block
    ``position`` of request d-a, in two cells of two layers: each flip changes the seed
    lane by 2**63 times an odd weight, so the two cancel there (docs/checksum.md)."""

    def plant(engine: h.Engine, output: SchedulerOutput) -> None:
        if "d-a" not in output.num_scheduled_tokens:
            return
        block = engine.tables["d-a"][position]
        for layer, head, token, piece in ((1, 2, 5, 0), (0, 1, 9, 1)):
            for worker in engine.workers:
                cache = worker.caches[h.LAYER.format(layer)]
                heads = cache.shape[1]
                if worker.rank * heads <= head < (worker.rank + 1) * heads:
                    cell = cache[block, head % heads, token].view(torch.uint8)
                    cell[8 * piece + 7] ^= 0x80

    return plant


def mismatch_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "MISMATCH" in r.getMessage()]


def test_two_sign_flips_in_one_block_are_a_mismatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two sign bits flipped in one loaded block leave its seed lane as the producer's
    (the reference's totals of the clean prompt), yet the strong lane the producer sent
    (KVC3) differs: a mismatch naming the block."""
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        _, consumer, _ = run_pair(tmp_path, sign_flips(1))
    block = consumer.tables["d-a"][1]
    [line] = mismatch_lines(caplog)
    assert line.startswith(
        f"kvaudit: MISMATCH request req-a group 0: positions [1] (blocks [{block}]) differ "
    ), line
    assert "seed lane only" not in line
    got = counters(consumer)
    assert (got["mismatched_requests"], got["mismatched_blocks"]) == (1, 1)
    # The seed lane alone sees nothing: the consumer's seed totals are the clean prompt's.
    want = totals(PROMPT, 32, layers=2, heads=4, head_size=8, block_size=16)
    assert (
        read_output_folder(tmp_path / "decode").requests["req-a"].groups[0].totals().tolist()
        == want
    )


def test_two_sign_flips_in_one_replica_are_a_mismatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MLA at TP=2: both consumer ranks hold the latent (replicas 0 and 1). Two sign bits
    flipped in rank 1's copy of one block leave replica 0 as the producer's and both
    replicas' seed lanes equal; their strong lanes differ: a mismatch naming the block."""

    def plant(engine: h.Engine, output: SchedulerOutput) -> None:
        if "d-a" in output.num_scheduled_tokens:
            block = engine.tables["d-a"][1]
            data = engine.workers[1].caches[h.LAYER.format(0)][block].reshape(-1)
            data = data.view(torch.uint8)
            data[7] ^= 0x80  # bit 63 of the block's first piece
            data[15] ^= 0x80  # and of its second

    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        _, consumer, _ = run_pair(tmp_path, plant, tp_size=2, mla=True, head_size=16)
    [line] = mismatch_lines(caplog)
    block = consumer.tables["d-a"][1]
    assert line.startswith(
        f"kvaudit: MISMATCH request req-a group 0: positions [1] (blocks [{block}]) differ "
    ), line
    group = read_output_folder(tmp_path / "decode").requests["req-a"].groups[0]
    assert len({tuple(column) for column in group.values.T.tolist()}) == 1  # seed: equal


def test_a_kvc2_producer_is_compared_by_the_seed_lane_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer that sends the seed lane alone (KVC2): an intact transfer matches, a
    one-bit fault is still a mismatch, and each line says once that only the seed lane
    was compared (so the two sign flips above would pass: the lane cannot see them)."""
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        _, consumer, _ = run_pair(tmp_path / "clean", sign_flips(1), kvc2=True)
    matched = [r.getMessage() for r in caplog.records if r.getMessage().endswith(": match")]
    assert len(matched) == 2 and not mismatch_lines(caplog)
    for line in matched:
        assert line.count("compared by the seed lane only") == 1, line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        _, consumer, _ = run_pair(tmp_path / "bad", corrupt_block(1), kvc2=True)
    [line] = mismatch_lines(caplog)
    block = consumer.tables["d-a"][1]
    assert line.startswith(
        f"kvaudit: MISMATCH request req-a group 0: positions [1] (blocks [{block}]) differ "
    )
    assert line.count("; compared by the seed lane only (the producer sent no strong lane)") == 1


def test_a_stale_block_names_its_source(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Block 1 of d-a holds block 1 of d-b (req-b's KV): the log names req-b position 1."""

    def stale(engine: h.Engine, output: SchedulerOutput) -> None:
        if "d-a" in output.num_scheduled_tokens:
            for worker in engine.workers:
                for cache in worker.caches.values():
                    cache[engine.tables["d-a"][1]] = cache[engine.tables["d-b"][1]]

    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        run_pair(tmp_path, stale)
    [line] = [r.getMessage() for r in caplog.records if "MISMATCH" in r.getMessage()]
    assert line.endswith(
        "looked up among the last 65536 blocks received from the producer: "
        "position 1 holds req-b position 1 (a stale block)"
    )


def test_example_connector_under_tp_2_is_caught(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ExampleConnector names its files by layer and prompt only: under TP=2 both ranks
    write one file, and each consumer rank loads the shard written last. kvaudit reports
    every block of both requests."""
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        _, consumer, _ = run_pair(tmp_path, tp_size=2)
    lines = sorted(r.getMessage() for r in caplog.records if "MISMATCH" in r.getMessage())
    assert [line.split(" (")[0] for line in lines] == [
        "kvaudit: MISMATCH request req-a group 0: positions [0, 1]",
        "kvaudit: MISMATCH request req-b group 0: positions [0, 1]",
    ]
    assert counters(consumer)["mismatched_blocks"] == 4


def test_a_group_it_cannot_describe_is_not_covered_with_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A group of the engine's KVCacheConfig that kvaudit cannot describe (its heads packed
    into slots) is in every record's ``not_covered``, with the reason, beside the group it
    checksums; its description and the log say so too."""
    layout = KVCacheLayout.LBHNC
    spec = h.attention_spec(16, 4, 8)
    attention = h.cache_config(spec, 2, 24, layout)
    slotted = h.cache_config(dataclasses.replace(spec, num_head_slots=8), [2], 24, layout)
    kv_cache_config = dataclasses.replace(
        attention,
        kv_cache_tensors=attention.kv_cache_tensors + slotted.kv_cache_tensors,
        kv_cache_groups=attention.kv_cache_groups + slotted.kv_cache_groups,
    )
    config = h.vllm_config(h.transfer_config({"output": str(tmp_path)}, None), 16)
    with (
        mock.patch.object(h.worker_hooks, "worker_ranks", return_value=(0, 1, 0, 1)),
        caplog.at_level(logging.WARNING, logger="kvaudit.vllm"),
    ):
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )
        connector.register_kv_caches(
            allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
        )
    reason = "layer model.layers.2.self_attn.attn packs heads or tokens into slots"
    logged = [r.getMessage() for r in caplog.records if r.name == "kvaudit.vllm"]
    assert logged == [f"kvaudit: KV cache group 1 is not audited: {reason}"]
    for checksummer in connector.worker_audit.checksummers.values():
        record = checksummer.checksum({"req-1": RequestBlocks(20, {0: (0, [3, 5])})})
        assert record.not_covered == {1: reason}
        assert list(record.requests["req-1"].groups) == [0]
        assert list(record.fingerprints) == [0]
    described = load_description(tmp_path / "workers" / "pp0-tp0" / "cache.yaml")
    assert [group.id for group in described.groups] == [0]
