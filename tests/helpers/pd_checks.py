"""What the whole-engine tests share (tests/engines): prompts of the tiny model's words,
kvaudit's settings, requests through the P/D pair or to one engine, the engines' logs and
counters, kvaudit's command line."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "vllm_pd_cpu"))

from pd_engines import PDPair, post_json  # noqa: E402

MAX_TOKENS = 6
PLANTED = re.compile(
    r"planted fault: request (\S+) layer (\S+) position (\d+) block (\d+) head (\d+) "
    r"token (\d+) element (\d+)"
)
"""A line of examples/vllm_pd_cpu/faulty_transfer.py: one bit flipped in a received load."""


def words(start: int, count: int) -> str:
    """A prompt of ``count`` words of the tiny model's vocabulary (one token each)."""
    return " ".join(f"w{(start + i) % 1000}" for i in range(count))


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


def usage(pair: PDPair) -> float:
    return pair.metrics(pair.decode).get("vllm:kv_cache_usage_perc", -1.0)


def local_tokens(pair: PDPair) -> float:
    """The decode's prompt tokens computed locally (not from a transfer)."""
    return sum(
        value
        for key, value in pair.metrics(pair.decode).items()
        if key.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in key
    )
