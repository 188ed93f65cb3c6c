"""Per-step overhead of kvaudit's vLLM connector audit, on the CPU or a CUDA GPU.

    python bench/vllm_overhead.py [--device cpu] [--tokens 2048] [--layers 32] [--steps 10]

A Llama-3.1-8B-shaped cache (32 layers, 8 KV heads of 128 bf16, 16-token blocks) in
vLLM's standardized per-layer view ``[blocks, heads, tokens, 2*head_size]`` over one
backing buffer, as ``allocate_kv_cache`` lays it out. Each step runs a stand-in forward
(matrix products on the device, about as long as ``--forward-ms`` says) and, when
audited, the worker audit's hooks in vLLM's order (``bind``, ``forward_done`` after the
forward, ``partials``) for one ``--tokens`` producer request, with the scheduler's
collection of the values (``record()``) at the step's end as the output path does.
``--steps`` back-to-back steps are timed with and without the audit; the difference per
step is the overhead (on a GPU the checksums run on a side stream; on the CPU inline).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvaudit.description import parse_description
from kvaudit.integrations.vllm.config import AuditConfig
from kvaudit.integrations.vllm.jobs import AuditJob, AuditStep
from kvaudit.integrations.vllm.worker import WorkerAudit
from kvaudit.records import WorkerInfo

HEADS, HEAD_SIZE, BLOCK = 8, 128, 16


def llama_caches(layers: int, blocks: int, device: str) -> dict[str, torch.Tensor]:
    """``[blocks, heads, tokens, 2*head_size]`` bf16 views of one buffer (layer-major)."""
    page = HEADS * BLOCK * 2 * HEAD_SIZE
    buffer = torch.randint(-(2**15), 2**15, (layers * blocks * page,), dtype=torch.int16,
                           device=device).view(torch.bfloat16)  # fmt: skip
    return {
        f"model.layers.{i}.self_attn.attn": buffer[
            i * blocks * page : (i + 1) * blocks * page
        ].view(blocks, HEADS, BLOCK, 2 * HEAD_SIZE)
        for i in range(layers)
    }


def description(layers: int, blocks: int) -> dict:
    spec = {"type": "full_attention", "block_size": BLOCK, "num_kv_heads": HEADS,
            "head_size": HEAD_SIZE, "dtype": "bfloat16", "layout": "NHTC"}  # fmt: skip
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return {"kvaudit": 1, "num_blocks": blocks, "groups": [{"spec": spec, "layers": names}]}


def measure_overhead(device: str, tokens: int, layers: int = 32, steps: int = 10,
                     forward_ms: float = 20.0) -> dict[str, float]:  # fmt: skip
    """Per-step times in ms with and without the audit, and the audit's host time."""
    request_blocks = -(-tokens // BLOCK)
    blocks = request_blocks + 8
    caches = llama_caches(layers, blocks, device)
    raw = description(layers, blocks)
    audit = WorkerAudit(parse_description(raw, "bench"), raw, caches,
                        WorkerInfo(0, 1, 0, 1, "producer", "bench"), AuditConfig())  # fmt: skip
    ids = torch.randperm(blocks)[:request_blocks].tolist()
    size = 4096 if device == "cuda" else 512
    weights = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    activations = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def forward_once() -> None:
        torch.matmul(activations, weights)

    # Size the stand-in forward to about forward_ms, timed after a warm-up: the first
    # product on a GPU also starts its BLAS library.
    forward_once()
    sync()
    start = time.perf_counter()
    for _ in range(20):
        forward_once()
    sync()
    per_matmul = (time.perf_counter() - start) / 20 * 1000
    repeats = max(1, round(forward_ms / max(per_matmul, 1e-3)))

    host_ms: list[float] = []

    def step(audited: bool, number: int) -> None:
        job = AuditJob(f"r{number}", f"r{number}", "producer", tokens, {0: (0, ids)})
        if audited:
            audit.bind(AuditStep(jobs=[job]))
        for _ in range(repeats):
            forward_once()
        if audited:
            began = time.perf_counter()
            audit.forward_done()
            partials = audit.partials()
            host_ms.append((time.perf_counter() - began) * 1000)
            for partial in partials:
                partial.record()

    def run(audited: bool) -> float:
        step(audited, -1)
        sync()
        start = time.perf_counter()
        for number in range(steps):
            step(audited, number)
        sync()
        return (time.perf_counter() - start) * 1000 / steps

    plain = statistics.median(run(False) for _ in range(3))
    audited = statistics.median(run(True) for _ in range(3))
    return {
        "step_ms": plain,
        "audited_step_ms": audited,
        "overhead_ms": audited - plain,
        "audit_host_ms": statistics.median(host_ms),
        "request_mb": request_blocks * layers * HEADS * BLOCK * 2 * HEAD_SIZE * 2 / 1e6,
    }


def report(result: dict[str, float], device: str, tokens: int) -> str:
    return (
        f"vLLM audit, {device}, one {tokens}-token Llama-3.1-8B-shaped producer request "
        f"({result['request_mb']:.0f} MB of KV) per step: step {result['step_ms']:.2f} ms, "
        f"audited {result['audited_step_ms']:.2f} ms, overhead {result['overhead_ms']:.2f} ms "
        f"per step ({100 * result['overhead_ms'] / result['step_ms']:.1f}%); the hooks' host "
        f"time {result['audit_host_ms']:.2f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    args = parser.parse_args()
    result = measure_overhead(args.device, args.tokens, args.layers, args.steps, args.forward_ms)
    print(report(result, args.device, args.tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
