"""The whole engine with the Triton kernel (views -> plans -> fused launches) against the
CPU path and the independent reference, on small cases.

Without a GPU the kernel runs under Triton's interpreter, which must be switched on before
Triton is imported: this file runs itself in a subprocess with ``TRITON_INTERPRET=1``, which
prints every case's checksums as JSON. The parent compares them with the torch path and the
numpy reference (tests/helpers/reference.py) on the same seeded models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import engine_runs as er
from helpers import kvbuild as kb

L0, L1 = er.L0, er.L1


def _cases() -> dict[str, tuple[kb.Model, kb.Engine, int]]:
    """Seeded models and engines covering the kernel's paths through the engine."""
    gqa = kb.Model(
        (
            kb.GroupModel(
                0,
                (kb.Attn(L0, heads=2, head_size=8), kb.Attn(L1, heads=2, head_size=8)),
                8,
                layout="NKTHD",
            ),
        ),
        model_kv_heads=2,
    )
    return {
        "nthc-tp2": (er.attn_model(layout="NTHC"), kb.Engine(tp_size=2, seed=1), 29),
        "knhtd-kernel-blocks": (
            er.attn_model(layout="KNHTD", block_size=8),
            kb.Engine(tp_size=2, kernel_block_sizes={0: 2}, seed=2),
            37,
        ),
        "kv-pairs-non-contiguous": (
            er.attn_model(layout="NTHD"),
            kb.Engine(tp_size=1, physical={"NTHD": "HNTD"}, seed=3),
            21,
        ),
        "mla-fp8-replicas": (
            er.attn_model(heads=1, head_size=16, type="mla", layout="NTC", dtype="float8_e4m3fn"),
            kb.Engine(tp_size=2, seed=4),
            19,
        ),
        "gqa-replicas": (gqa, kb.Engine(tp_size=4, seed=5), 23),
        "split-states": (er.mamba_model(split=True), kb.Engine(tp_size=2, seed=6), 29),
        "unsplit-states": (er.mamba_model(checksummed=2), kb.Engine(tp_size=1, seed=7), 29),
    }


def _run_cases(backend: str) -> dict[str, dict]:
    """Per case: each request's per-position values under each replica key (hex), summed
    over workers, for the producer and the consumer."""
    results: dict[str, dict] = {}
    for name, (model, engine, tokens) in _cases().items():
        _, workers = er.build(model, engine, tokens)
        results[name] = {}
        for role in ("producer", "consumer"):
            record = er.run(workers, role, sums=er.checksummers(workers, role, backend))
            results[name][role] = {
                rid: {
                    str(gid): {
                        "keys": [list(k) for k in group.replica_keys],
                        "values": [[f"{int(v):016x}" for v in row] for row in group.values],
                    }
                    for gid, group in request.groups.items()
                }
                for rid, request in record.requests.items()
            }
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    # This file runs as a script: the tests' helpers (tests/helpers/) must be importable.
    tests = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", list(_cases()))
def test_triton_engine_equals_torch_path(interpreted: dict[str, dict], case: str) -> None:
    assert interpreted[case] == _run_cases("torch")[case]


@pytest.mark.parametrize("case", ["nthc-tp2", "gqa-replicas", "split-states"])
def test_triton_engine_equals_reference(interpreted: dict[str, dict], case: str) -> None:
    model, engine, tokens = _cases()[case]
    requests, workers = er.build(model, engine, tokens)
    block_size = engine.block_size(model.group(0))
    want = er.expected(model, 0, requests, workers, "req-1", engine.tp_size, "request", block_size)
    got = interpreted[case]["consumer"]["req-1"]["0"]
    for k, (replicas, _) in enumerate(got["keys"]):
        column = np.array([int(row[k], 16) for row in got["values"]], dtype=np.uint64)
        np.testing.assert_array_equal(column, want[replicas])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(_cases()))
def test_cuda_engine_equals_torch_path(case: str) -> None:
    model, engine, tokens = _cases()[case]
    _, workers = er.build(model, engine, tokens)
    for worker in workers:
        worker.tensors = {
            name: tuple(t.cuda() for t in tensor) if isinstance(tensor, tuple) else tensor.cuda()
            for name, tensor in worker.tensors.items()
        }
    for role in ("producer", "consumer"):
        on_gpu = er.run(workers, role, sums=er.checksummers(workers, role, "triton"))
        cpu_workers = [
            dataclasses.replace(
                w,
                tensors={
                    n: tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu()
                    for n, v in w.tensors.items()
                },
            )
            for w in workers
        ]
        on_cpu = er.run(cpu_workers, role)
        for rid, request in on_cpu.requests.items():
            for gid, group in request.groups.items():
                np.testing.assert_array_equal(on_gpu.requests[rid].groups[gid].values, group.values)


if __name__ == "__main__":
    print(json.dumps(_run_cases("triton")))
