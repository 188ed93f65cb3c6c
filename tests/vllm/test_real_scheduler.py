"""kvaudit's connector under vLLM 0.33.0's real ``Scheduler`` (``real_engine.py``): a
producer and a consumer engine through ExampleConnector, an asynchronous connector of
the tests' own, NIXL's scheduler side and MultiConnector; local prefix hits, chunked
prefill, preemption, aborts, async scheduling, many requests. After every lifecycle the
block pool is full again; every verdict is checked against the tests' own reference
totals (``expected.py``) or against a fault planted where it is reported."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import async_store
import cpu_engine as r
import harness as h
import pytest
import torch
from expected import totals
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from kvaudit.integrations.vllm import plugin
from kvaudit.output_folders import read_output_folder
from kvaudit.records.wire import decode_wire_base64

ROOT = Path(__file__).parent.parent.parent
STORE = {"kv_connector": "AsyncStoreConnector", "kv_connector_module_path": "async_store"}
SYNC_STORE = {"kv_connector": "SyncStoreConnector", "kv_connector_module_path": "async_store"}
PROMPT = r.prompt(100, 80)  # five 16-token blocks


@pytest.fixture(autouse=True)
def clean_store() -> None:
    async_store.reset()


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-model")


def example(folder: Path) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(folder / "store")},
    }


def engine(
    model: Path, folder: Path, name: str, wrapped: dict | None, role: str, **settings: object
) -> r.Engine:
    """An engine with kvaudit's connector writing to ``folder / name``."""
    options = {k: settings.pop(k) for k in list(settings) if k in ENGINE_OPTIONS}
    kvaudit = {"output": str(folder / name), **settings}
    transfer = h.transfer_config(kvaudit, wrapped, role, engine_id=name)
    return r.make_engine(model, transfer, **options)


ENGINE_OPTIONS = (
    "tp_size",
    "step_tokens",
    "num_blocks",
    "async_scheduling",
    "drafter",
    "max_seqs",
    "worker_transfer",
    "prefix_caching",
)


def produce(
    model: Path, folder: Path, wrapped: dict, prompts: dict[str, list[int]], **settings: object
) -> tuple[r.Engine, dict[str, dict]]:
    """A producer engine's run of the prompts; their kv_transfer_params."""
    producer = engine(model, folder, "prefill", wrapped, "kv_producer", **settings)
    for rid, tokens in prompts.items():
        producer.add(rid, tokens)
    producer.run()
    assert producer.all_blocks_free()
    return producer, {rid: producer.params(rid) for rid in prompts}


def want(prompt: list[int], num_tokens: int, tp_size: int = 1) -> list[int]:
    return totals(
        prompt,
        num_tokens,
        layers=r.LAYERS,
        heads=r.HEADS,
        head_size=r.HEAD_SIZE,
        block_size=16,
        tp_size=tp_size,
    )


def messages(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [
        x.getMessage()
        for x in caplog.records
        if x.name == "kvaudit.vllm" and word in x.getMessage()
    ]


def flip_loaded(rid: str, position: int, layer: int = 1, head: int = 1, token: int = 2) -> r.Plant:
    """Flip one bit of a block the consumer loaded (after a sync load, before the
    forward), as a broken transfer would."""

    def plant(engine: r.Engine, output: object) -> None:
        if rid in output.num_scheduled_tokens and output.has_sync_kv_loads:
            block = engine.table(rid)[position]
            for worker in engine.workers:
                cache = worker.caches[h.LAYER.format(layer)]
                first = worker.rank * engine.heads_per_rank
                if first <= head < first + cache.shape[1]:
                    cache[block, head - first, token].view(torch.int16)[1] ^= 0x40

    return plant


# A local prefix hit on the consumer.


def test_after_a_local_prefix_hit_the_loaded_blocks_are_checked(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode engine holds 3 of the prompt's 5 blocks (another request computed
    them); ExampleConnector loads block 3 (it loads whole blocks, the tail is computed):
    a bit flipped in block 3 is found at position 3, the report says 0-2 were held
    locally and not compared, both sides dump, and ``kvaudit diff`` locates the byte."""
    _, params = produce(
        model,
        tmp_path,
        example(tmp_path),
        {"req-a": PROMPT},
        dump_sample_rate=1.0,
        max_dump_bytes=1 << 24,
    )
    decode = engine(
        model, tmp_path, "decode", example(tmp_path), "kv_consumer", max_dump_bytes=1 << 24
    )
    decode.add("warm", [*PROMPT[:48], 1, 2, 3])
    decode.run()
    decode.before_forward = flip_loaded("d-a", position=3)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=3)
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    block = line.split("(blocks [")[1].split("]")[0]
    assert line == (
        f"kvaudit: MISMATCH request req-a group 0: positions [3] (blocks [{block}]) differ "
        "from the producer's checksums (position 3 compared; 0-2 held locally (prefix "
        "cache), not compared); looked up among the last 65536 blocks received from the "
        "producer: no recent producer block holds these checksums"
    )
    got = decode.connector_counters()
    assert (got["checked_blocks"], got["local_blocks"], got["mismatched_blocks"]) == (1, 3, 1)
    assert got["dumps_written"] == 1
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81, r.SAMPLED + 82]
    assert decode.all_blocks_free()
    record = read_output_folder(tmp_path / "decode")
    group = record.requests["req-a"].groups[0]
    assert (group.start, group.end) == (3, 4)
    report = located(tmp_path, "req-a", "--allow-missing")
    assert report["mismatched_positions"] == [3]
    [entry] = report["located"]
    assert (entry["layer"], entry["head"], entry["tokens"]) == (h.LAYER.format(1), 1, [50])


def test_a_fault_in_a_block_held_locally_is_not_the_transfers(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode engine's own prefix blocks are never compared bitwise with the
    producer's (they may differ legitimately) nor reported as checked."""
    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT})
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer")
    warm: list[int] = []
    decode.before_forward = lambda e, out: warm.extend(e.table("warm")) if not warm else None
    decode.add("warm", [*PROMPT[:48], 1, 2, 3])
    decode.run()
    decode.before_forward = None
    for worker in decode.workers:  # the cached copy of position 1 differs from the producer's
        worker.caches[h.LAYER.format(0)][warm[1]].view(torch.int16)[0, 0, 0] ^= 1
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"])
        decode.run()
    assert not messages(caplog, "MISMATCH")
    [line] = messages(caplog, "match")
    assert line == (
        "kvaudit: request req-a group 0: positions 3-4 compared; 0-2 held locally (prefix "
        "cache), not compared: match"
    )
    got = decode.connector_counters()
    assert (got["checked_blocks"], got["local_blocks"], got["unverified_blocks"]) == (2, 3, 0)
    record = read_output_folder(tmp_path / "decode")
    assert record.requests["req-a"].groups[0].totals().tolist() == want(PROMPT, 80)[3:]
    assert decode.all_blocks_free()


def located(folder: Path, request: str, *options: str) -> dict:
    """``kvaudit diff`` of the request's prefill and decode dump folders (a mismatch,
    exit 1): the JSON report of its group 0."""
    dumps = [folder / side / "dumps" / request for side in ("prefill", "decode")]
    done = kvaudit("diff", *dumps, *options, "--format", "json")
    assert done.returncode == 1, done.stderr
    return json.loads(done.stdout)["requests"][request]["groups"]["0"]


def kvaudit(*args: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvaudit", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize("tp_size", [1, 2])
def test_an_async_load_after_a_local_hit_checks_its_partial_last_block(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, tp_size: int
) -> None:
    """A 70-token prompt (4 blocks and 6 tokens), 2 blocks held locally: the store loads
    positions 2-4, the last one partial (vLLM then recomputes the prompt's last token);
    all three are compared (their checksums summed over the TP ranks), a flipped bit in
    the partial block is found."""
    tokens = r.prompt(300, 70)
    _, params = produce(model, tmp_path, STORE, {"req-a": tokens}, tp_size=tp_size)
    wire = decode_wire_base64(params["req-a"]["kvaudit"], "params")
    assert wire.groups[0].totals.tolist() == want(tokens, 70)
    async_store.LATENCY["steps"] = 2
    async_store.DAMAGE.update(layer=h.LAYER.format(0), position=4)
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer", tp_size=tp_size)
    decode.add("warm", [*tokens[:32], 5, 6])
    decode.run()
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", tokens, params["req-a"], max_tokens=2)
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    assert line.startswith("kvaudit: MISMATCH request req-a group 0: positions [4] ")
    assert " (positions 2-4 compared; 0-1 held locally (prefix cache), not compared); " in line
    got = decode.connector_counters()
    assert (got["checked_blocks"], got["local_blocks"], got["mismatched_blocks"]) == (3, 2, 1)
    record = read_output_folder(tmp_path / "decode")
    assert record.requests["req-a"].num_tokens == 70
    assert decode.all_blocks_free()


def test_chunked_prefill_on_the_producer_sends_the_whole_prompts_totals(
    model: Path, tmp_path: Path
) -> None:
    """32-token chunks (and a local hit of the producer's own cache): the wire is taken
    in the step that completes the prompt and equals the reference totals."""
    producer = engine(model, tmp_path, "prefill", STORE, "kv_producer", step_tokens=32)
    producer.add("warm", [*PROMPT[:32], 9])
    producer.run()
    producer.add("req-a", PROMPT)
    producer.run()
    wire = decode_wire_base64(producer.params("req-a")["kvaudit"], "params")
    assert wire.num_tokens == 80
    assert wire.groups[0].totals.tolist() == want(PROMPT, 80)
    assert producer.all_blocks_free()


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_a_request_that_finishes_before_its_transfer_still_sends_its_totals(
    model: Path, tmp_path: Path, finish: str
) -> None:
    """The producer's request ends with its first token (its length, or a stop token):
    its KV is complete and its totals are in the params it hands back."""
    producer = engine(model, tmp_path, "prefill", STORE, "kv_producer")
    producer.add(
        "req-a",
        PROMPT,
        max_tokens=1 if finish == "length" else 5,
        stop=r.SAMPLED + 80 if finish == "stop" else None,
    )
    producer.run()
    out = producer.finished("req-a")
    assert out is not None and str(out.finish_reason) == finish
    wire = decode_wire_base64(producer.params("req-a")["kvaudit"], "params")
    assert wire.groups[0].totals.tolist() == want(PROMPT, 80)
    assert producer.all_blocks_free()


def test_a_drafters_deferred_save_keeps_the_producers_totals(model: Path, tmp_path: Path) -> None:
    """With a drafter, vLLM's model runner collects transfer results before
    ``wait_for_save`` (``post_forward(defer_finalize=True)``, then ``finalize_step``):
    the producer's checksums are taken at ``finish_forward`` and still travel."""
    producer = engine(model, tmp_path, "prefill", STORE, "kv_producer", drafter=True)
    producer.add("req-a", PROMPT)
    producer.run()
    wire = decode_wire_base64(producer.params("req-a")["kvaudit"], "params")
    assert wire.groups[0].totals.tolist() == want(PROMPT, 80)
    assert producer.all_blocks_free()


def consumer_run(model: Path, tmp_path: Path, policy: str, **options: object) -> r.Engine:
    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT})
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer", policy=policy, **options)
    decode.add("d-a", PROMPT, params["req-a"], max_tokens=4)
    return decode


def held(engine: r.Engine, rid: str) -> bool:
    return any(rid in w.connector.worker_audit._held for w in engine.workers)


@pytest.mark.parametrize("policy", ["log", "fail"])
def test_an_abort_during_an_async_load_frees_every_block(
    model: Path, tmp_path: Path, policy: str
) -> None:
    """Aborted while its load is in flight: the receive is still reported once it
    ends, and vLLM frees the blocks."""
    async_store.LATENCY["steps"] = 3
    decode = consumer_run(model, tmp_path, policy)
    decode.step()
    decode.step()
    assert decode.scheduler.requests["d-a"].status.name == "WAITING_FOR_REMOTE_KVS"
    decode.abort("d-a")
    decode.run()
    assert decode.all_blocks_free()
    assert not decode.generated("d-a")


def test_an_abort_while_a_load_is_held_for_its_verdict_frees_every_block(
    model: Path, tmp_path: Path
) -> None:
    """Policy ``fail`` under async scheduling: the worker holds the finished load for
    the scheduler's verdict, and the request is aborted before the verdict (its
    checksums still on their way): the load is let go with the abort."""
    decode = consumer_run(model, tmp_path, "fail", async_scheduling=True)
    for _ in range(10):
        decode.step()
        if held(decode, "d-a"):
            break
    assert held(decode, "d-a")
    decode.abort("d-a")
    decode.run()
    assert decode.all_blocks_free()
    assert not held(decode, "d-a")


@pytest.mark.parametrize("policy", ["log", "fail"])
def test_an_abort_between_two_ranks_loads_leaves_no_audit_state(
    model: Path, tmp_path: Path, policy: str
) -> None:
    """TP=2, rank 1's part of the load ends two steps after rank 0's, and the request is
    aborted in between: rank 1 never checksums it, and kvaudit forgets the request (its
    state, rank 0's checksums) with the abort."""
    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT}, tp_size=2)
    async_store.RANK_LATENCY[1] = 2
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer", policy=policy, tp_size=2)
    decode.add("d-a", PROMPT, params["req-a"], max_tokens=4)
    decode.step()
    decode.step()  # rank 0's part is in
    decode.abort("d-a")
    decode.run()
    decode.step()
    assert decode.all_blocks_free()
    assert not decode.scheduler.connector.scheduler_audit._requests


def test_a_load_that_fails_on_one_rank_is_let_go_on_the_others(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Policy ``fail``, TP=2: rank 1's connector reports the load failed, so it sends no
    checksums; rank 0 would hold its part for a verdict that cannot come. kvaudit lets
    it go, vLLM sees the failed receive and recomputes the request."""
    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT}, tp_size=2)
    async_store.FAILING_RANKS.add(1)
    transfer = h.transfer_config({"output": str(tmp_path / "decode"), "policy": "fail"}, STORE,
                                 "kv_consumer", engine_id="decode")  # fmt: skip
    transfer.kv_load_failure_policy = "recompute"
    decode = r.make_engine(model, transfer, tp_size=2)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=2)
        decode.run()
    assert len(messages(caplog, "its load failed on a worker: not compared")) == 1
    # vLLM loaded it again after the failure: that load was checked.
    assert len(messages(caplog, "positions 0-4 compared: match")) == 1
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81]
    assert decode.all_blocks_free()


@pytest.mark.parametrize("policy", ["log", "fail"])
def test_a_load_failed_on_one_rank_before_the_other_rank_finished(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """TP=2: rank 1's load fails while rank 0's part is still in flight, then vLLM loads
    again. Rank 0's late checksums of the failed load never count towards the second
    load's comparison (which is damaged on rank 0 only, and must be found), and no
    worker holds a part for a verdict that cannot come."""
    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT}, tp_size=2)
    async_store.FAILING_RANKS.add(1)
    async_store.RANK_LATENCY[0] = 2
    async_store.DAMAGE.update(layer=h.LAYER.format(0), position=1, loads={2})
    transfer = h.transfer_config({"output": str(tmp_path / "decode"), "policy": policy}, STORE,
                                 "kv_consumer", engine_id="decode")  # fmt: skip
    transfer.kv_load_failure_policy = "recompute"
    decode = r.make_engine(model, transfer, tp_size=2)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=2)
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    assert line.startswith("kvaudit: MISMATCH request req-a group 0: positions [1] ")
    assert not messages(caplog, "compared: match")
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81]
    assert decode.all_blocks_free()


def test_policy_fail_does_not_load_again_what_failed_its_check(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first block is bad: vLLM recomputes from block 0, which looks the request up
    again; kvaudit declines that load (the store would hand back the same bad copy
    forever), so the prompt is computed here and the request ends."""
    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT})
    async_store.DAMAGE.update(layer=h.LAYER.format(1), position=0)
    transfer = h.transfer_config({"output": str(tmp_path / "decode"), "policy": "fail"}, STORE,
                                 "kv_consumer", engine_id="decode")  # fmt: skip
    transfer.kv_load_failure_policy = "recompute"
    decode = r.make_engine(model, transfer)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=2)
        decode.run(steps=30)
    assert len(messages(caplog, "MISMATCH")) == 1
    assert decode.scheduled("d-a")[0] == (0, 80)
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81]
    assert decode.all_blocks_free()


def test_an_idle_step_sends_no_connector_stats(model: Path, tmp_path: Path) -> None:
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer")
    decode.step()
    [(_, result)] = decode.history
    assert result.kv_connector_output.kv_connector_stats is None


def test_an_abort_after_a_sync_load_frees_every_block(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, params = produce(model, tmp_path, example(tmp_path), {"req-a": PROMPT})
    decode = engine(model, tmp_path, "decode", example(tmp_path), "kv_consumer")
    decode.add("d-a", PROMPT, params["req-a"], max_tokens=8)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.step()
        decode.abort("d-a")
        decode.run()
    assert decode.all_blocks_free()
    assert messages(caplog, "positions 0-3 compared: match")


@pytest.mark.parametrize("policy", ["log", "fail"])
def test_a_clean_async_load_is_released_and_decodes(
    model: Path, tmp_path: Path, policy: str
) -> None:
    async_store.LATENCY["steps"] = 1
    decode = consumer_run(model, tmp_path, policy)
    decode.run()
    assert decode.generated("d-a") == [r.SAMPLED + 80 + i for i in range(4)]
    got = decode.connector_counters()
    assert (got["checked_blocks"], got["mismatched_blocks"]) == (5, 0)
    assert decode.all_blocks_free()


def test_policy_fail_computes_no_token_from_a_failed_async_load(
    model: Path, tmp_path: Path
) -> None:
    """The load is held until its verdict, reported with its bad block as a load error,
    and vLLM recomputes from there (``kv_load_failure_policy: recompute``): every token
    the request emits comes from checked or recomputed KV, and is the right one."""
    async_store.DAMAGE.update(layer=h.LAYER.format(1), position=2)
    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT})
    transfer = h.transfer_config(
        {"output": str(tmp_path / "decode"), "policy": "fail"},
        STORE,
        "kv_consumer",
        engine_id="decode",
    )
    transfer.kv_load_failure_policy = "recompute"
    decode = r.make_engine(model, transfer)
    decode.add("d-a", PROMPT, params["req-a"], max_tokens=3)
    decode.run()
    # The bad block came back as a load error; the request's first forward starts at it.
    bad = [blocks for blocks in decode.invalid_blocks() if blocks]
    assert len(bad) == 1 and len(bad[0]) == 1
    assert decode.scheduled("d-a")[0] == (32, 48)
    assert decode.generated("d-a") == [r.SAMPLED + 80 + i for i in range(3)]
    got = decode.connector_counters()
    assert (got["mismatched_blocks"], got["mismatched_requests"]) == (1, 1)
    assert decode.all_blocks_free()


def test_preemption_and_resumption_around_loads_in_flight(model: Path, tmp_path: Path) -> None:
    """A small block pool: running requests are preempted while a load is in flight,
    then the loaded request itself is preempted and resumed (from what its prefix cache
    kept, the rest computed); its load was checked once, every output is the right one,
    and the pool is full at the end."""
    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT})
    async_store.LATENCY["steps"] = 60
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer", num_blocks=18)
    decode.add("d-a", PROMPT, params["req-a"], max_tokens=4)
    decode.step()
    for n in range(4):
        decode.add(f"z{n}", r.prompt(4000 + 100 * n, 20), max_tokens=70)
    preempted_while_loading, preempted = 0, set()
    for _ in range(400):
        if not decode.scheduler.has_requests():
            break
        output = decode.step()
        statuses = {q.status.name for q in decode.scheduler.requests.values()}
        preempted |= output.preempted_req_ids or set()
        if output.preempted_req_ids and "WAITING_FOR_REMOTE_KVS" in statuses:
            preempted_while_loading += 1
    assert preempted_while_loading and "d-a" in preempted
    assert decode.all_blocks_free()
    for n in range(4):
        assert decode.generated(f"z{n}") == [r.SAMPLED + 20 + i for i in range(70)]
    assert decode.generated("d-a") == [r.SAMPLED + 80 + i for i in range(4)]
    got = decode.connector_counters()
    assert (got["mismatched_blocks"], got["checked_blocks"]) == (0, 5)
    record = read_output_folder(tmp_path / "decode")
    assert record.requests["req-a"].groups[0].totals().tolist() == want(PROMPT, 80)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_many_concurrent_requests(model: Path, tmp_path: Path, async_scheduling: bool) -> None:
    """Twelve requests, some sharing a prefix, chunked on the producer, loaded with
    latency on the consumer (which holds some prefixes locally), with and without async
    scheduling: every loaded block is compared and matches, one planted fault is found
    in its own request only."""
    prompts = {
        f"req-{i}": [*r.prompt(900, 16 * (i % 3)), *r.prompt(1000 + 100 * i, 40 + i)]
        for i in range(12)
    }
    _, params = produce(
        model, tmp_path, STORE, prompts, step_tokens=96, async_scheduling=async_scheduling
    )
    async_store.LATENCY["steps"] = 1
    async_store.DAMAGE.update(layer=h.LAYER.format(1), position=3)  # only the long prompts
    decode = engine(
        model,
        tmp_path,
        "decode",
        STORE,
        "kv_consumer",
        step_tokens=128,
        async_scheduling=async_scheduling,
    )
    decode.add("warm", [*r.prompt(900, 32), 1])
    decode.run()
    for rid, tokens in prompts.items():
        decode.add(f"d-{rid}", tokens, params[rid], max_tokens=2)
    decode.run()
    assert decode.all_blocks_free()
    for rid, tokens in prompts.items():
        assert decode.generated(f"d-{rid}") == [
            r.SAMPLED + len(tokens),
            r.SAMPLED + len(tokens) + 1,
        ]
    got = decode.connector_counters()
    long = [rid for rid, tokens in prompts.items() if len(tokens) > 48]
    assert (got["consumer_requests"], got["mismatched_requests"]) == (12, len(long))
    record = read_output_folder(tmp_path / "decode")
    for rid, tokens in prompts.items():
        group = record.requests[rid].groups[0]
        reference = want(tokens, len(tokens))[group.start :]
        pairs = enumerate(zip(group.totals().tolist(), reference, strict=True))
        differing = [group.start + i for i, (a, b) in pairs if a != b]
        assert differing == ([3] if rid in long else []), rid


# NIXL's scheduler side, MultiConnector.

NIXL = {"kv_connector": "NixlConnector"}
WIRE = {"kv_connector": "NixlWire", "kv_connector_module_path": "async_store"}


def nixl_engine(model: Path, folder: Path, name: str, role: str, **settings: object) -> r.Engine:
    """vLLM's NixlConnector (scheduler side) wrapped by kvaudit's connector; the workers
    move the blocks NIXL's metadata names (``async_store.NixlWire``)."""
    kvaudit = {"output": str(folder / name), **settings}
    return r.make_engine(
        model,
        h.transfer_config(kvaudit, NIXL, role, engine_id=name),
        worker_transfer=h.transfer_config(kvaudit, WIRE, role, engine_id=name),
    )


def test_nixl_after_a_local_prefix_hit(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case under NIXL's own scheduler side: the decode engine holds 3 of a
    remote-prefill request's 5 blocks, NIXL pulls positions 3 and 4, a bit flipped in
    position 4 on the way is found there; the producer's blocks are freed once read."""
    prefill = nixl_engine(model, tmp_path, "prefill", "kv_producer")
    prefill.add("req-a", PROMPT, {"do_remote_decode": True})
    while prefill.params("req-a") is None:
        prefill.step()
    params = prefill.params("req-a")
    assert params["do_remote_prefill"] and "kvaudit" in params
    assert not prefill.all_blocks_free()  # held for the decode engine to read
    decode = nixl_engine(model, tmp_path, "decode", "kv_consumer")
    decode.add("warm", [*PROMPT[:48], 1, 2, 3])
    decode.run()
    async_store.DAMAGE.update(layer=h.LAYER.format(0), position=4)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params, max_tokens=2)
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    assert line.startswith("kvaudit: MISMATCH request req-a group 0: positions [4] ")
    assert " (positions 3-4 compared; 0-2 held locally (prefix cache), not compared); " in line
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81]
    assert decode.all_blocks_free()
    prefill.run()
    assert prefill.all_blocks_free()


def test_kvaudit_holding_a_multiconnector(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kvaudit's connector wrapping a ``MultiConnector``: it saves to both children and
    loads from the first with a hit; the load is checked. vLLM's ``has_connector`` sees
    neither child; kvaudit's class names them (the upstream hook of docs/vllm.md)."""

    def multi(role: str) -> dict:
        children = [{**STORE, "kv_role": role}, {**example(tmp_path), "kv_role": role}]
        return {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": children},
        }

    _, params = produce(model, tmp_path, multi("kv_producer"), {"req-a": PROMPT})
    async_store.DAMAGE.update(layer=h.LAYER.format(1), position=0)
    decode = engine(model, tmp_path, "decode", multi("kv_consumer"), "kv_consumer")
    connector = decode.scheduler.connector
    assert type(connector.wrapped).__name__ == "MultiConnector"
    assert not decode.config.kv_transfer_config.has_connector("ExampleConnector")
    assert type(connector).wrapped_connector_names(decode.config.kv_transfer_config) == (
        "MultiConnector",
        "AsyncStoreConnector",
        "ExampleConnector",
    )
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"])
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    assert line.startswith("kvaudit: MISMATCH request req-a group 0: positions [0] ")
    assert decode.all_blocks_free()


def test_a_multiconnector_holding_kvaudit(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's ``MultiConnector`` with kvaudit's connector (wrapping the store) as its
    first child and ExampleConnector beside it (not a supported place, docs/vllm.md):
    first, kvaudit's params are the ones MultiConnector merges into, the load it wraps is
    checked, and its stats come through (MultiConnector rebuilds them by name)."""

    def multi(name: str, role: str) -> r.Engine:
        audited = {
            "kv_connector": "KVAuditConnector",
            "kv_connector_module_path": h.MODULE,
            "kv_role": role,
            "kv_connector_extra_config": {
                "kvaudit": {"output": str(tmp_path / name)},
                "wrapped": STORE,
            },
        }
        transfer = h.KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            engine_id=name,
            kv_connector_extra_config={
                "connectors": [audited, {**example(tmp_path), "kv_role": role}]
            },
        )
        return r.make_engine(model, transfer)

    prefill = multi("prefill", "kv_producer")
    prefill.add("req-a", PROMPT)
    prefill.run()
    # vLLM's API server rebuilds MultiConnector's stats by each child's registered name:
    # kvaudit's plugin names its class, and its counters come through.
    plugin.register()
    rebuilt = [MultiConnector.build_kv_connector_stats(data=s) for s in prefill.stats if s]
    assert sum(r.reduce()["KVAuditConnector"]["kvaudit_producer_requests"] for r in rebuilt) == 1
    params = prefill.params("req-a")
    assert decode_wire_base64(params["kvaudit"], "p").groups[0].totals.tolist() == want(PROMPT, 80)
    async_store.DAMAGE.update(layer=h.LAYER.format(0), position=2)
    decode = multi("decode", "kv_consumer")
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params)
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    assert line.startswith("kvaudit: MISMATCH request req-a group 0: positions [2] ")
    assert decode.all_blocks_free()


def kvaudit_child(folder: Path, name: str, role: str) -> dict:
    return {"kv_connector": "KVAuditConnector", "kv_connector_module_path": h.MODULE,
            "kv_role": role, "kv_connector_extra_config": {
                "kvaudit": {"output": str(folder / name)}, "wrapped": STORE}}  # fmt: skip


def test_kvaudit_behind_a_child_that_hands_back_params_leaves_loads_unverified(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """kvaudit as the second child of vLLM's ``MultiConnector`` (not a supported place),
    behind NIXL, which hands back ``kv_transfer_params``: MultiConnector merges kvaudit's
    params into NIXL's when ``request_finished`` returns, and the checksums of the
    prompt's last step, filled in later, never travel. The consumer says so and counts
    the load unverified: never a "match"."""

    def multi(first: dict) -> h.KVTransferConfig:
        # The store's own engine id: it numbers its workers' ranks by engine id.
        store = kvaudit_child(tmp_path, "prefill", "kv_producer")
        store["kv_connector_extra_config"]["wrapped"] = {**STORE, "engine_id": "store"}
        children = [{**first, "kv_role": "kv_producer"}, store]
        return h.KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_producer",
                                  engine_id="prefill",
                                  kv_connector_extra_config={"connectors": children})  # fmt: skip

    prefill = r.make_engine(model, multi(NIXL), worker_transfer=multi(WIRE))
    prefill.add("req-a", PROMPT, {"do_remote_decode": True})
    while prefill.params("req-a") is None:
        prefill.step()
    params = prefill.params("req-a")
    assert params["do_remote_prefill"] and "kvaudit_id" in params and "kvaudit" not in params
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer")
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params)
        decode.run()
    assert messages(caplog, "kvaudit: request req-a: no producer checksums received")
    assert not messages(caplog, ": match") and not messages(caplog, "MISMATCH")
    counts = [s["kvaudit"] for s in decode.stats if s]
    assert sum(c["unverified_requests"] for c in counts) == 1
    assert sum(c["checked_blocks"] for c in counts) == 0


def test_two_kvaudit_children_of_a_multiconnector_clash_in_its_merge(
    model: Path, tmp_path: Path
) -> None:
    """Two kvaudit connectors as children of one ``MultiConnector`` (not a supported
    place): both hand back kvaudit's keys, and vLLM's MultiConnector refuses the clash
    when the first request finishes (docs/vllm.md: audit once, outermost)."""
    child = kvaudit_child(tmp_path, "prefill", "kv_producer")
    transfer = h.KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_producer", engine_id="p",
        kv_connector_extra_config={"connectors": [child, child]},
    )  # fmt: skip
    prefill = r.make_engine(model, transfer)
    prefill.add("req-a", PROMPT)
    with pytest.raises(RuntimeError, match="Key clash in kv_transfer_params"):
        prefill.run()


# Policy fail and synchronous loads.


@pytest.mark.parametrize(
    "wrapped",
    [
        {"kv_connector": "ExampleConnector"},
        {
            "kv_connector": "MultiConnector",
            "kv_connector_extra_config": {
                "connectors": [
                    {**STORE, "kv_role": "kv_consumer"},
                    {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"},
                ]
            },
        },
    ],
)
def test_policy_fail_refuses_a_synchronous_connector_at_start_up(
    model: Path, tmp_path: Path, wrapped: dict
) -> None:
    with pytest.raises(ValueError) as raised:
        engine(model, tmp_path, "decode", wrapped, "kv_consumer", policy="fail")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        "kvaudit: policy fail cannot hold a synchronous load (ExampleConnector"
    )


def test_policy_fail_on_a_producer_of_a_synchronous_connector_is_taken(
    model: Path, tmp_path: Path
) -> None:
    """A producer loads nothing: policy ``fail`` with ExampleConnector is no contradiction."""
    _, params = produce(model, tmp_path, example(tmp_path), {"req-a": PROMPT}, policy="fail")
    assert "kvaudit" in params["req-a"]


def test_policy_fail_declines_a_synchronous_load_it_cannot_hold(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A connector kvaudit does not know loads synchronously under policy ``fail``: the
    load is declined, vLLM computes the prompt itself, no token comes from the loaded
    (here damaged) KV; said once at ERROR and counted."""
    _, params = produce(model, tmp_path, SYNC_STORE, {"req-a": PROMPT, "req-b": r.prompt(5, 40)})
    async_store.DAMAGE.update(layer=h.LAYER.format(0), position=1)
    decode = engine(model, tmp_path, "decode", SYNC_STORE, "kv_consumer", policy="fail")
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=2)
        decode.add("d-b", r.prompt(5, 40), params["req-b"], max_tokens=2)
        decode.run()
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81]
    [line] = messages(caplog, "declines")
    assert line.startswith("kvaudit: policy fail: SyncStoreConnector loaded request d-")
    assert not messages(caplog, "MISMATCH") and not messages(caplog, "nothing loaded")
    got = decode.connector_counters()
    assert (got["declined_sync_loads"], got["checked_blocks"]) == (2, 0)
    assert decode.all_blocks_free()


def test_kvaudits_counters_reach_vllms_prometheus_metrics(model: Path, tmp_path: Path) -> None:
    """vLLM's ``KVConnectorProm`` (what its Prometheus logger builds from the connector
    class) registers kvaudit's counters, and each step's connector stats feed them."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = CollectorRegistry()

    _, params = produce(model, tmp_path, STORE, {"req-a": PROMPT})
    async_store.DAMAGE.update(layer=h.LAYER.format(1), position=3)
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer", max_dump_bytes=1 << 24)
    decode.add("warm", [*PROMPT[:32], 1])
    decode.run()
    decode.stats.clear()
    decode.add("d-a", PROMPT, params["req-a"])
    decode.run()
    classes = {"_gauge_cls": Gauge, "_counter_cls": Counter, "_histogram_cls": Histogram}
    prom_cls = type(
        "Prom", (KVConnectorProm,), {k: h.bound_metric(c, registry) for k, c in classes.items()}
    )
    prom = prom_cls(decode.config, ["model_name", "engine"], {0: ["tiny", "0"]})
    for stats in decode.stats:
        if stats:
            prom.observe(stats, 0)

    def sample(name: str) -> float | None:
        return registry.get_sample_value(
            f"vllm:kvaudit_{name}_total", {"model_name": "tiny", "engine": "0"}
        )

    assert (sample("checked_blocks"), sample("local_blocks")) == (3, 2)
    assert (sample("mismatched_blocks"), sample("dumps_written")) == (1, 1)
    assert sample("overhead_seconds") > 0


def test_a_rotating_producer_keeps_the_latest_dumps_for_a_failed_check(
    model: Path, tmp_path: Path
) -> None:
    """``rotate_dumps`` on the producer: every request is dumped, the oldest removed to
    stay within ``max_dump_bytes``; the consumer's failed check dumps its side, and
    ``kvaudit diff`` of the two dump folders locates the damage."""
    prompts = {f"req-{i}": r.prompt(1000 + 100 * i, 80) for i in range(4)}
    one_request = r.LAYERS * 5 * r.HEADS * 16 * 2 * r.HEAD_SIZE * 2  # 5 blocks, every layer
    _, params = produce(model, tmp_path, STORE, prompts, rotate_dumps=True,
                        max_dump_bytes=2 * one_request)  # fmt: skip
    kept = sorted(p.name for p in (tmp_path / "prefill" / "dumps").iterdir())
    assert kept == ["req-2", "req-3"]
    async_store.DAMAGE.update(layer=h.LAYER.format(1), position=2)
    decode = engine(model, tmp_path, "decode", STORE, "kv_consumer", max_dump_bytes=1 << 24)
    decode.add("d-3", prompts["req-3"], params["req-3"])
    decode.run()
    assert sorted(p.name for p in (tmp_path / "decode" / "dumps").iterdir()) == ["req-3"]
    group = located(tmp_path, "req-3")
    assert group["mismatched_positions"] == [2]
    [entry] = group["located"]
    assert (entry["layer"], entry["head"], entry["tokens"]) == (h.LAYER.format(1), 0, [32])
