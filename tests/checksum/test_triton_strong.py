"""The strong lane's Triton kernel (alone and fused with the seed lane) against the strong
lane's definition computed in Python integers, and the whole engine with the Triton backend
against the independent reference (tests/helpers/reference.py, strong_block_checksums).

Without a GPU the kernel runs under Triton's interpreter, which must be switched on before
Triton is imported: this file runs itself in a subprocess with ``TRITON_INTERPRET=1``, which
prints the kernel's results (and the engine checks' outcomes) as JSON; the parent compares
them with references computed here. Tests marked ``cuda`` run the compiled kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import engine_runs as er
from helpers import kvbuild as kb
from helpers.kernel_cases import CASES, MASK64, Case, reference

REPO = Path(__file__).resolve().parents[2]
PRIME = 2**64 - 59
_UNSIGNED = {torch.int64: np.uint64, torch.int32: np.uint32, torch.int16: np.uint16}
# Cases run a second time with at most this many chunks, so that programs loop over tiles.
LOOPED = {"long_cell": 3, "many_cell_rows": 1}


def strong_reference(case: Case) -> list[list[int]]:
    """The strong lane of a kernel case from its definition: per live cell row, the row's
    pieces as one number times ``2**(64 E)`` with ``E = ((s mod 2**64) * 4096 + token mod
    4096) * 2**20 + piece offset``, summed modulo ``2**64 - 59``."""
    columns = len(case.out_start[0])
    out = [[0] * columns for _ in case.block_ids]
    for entry in case.entries:
        values = entry.view.cpu().numpy().view(_UNSIGNED[entry.view.dtype])
        _, kernel_blocks, heads, tokens, _ = values.shape
        for i, block in enumerate(case.block_ids):
            total = 0
            for k in range(kernel_blocks):
                for t in range(tokens):
                    u = k * tokens + t
                    if u >= case.valid_tokens[i]:
                        continue
                    token = case.first_tokens[i] + u
                    for h in range(heads):
                        cell = values[block, k, h, t]
                        number = sum(int(x) << (64 * p) for p, x in enumerate(cell))
                        slice_number = (entry.first_slice + h) % 2**64
                        place = (slice_number * 4096 + token % 4096) * 2**20 + entry.piece_offset
                        total += number % PRIME * pow(2, 64 * place, PRIME)
            out[i][entry.column] = (out[i][entry.column] + total) % PRIME
    return out


def _plan(case: Case):
    """A Triton plan of the case's entries (the strong kernel needs only parts and keys)."""
    from kvaudit.checksum.kernels import LaunchPart
    from kvaudit.checksum.plans import GroupPlan

    parts = [
        LaunchPart(e.view, e.first_slice, e.column, e.piece_offset, e.cell_pieces)
        for e in case.entries
    ]
    keys = [(c, 0) for c in range(len(case.out_start[0]))]
    return GroupPlan(keys, [], str(case.template.device), True, parts, "triton")


def launch(case: Case) -> dict[str, list[list[int]]]:
    """The strong kernel's residues of a case alone, and fused with the seed lane (whose
    sums add into the case's starting values)."""
    from kvaudit.checksum.kernels.triton_strong import strong_sums

    device = case.template.device

    def longs(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    rows = [longs(case.block_ids), longs(case.first_tokens), longs(case.valid_tokens)]
    alone = strong_sums(_plan(case), *rows)
    seed = longs(case.out_start)
    fused = strong_sums(_plan(case), *rows, seed_out=seed)
    if device.type == "cuda":
        torch.cuda.synchronize()

    def unsigned(tensor: torch.Tensor) -> list[list[int]]:
        return [[value & MASK64 for value in row] for row in tensor.cpu().tolist()]

    return {"strong": unsigned(alone), "fused": unsigned(fused), "seed": unsigned(seed)}


def _engine_cases() -> dict[str, tuple[kb.Model, kb.Engine, int, str]]:
    """Seeded models and engines: layouts, dtypes, TP, kernel blocks, split states."""
    return {
        "nthc-bf16-tp2": (
            er.attn_model(layout="NTHC"),
            kb.Engine(tp_size=2, seed=1),
            29,
            "request",
        ),
        "knhtd-fp32-kernel-blocks": (
            er.attn_model(layout="KNHTD", block_size=8, dtype="float32"),
            kb.Engine(tp_size=2, kernel_block_sizes={0: 2}, seed=2),
            37,
            "request",
        ),
        "nthd-non-contiguous-block-positions": (
            er.attn_model(layout="NTHD"),
            kb.Engine(tp_size=1, physical={"NTHD": "HNTD"}, seed=3),
            21,
            "block",
        ),
        "mla-fp8-replicas": (
            er.attn_model(heads=1, head_size=16, type="mla", layout="NTC", dtype="float8_e4m3fn"),
            kb.Engine(tp_size=2, seed=4),
            19,
            "request",
        ),
        "nhtc-gqa-tp4": (
            er.attn_model(heads=2, layout="NHTC", model_kv_heads=2),
            kb.Engine(tp_size=4, seed=5),
            23,
            "request",
        ),
        "split-states": (er.mamba_model(split=True), kb.Engine(tp_size=2, seed=6), 29, "request"),
        "unsplit-states": (
            er.mamba_model(checksummed=2),
            kb.Engine(tp_size=1, seed=7),
            29,
            "request",
        ),
    }


def _engine_checks() -> dict[str, str]:
    """Per engine case: "ok" when the Triton backend's record (both lanes, fused) equals the
    reference for the producer and the consumer, else the failure."""
    outcomes = {}
    for name, (model, engine, tokens, positions) in _engine_cases().items():
        try:
            requests, workers = er.build(model, engine, {"req-1": tokens, "req-2": tokens - 5})
            block_size = engine.block_size(model.group(0))
            for role in ("producer", "consumer"):
                sums = er.checksummers(workers, role, "triton")
                record = er.run(workers, role, positions, sums=sums)
                er.assert_matches(
                    record, model, 0, requests, workers, engine.tp_size, role, positions, block_size
                )
            outcomes[name] = "ok"
        except Exception:  # the parent prints which case and why
            outcomes[name] = traceback.format_exc()[-3000:]
    return outcomes


def _interpreter_main() -> None:
    """Runs every case under the interpreter and prints the results as JSON."""
    from kvaudit.checksum.kernels import triton_tiling

    results = {name: launch(build("cpu", False)) for name, build in CASES.items()}
    looped = {}
    default = triton_tiling.MAX_CHUNKS
    for name, max_chunks in LOOPED.items():
        triton_tiling.MAX_CHUNKS = max_chunks
        triton_tiling.launch_config.cache_clear()
        looped[name] = launch(CASES[name]("cpu", False))
    triton_tiling.MAX_CHUNKS = default
    triton_tiling.launch_config.cache_clear()
    print(json.dumps({"results": results, "looped": looped, "engine": _engine_checks()}))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The kernel's outputs for every case, from one interpreter subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests = str(REPO / "tests")  # this file runs as a script: its helpers must be importable
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), tests, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_strong_kernel_matches_definition(interpreted: dict, name: str) -> None:
    case = CASES[name]("cpu", False)
    want = strong_reference(case)
    assert interpreted["results"][name]["strong"] == want
    assert interpreted["results"][name]["fused"] == want


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_fused_kernel_adds_the_seed_lane(interpreted: dict, name: str) -> None:
    assert interpreted["results"][name]["seed"] == reference(CASES[name]("cpu", False))


@pytest.mark.parametrize("name", list(LOOPED))
def test_interpreted_strong_kernel_looping_over_tiles(interpreted: dict, name: str) -> None:
    case = CASES[name]("cpu", False)
    assert interpreted["looped"][name]["strong"] == strong_reference(case)
    assert interpreted["looped"][name]["seed"] == reference(case)


def test_strong_reference_sees_a_sign_flip() -> None:
    """The definition used above is not blind: a top bit flipped twice in a block changes it
    (where the seed lane's sum mod 2**64 may not)."""
    case = CASES["nthc_two_layers"]("cpu", False)
    before = strong_reference(case)
    view = case.entries[0].view
    block, valid = case.block_ids[0], case.valid_tokens[0]
    assert valid > 0
    flip = torch.tensor(-(2**63), dtype=torch.int64)
    view[block, 0, 0, 0, 0] ^= flip
    view[block, 0, 0, 0, 1] ^= flip
    assert strong_reference(case)[0] != before[0]


@pytest.mark.parametrize("name", list(_engine_cases()))
def test_interpreted_engine_lanes_match_reference(interpreted: dict, name: str) -> None:
    assert interpreted["engine"][name] == "ok"


def test_fold_bounds_hold_for_extreme_limbs() -> None:
    """The kernel's fold (mirrored here in Python integers on int64 bits) gives limbs below
    2**32 whose value is congruent to the input, at the bounds the kernel relies on."""

    def fold(c0: int, c1: int, c2: int, c3: int) -> tuple[int, int]:
        mask = 0xFFFFFFFF
        a = c0 + 59 * c2
        b = c1 + 59 * c3
        a = a + 59 * (b >> 32)
        carry_word = (b & mask) + (a >> 32)
        low = (a & mask) + 59 * (carry_word >> 32)
        return low & mask, (carry_word & mask) + (low >> 32)

    top = 2**56 - 1
    for limbs in [(top, top, top, top), (top, top, 0, 0), (2**32 - 1,) * 4, (0, 2**32 - 1, 0, 0)]:
        lo, hi = fold(*limbs)
        assert 0 <= lo < 2**32 and 0 <= hi < 2**32
        value = limbs[0] + (limbs[1] << 32) + (limbs[2] << 64) + (limbs[3] << 96)
        assert (lo + (hi << 32)) % PRIME == value % PRIME


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_strong_kernel_matches_definition(name: str) -> None:
    case = CASES[name]("cuda", False)
    got = launch(case)
    assert got["strong"] == strong_reference(case) == got["fused"]
    assert got["seed"] == reference(case)


if __name__ == "__main__":
    _interpreter_main()
