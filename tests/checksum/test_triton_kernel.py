"""The Triton kernel against a plain numpy reference of the kernel contract.

The kernel contract (docs/architecture.md): for each row ``i``, entry ``e``, kernel block
``k``, local head ``h``, token ``t`` and piece ``p``, with ``u = k * T + t``, if
``u < valid_tokens[i]``, ``out[i, column] += (2 * (first_slice + h) + 1) * x * (2 * j + 1)``
mod 2**64 with ``j = (first_tokens[i] + u) * cell_pieces + piece_offset + p``.

Without a GPU the kernel runs under Triton's interpreter, which must be switched on before
Triton is imported: this file runs itself in a subprocess with ``TRITON_INTERPRET=1``, which
prints the kernel's outputs as JSON, and compares them here with the reference computed from
the same (seeded) inputs. Tests marked ``cuda`` run the compiled kernel on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.kernel_cases import (
    CASES,
    MASK64,
    Case,
    Entry,
    H,
    bf16_values,
    case_nthc_two_layers,
    on_device,
    random_rows,
    reference,
)

REPO = Path(__file__).resolve().parents[2]


def launch(case: Case) -> list[list[int]]:
    """The kernel's result for a case, as unsigned 64-bit integers."""
    from kvaudit.checksum.kernels.triton_kernel import accumulate_triton

    device = case.template.device
    itemsize = case.template.element_size()
    table = []
    for entry in case.entries:
        assert entry.view.shape == case.template.shape
        assert entry.view.stride() == case.template.stride()
        assert entry.view.dtype == case.template.dtype
        distance = entry.view.data_ptr() - case.template.data_ptr()
        assert distance % itemsize == 0
        table.append(
            [
                distance // itemsize,
                entry.first_slice,
                entry.column,
                entry.piece_offset,
                entry.cell_pieces,
            ]
        )

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    out = longs(case.out_start)
    accumulate_triton(
        case.template,
        longs(table),
        longs(case.block_ids),
        longs(case.first_tokens),
        longs(case.valid_tokens),
        out,
        aligned=case.aligned,
    )
    return [[value & MASK64 for value in row] for row in out.cpu().tolist()]


# Cases run a second time with at most this many chunks (programs per row and entry), so
# that programs loop over several tiles, as launches do only for cells of over 65535 tiles.
LOOPED = {"long_cell": 3, "many_cell_rows": 1}


def _interpreter_main() -> None:
    """Runs every case on the CPU under the interpreter and prints the results as JSON."""
    from kvaudit.checksum.kernels import triton_tiling
    from kvaudit.checksum.kernels.triton_kernel import warm_up

    results = {name: launch(build("cpu", False)) for name, build in CASES.items()}
    looped = {}
    default = triton_tiling.MAX_CHUNKS
    for name, max_chunks in LOOPED.items():
        triton_tiling.MAX_CHUNKS = max_chunks
        triton_tiling.launch_config.cache_clear()
        looped[name] = launch(CASES[name]("cpu", False))
    triton_tiling.MAX_CHUNKS = default
    triton_tiling.launch_config.cache_clear()
    template = case_nthc_two_layers("cpu", False).template
    warm_up(template, 2, aligned=True)
    print(json.dumps({"results": results, "looped": looped, "warm_up": "ok"}))


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
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_reference(interpreted: dict, name: str) -> None:
    case = CASES[name]("cpu", False)
    expected = reference(case)
    assert interpreted["results"][name] == expected
    if case.expected is not None:
        assert expected == [[v & MASK64 for v in row] for row in case.expected]


@pytest.mark.parametrize("name", list(LOOPED))
def test_interpreted_kernel_looping_over_tiles_matches_reference(
    interpreted: dict, name: str
) -> None:
    assert interpreted["looped"][name] == reference(CASES[name]("cpu", False))


def test_warm_up_runs(interpreted: dict) -> None:
    assert interpreted["warm_up"] == "ok"


def test_cases_cover_the_tilings() -> None:
    """The small cases reach several piece tiles, chunks and row tiles, and both row orders."""
    from kvaudit.checksum.kernels.triton_tiling import launch_config

    def config(name: str, max_chunks: int | None = None):
        template = CASES[name]("cpu", False).template
        return launch_config(
            tuple(template.shape), template.stride(), template.element_size(), False, max_chunks
        )

    long_cell = config("long_cell")
    assert long_cell.piece_tiles == long_cell.chunks > 1 and long_cell.tiles_per_program == 1
    looped = config("long_cell", LOOPED["long_cell"])
    assert looped.piece_tiles > looped.tiles_per_program > 1 and looped.chunks > 1
    assert looped.tiles_per_program * looped.chunks > looped.piece_tiles  # a ragged last chunk
    many_rows = config("many_cell_rows", LOOPED["many_cell_rows"])
    assert many_rows.tiles_per_program > 1 and many_rows.piece_tiles == 1
    assert config("nthc_two_layers").heads_fastest
    assert not config("nhtc_kv_apart").heads_fastest
    odd = config("state_int16")
    assert odd.block_pieces * odd.piece_tiles > CASES["state_int16"]("cpu", False).template.shape[4]


def test_launch_config_ignores_rows_and_depends_on_layout() -> None:
    """The tiling (hence the compiled variant) follows the layout alone, so warm-up compiles
    what later launches use, and a Llama-shaped block is one program's single tile."""
    from kvaudit.checksum.kernels.triton_tiling import launch_config

    shape = (1000, 1, 8, 16, 32)
    strides = (2 * 16 * 8 * 32, 16 * 8 * 32, 32, 8 * 32, 1)
    llama = launch_config(shape, strides, 8, True)
    assert (llama.block_rows * llama.block_pieces, llama.tiles_per_program, llama.chunks) == (
        8 * 16 * 32,
        1,
        1,
    )
    assert llama.vec == 2


@pytest.mark.parametrize(
    "change",
    ["template_dtype", "table_shape", "rows_mismatch", "out_dtype", "out_layout"],
)
def test_bad_arguments_raise_one_line_errors(change: str) -> None:
    from kvaudit.checksum.kernels.triton_kernel import accumulate_triton
    from kvaudit.core.errors import KvauditError

    template = torch.zeros((2, 1, 2, 2, 2), dtype=torch.int64)
    table = torch.zeros((1, 5), dtype=torch.int64)
    rows = torch.zeros(3, dtype=torch.int64)
    out = torch.zeros((3, 2), dtype=torch.int64)
    args = {
        "template": template,
        "table": table,
        "block_ids": rows,
        "first_tokens": rows,
        "valid_tokens": rows,
        "out": out,
    }
    if change == "template_dtype":
        args["template"] = template.float()
    elif change == "table_shape":
        args["table"] = torch.zeros((1, 4), dtype=torch.int64)
    elif change == "rows_mismatch":
        args["valid_tokens"] = torch.zeros(2, dtype=torch.int64)
    elif change == "out_dtype":
        args["out"] = out.to(torch.int32)
    else:
        args["out"] = torch.zeros((2, 3), dtype=torch.int64).t()
    with pytest.raises(KvauditError) as error:
        accumulate_triton(**args)
    message = str(error.value)
    assert "\n" not in message and message.startswith("triton kernel: ")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_matches_reference(name: str, big: bool) -> None:
    case = CASES[name]("cuda", big)
    assert launch(case) == reference(case)
    if case.expected is not None:
        assert reference(case) == [[v & MASK64 for v in row] for row in case.expected]


def llama_like_cases(device: str) -> list[Case]:
    """Random block tables over one fused launch of 6 layers' K and V (vLLM layout, 8 KV
    heads of 128 bf16, 16-token blocks), aligned and not."""
    g = torch.Generator().manual_seed(13)
    blocks, tokens, heads, dim = 64, 16, 8, 128
    pieces = dim // 4
    caches = on_device(device, *(bf16_values((blocks, 2, tokens, heads, dim), g) for _ in range(6)))
    views = [
        c.view(torch.int64)[:, plane].permute(0, 2, 1, 3).unsqueeze(1)
        for c in caches
        for plane in range(2)
    ]
    entries = [
        Entry(views[2 * layer + plane], layer * H, layer % 2, plane * pieces, 2 * pieces)
        for layer in range(6)
        for plane in range(2)
    ]
    return [
        Case(
            views[5], entries, *random_rows(g, 200, blocks, tokens, 2), aligned=aligned, keep=caches
        )
        for aligned in (True, False)
    ]


@pytest.mark.cuda
@needs_cuda
def test_cuda_random_llama_like_launch() -> None:
    for case in llama_like_cases("cuda"):
        assert launch(case) == reference(case)


if __name__ == "__main__":
    _interpreter_main()
