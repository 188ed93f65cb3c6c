"""kvaudit's connector with a hybrid model's two KV cache groups (a sliding-window layer
and a full-attention layer, ``hybrid_engine.py``) under vLLM 0.33.0's real ``Scheduler``
and hybrid KV cache manager: the lifecycle list of ``test_real_scheduler.py`` (clean
loads, a local prefix hit, chunked prefill, aborts, a failed load, preemption), the
connector's groups filter, a fault planted in each group's KV found and named by its
group, and the block pool full after every lifecycle."""

from __future__ import annotations

import logging
from pathlib import Path

import async_store
import cpu_engine as r
import hybrid_engine as he
import pytest
from expected import cells
from helpers import reference as ref

from kvaudit.output_folders import read_output_folder
from kvaudit.records.wire import decode_wire_base64

PROMPT = r.prompt(100, 80)  # five 16-token blocks; the window (32) covers positions 3-4


@pytest.fixture(autouse=True)
def clean_store() -> None:
    he.reset()


def engine(tmp_path: Path, name: str, role: str, **options: object) -> he.HybridEngine:
    settings = {k: options.pop(k) for k in list(options) if k in ("policy",)}
    transfer = he.transfer_config({"output": str(tmp_path / name), **settings}, role, name)
    if options.pop("recompute", False):
        transfer.kv_load_failure_policy = "recompute"
    return he.make_hybrid_engine(tmp_path, transfer, **options)


def produce(tmp_path: Path, prompts: dict[str, list[int]], **options: object) -> dict[str, dict]:
    """A producer engine's run of the prompts; their kv_transfer_params."""
    producer = engine(tmp_path, "prefill", "kv_producer", **options)
    for rid, tokens in prompts.items():
        producer.add(rid, tokens)
    producer.run()
    assert producer.all_blocks_free()
    return {rid: producer.params(rid) for rid in prompts}


def want(prompt: list[int], num_tokens: int, layer: int) -> list[int]:
    """The reference totals of one layer's group (the tests' numpy reference)."""
    caches = (ref.Layer(r.LAYER.format(layer), cells(prompt, num_tokens, layer, r.HEADS,
                                                     2 * r.HEAD_SIZE), 1),)  # fmt: skip
    return [int(v) for v in ref.total(ref.block_checksums(ref.Group(16, caches), num_tokens))]


def messages(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [
        x.getMessage()
        for x in caplog.records
        if x.name == "kvaudit.vllm" and word in x.getMessage()
    ]


def test_vllm_makes_two_groups_and_keeps_its_hybrid_manager_with_kvaudit(tmp_path: Path) -> None:
    decode = engine(tmp_path, "decode", "kv_consumer")
    config = decode.scheduler.kv_cache_config
    kinds = [type(group.kv_cache_spec).__name__ for group in config.kv_cache_groups]
    assert kinds == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert type(decode.scheduler.kv_cache_manager.coordinator).__name__ == (
        "HybridKVCacheCoordinator"
    )
    assert not decode.config.scheduler_config.disable_hybrid_kv_cache_manager
    audit = decode.workers[0].connector.worker_audit
    assert audit is not None and sorted(g.id for g in audit.description.groups) == [0, 1]


@pytest.mark.parametrize("step_tokens", [256, 32])
@pytest.mark.parametrize("policy", ["log", "fail"])
def test_a_clean_load_of_both_groups_matches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str, step_tokens: int
) -> None:
    """The producer (one step, or chunked in 32-token steps: its window's blocks out of
    the window freed meanwhile) sends both groups' totals, equal to the reference; the
    consumer's sliding-window group holds the window's positions 3-4 (vLLM's null block
    before them), its full group all five: each compared, both match."""
    params = produce(tmp_path, {"req-a": PROMPT}, step_tokens=step_tokens)
    wire = decode_wire_base64(params["req-a"]["kvaudit"], "params")
    sent = {group.group_id: group for group in wire.groups}
    assert sent[1].totals.tolist() == want(PROMPT, 80, 1)
    # The window's positions are the producer's own blocks at the prompt's end.
    assert sent[0].totals.tolist()[3 - sent[0].start :] == want(PROMPT, 80, 0)[3:]
    async_store.LATENCY["steps"] = 1
    decode = engine(tmp_path, "decode", "kv_consumer", policy=policy)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=4)
        decode.run()
    assert messages(caplog, "compared") == [
        "kvaudit: request req-a group 0: positions 3-4 compared: match",
        "kvaudit: request req-a group 1: positions 0-4 compared: match",
    ]
    assert decode.generated("d-a") == [r.SAMPLED + 80 + i for i in range(4)]
    got = decode.connector_counters()
    assert (got["checked_blocks"], got["mismatched_blocks"], got["unverified_blocks"]) == (7, 0, 0)
    record = read_output_folder(tmp_path / "decode")
    assert record.requests["req-a"].groups[1].totals().tolist() == want(PROMPT, 80, 1)
    assert record.requests["req-a"].groups[0].totals().tolist() == want(PROMPT, 80, 0)[3:]
    assert decode.all_blocks_free()


@pytest.mark.parametrize(("group", "position"), [(0, 4), (0, 3), (1, 0), (1, 2)])
@pytest.mark.parametrize("policy", ["log", "fail"])
def test_a_fault_in_each_group_is_found_and_named_by_its_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str, group: int, position: int
) -> None:
    """One bit flipped in one group's loaded block (the layer of that group only): the
    verdict names that group and position, the other group matches. Under policy
    ``fail`` the load is reported as a failed receive (vLLM refuses block-level load
    errors with several groups) and vLLM recomputes the prompt: every token is right."""
    params = produce(tmp_path, {"req-a": PROMPT})
    async_store.DAMAGE.update(layer=r.LAYER.format(group), position=position)
    decode = engine(tmp_path, "decode", "kv_consumer", policy=policy, recompute=True)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=3)
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    block = line.split("(blocks [")[1].split("]")[0]
    assert line.startswith(
        f"kvaudit: MISMATCH request req-a group {group}: positions [{position}] (blocks "
        f"[{block}]) differ from the producer's checksums ("
    )
    other = 1 - group
    [match] = messages(caplog, "match")
    assert match.startswith(f"kvaudit: request req-a group {other}: ")
    assert not any(blocks for blocks in decode.invalid_blocks())  # never per block
    got = decode.connector_counters()
    assert (got["mismatched_blocks"], got["mismatched_requests"]) == (1, 1)
    if policy == "fail":  # the failed receive: the prompt computed here, from token 0
        assert decode.scheduled("d-a")[0] == (0, 80)
    else:
        assert decode.scheduled("d-a")[0] == (79, 1)
    assert decode.generated("d-a") == [r.SAMPLED + 80 + i for i in range(3)]
    assert decode.all_blocks_free()


def test_after_a_local_prefix_hit_each_group_compares_what_it_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The decode engine holds the prompt's first 3 blocks (another request computed
    them); the store loads positions 3-4 of both groups; a bit flipped in the window
    group's position 4 is found there, and nothing held locally is compared."""
    params = produce(tmp_path, {"req-a": PROMPT})
    async_store.DAMAGE.update(layer=r.LAYER.format(0), position=4)
    decode = engine(tmp_path, "decode", "kv_consumer")
    decode.add("warm", [*PROMPT[:48], 1, 2, 3])
    decode.run()
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=2)
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    assert line.startswith("kvaudit: MISMATCH request req-a group 0: positions [4] ")
    assert " (positions 3-4 compared; " in line
    assert messages(caplog, "match") == [
        "kvaudit: request req-a group 1: positions 3-4 compared; 0-2 held locally (prefix "
        "cache), not compared: match"
    ]
    got = decode.connector_counters()
    assert (got["checked_blocks"], got["mismatched_blocks"]) == (4, 1)
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81]
    assert decode.all_blocks_free()


def test_the_groups_filter_leaves_out_a_group_the_connector_does_not_restore(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The connector says its load restores the full-attention group only (as a
    prefix store that holds no window would): kvaudit checks that group, and never
    compares the window group's blocks, which hold what the load left there."""
    params = produce(tmp_path, {"req-a": PROMPT})
    he.LOADED_GROUPS.add(1)
    decode = engine(tmp_path, "decode", "kv_consumer")
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=2)
        decode.run()
    assert messages(caplog, "compared") == [
        "kvaudit: request req-a group 1: positions 0-4 compared: match"
    ]
    assert not messages(caplog, "MISMATCH")
    record = read_output_folder(tmp_path / "decode")
    assert sorted(record.requests["req-a"].groups) == [1]
    got = decode.connector_counters()
    assert (got["checked_blocks"], got["mismatched_blocks"]) == (5, 0)
    assert decode.all_blocks_free()


@pytest.mark.parametrize("policy", ["log", "fail"])
def test_an_abort_during_a_load_of_two_groups_frees_every_block(
    tmp_path: Path, policy: str
) -> None:
    params = produce(tmp_path, {"req-a": PROMPT})
    async_store.LATENCY["steps"] = 3
    decode = engine(tmp_path, "decode", "kv_consumer", policy=policy)
    decode.add("d-a", PROMPT, params["req-a"], max_tokens=4)
    decode.step()
    decode.step()
    assert decode.scheduler.requests["d-a"].status.name == "WAITING_FOR_REMOTE_KVS"
    decode.abort("d-a")
    decode.run()
    decode.step()
    assert decode.all_blocks_free()
    assert not decode.generated("d-a")
    assert not decode.scheduler.connector.scheduler_audit._requests


def test_an_abort_while_a_load_of_two_groups_is_held_for_its_verdict(tmp_path: Path) -> None:
    params = produce(tmp_path, {"req-a": PROMPT})
    decode = engine(
        tmp_path, "decode", "kv_consumer", policy="fail", async_scheduling=True, num_blocks=80
    )
    decode.add("d-a", PROMPT, params["req-a"], max_tokens=4)
    audit = decode.workers[0].connector.worker_audit
    for _ in range(10):
        decode.step()
        if "d-a" in audit._held:
            break
    assert "d-a" in audit._held
    decode.abort("d-a")
    decode.run()
    assert decode.all_blocks_free()
    assert "d-a" not in audit._held


def test_a_failed_load_of_two_groups_is_not_compared_and_the_retry_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    params = produce(tmp_path, {"req-a": PROMPT})
    async_store.FAILING_RANKS.add(0)
    decode = engine(tmp_path, "decode", "kv_consumer", policy="fail", recompute=True)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params["req-a"], max_tokens=2)
        decode.run()
    assert len(messages(caplog, "its load failed on a worker: not compared")) == 1
    assert messages(caplog, "compared: match") == [
        "kvaudit: request req-a group 0: positions 3-4 compared: match",
        "kvaudit: request req-a group 1: positions 0-4 compared: match",
    ]
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81]
    assert decode.all_blocks_free()


def test_preemption_around_a_load_of_two_groups(tmp_path: Path) -> None:
    """A small block pool: requests are preempted while a load is in flight, then the
    loaded request itself; its load was checked once (both groups), every output is
    right, and the pool is full at the end."""
    params = produce(tmp_path, {"req-a": PROMPT})
    async_store.LATENCY["steps"] = 40
    decode = engine(tmp_path, "decode", "kv_consumer")
    decode.add("d-a", PROMPT, params["req-a"], max_tokens=4)
    decode.step()
    for n in range(6):  # 6 x 170 tokens: more blocks than the pool's 63
        decode.add(f"z{n}", r.prompt(4000 + 200 * n, 20), max_tokens=150)
    preempted: set[str] = set()
    for _ in range(1000):
        if not decode.scheduler.has_requests():
            break
        output = decode.step()
        preempted |= output.preempted_req_ids or set()
    assert preempted
    assert decode.all_blocks_free()
    for n in range(6):
        assert decode.generated(f"z{n}") == [r.SAMPLED + 20 + i for i in range(150)]
    assert decode.generated("d-a") == [r.SAMPLED + 80 + i for i in range(4)]
    got = decode.connector_counters()
    assert (got["mismatched_blocks"], got["checked_blocks"]) == (0, 7)


def test_many_requests_through_two_groups(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Eight prompts of different lengths loaded at once: each group of each request
    compared once and matching, every output right, the pool full at the end."""
    prompts = {f"req-{n}": r.prompt(1000 + 200 * n, 40 + 9 * n) for n in range(8)}
    params = produce(tmp_path, prompts)
    async_store.LATENCY["steps"] = 2
    decode = engine(tmp_path, "decode", "kv_consumer", policy="fail")
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        for rid, tokens in prompts.items():
            decode.add(rid.replace("req-", "d-"), tokens, params[rid], max_tokens=2)
        decode.run()
    matched = sorted(line.split(" request ")[1].split(":")[0]
                     for line in messages(caplog, "compared: match"))  # fmt: skip
    assert matched == sorted(f"{rid} group {g}" for rid in prompts for g in (0, 1))
    for rid, tokens in prompts.items():
        n = len(tokens)
        assert decode.generated(rid.replace("req-", "d-")) == [r.SAMPLED + n, r.SAMPLED + n + 1]
    assert decode.all_blocks_free()


def nixl_engine(tmp_path: Path, name: str, role: str) -> he.HybridEngine:
    """vLLM's NixlConnector scheduler side (audited) over the tests' NIXL wire."""
    kvaudit = {"output": str(tmp_path / name)}
    return he.make_hybrid_engine(
        tmp_path,
        he.nixl_transfer_config(kvaudit, role, name),
        worker_transfer=he.transfer_config(kvaudit, role, name, he.NIXL_WIRE),
    )


@pytest.mark.parametrize("group", [0, 1])
def test_nixl_moves_both_groups_after_a_local_prefix_hit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, group: int
) -> None:
    """NIXL's own scheduler side with two groups: the decode holds 3 of the prompt's 5
    blocks, NIXL pulls positions 3-4 of each group; a bit flipped in one group's
    position 4 on the way is found and named by that group, the other group matches;
    the producer's blocks are freed once read, the decode's at its end."""
    prefill = nixl_engine(tmp_path, "prefill", "kv_producer")
    prefill.add("req-a", PROMPT, {"do_remote_decode": True})
    while prefill.params("req-a") is None:
        prefill.step()
    params = prefill.params("req-a")
    assert len(params["remote_block_ids"]) == 2  # one block list per group
    decode = nixl_engine(tmp_path, "decode", "kv_consumer")
    decode.add("warm", [*PROMPT[:48], 1, 2, 3])
    decode.run()
    async_store.DAMAGE.update(layer=r.LAYER.format(group), position=4)
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        decode.add("d-a", PROMPT, params, max_tokens=2)
        decode.run()
    [line] = messages(caplog, "MISMATCH")
    assert line.startswith(f"kvaudit: MISMATCH request req-a group {group}: positions [4] ")
    [match] = messages(caplog, "match")
    assert match.startswith(f"kvaudit: request req-a group {1 - group}: positions 3-4 compared")
    assert decode.generated("d-a") == [r.SAMPLED + 80, r.SAMPLED + 81]
    assert decode.all_blocks_free()
    prefill.run()
    assert prefill.all_blocks_free()
