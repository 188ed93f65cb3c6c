"""Every Triton kernel variant the plans produce compiles for real GPUs, without spilling.

No GPU is needed: each variant is compiled ahead of time for sm_80, sm_90 and sm_100 with
the ptxas that Triton's wheel ships (tests/helpers/triton_compile.py), exactly as a launch
specialises it, and its registers, stack and local memory are read from the cubin. Real
model shapes (tests/helpers/kernel_variants.py's MODELS) are the main variants: they must also
keep at least 4 programs resident per SM, or as many bytes of loads in flight (docs/gpu.md).
The test matrix's variants compile for sm_90; the other architectures are marked slow.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers import kernel_variants

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiling needs Triton without its interpreter", allow_module_level=True)

from helpers.triton_compile import ARCHES, Variant, compile_variant

# The least a main variant keeps in flight per SM: 4 programs with a 32 KB tile (a Llama
# block's K), about 4x what Little's law asks of an H200 at 4.8 TB/s and 750 ns (27 KB).
MIN_PROGRAMS = 4
MIN_BYTES_IN_FLIGHT = 4 * 32 * 1024


@functools.cache
def _variants(name: str) -> tuple[Variant, ...]:
    """The variants of one case, found once per run."""
    cases = {**kernel_variants.MODELS, **kernel_variants.MATRIX}
    return tuple(cases[name]())


def _compile_all(name: str, arch: int) -> list[tuple[Variant, object]]:
    variants = _variants(name)
    assert variants, f"{name}: the plans produced no Triton launch"
    compiled = []
    for variant in variants:
        resources = compile_variant(variant, arch)
        where = f"{name} {variant.shape[1:]} i{variant.piece_bytes * 8} on sm_{arch}"
        assert resources.spill_bytes == 0, f"{where}: {resources.spill_bytes} bytes spilled"
        assert resources.stack_bytes == 0, f"{where}: {resources.stack_bytes} bytes of stack"
        assert 0 < resources.registers <= 255, where
        compiled.append((variant, resources))
    return compiled


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name", list(kernel_variants.MODELS))
def test_model_variants_compile_without_spills_and_fill_the_sm(name: str, arch: int) -> None:
    for variant, resources in _compile_all(name, arch):
        enough = (
            resources.programs_per_sm >= MIN_PROGRAMS
            or resources.bytes_in_flight >= MIN_BYTES_IN_FLIGHT
        )
        assert enough, (
            f"{name} {variant.shape[1:]} on sm_{arch}: {resources.registers} registers, "
            f"{resources.programs_per_sm} programs, {resources.bytes_in_flight} bytes in flight"
        )


@pytest.mark.parametrize(
    "arch", [pytest.param(arch, marks=[] if arch == 90 else pytest.mark.slow) for arch in ARCHES]
)
@pytest.mark.parametrize("name", list(kernel_variants.MODELS))
def test_fused_strong_kernel_compiles_without_spills(name: str, arch: int) -> None:
    """The kernel Triton plans run (both lanes in one pass) compiles without spills and
    keeps at least 24 KB in flight per SM (the 2-byte conv states' floor today,
    docs/gpu.md; an H200 needs about 27 KB at full bandwidth)."""
    for variant in _variants(name):
        resources = compile_variant(variant, arch, "fused")
        where = f"{name} {variant.shape[1:]} i{variant.piece_bytes * 8} fused on sm_{arch}"
        assert resources.spill_bytes == 0 and resources.stack_bytes == 0, where
        assert resources.bytes_in_flight >= 24 * 1024, (where, resources)


@pytest.mark.parametrize(
    "arch", [pytest.param(arch, marks=[] if arch == 90 else pytest.mark.slow) for arch in ARCHES]
)
@pytest.mark.parametrize("name", list(kernel_variants.MATRIX))
def test_matrix_variants_compile_without_spills(name: str, arch: int) -> None:
    _compile_all(name, arch)


def test_variants_follow_the_layout() -> None:
    """Different layouts reach the compiler as different variants, the same layout on
    every TP rank as one."""
    assert len(set(_variants("Llama-3.1-8B KNTHD") + _variants("Llama-3.1-8B NKHTD"))) == 2
    qwen = _variants("Qwen2.5-7B GQA TP8")
    assert len(qwen) == 1 and qwen[0].shape[2] == 1  # one local head, as at TP 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_launch_compiles_what_the_compile_test_checks() -> None:
    """On a GPU, a launch's own compiled variant uses the registers found ahead of time."""
    from kvaudit.checksum.kernels.triton_kernel import _accumulate_kernel, warm_up

    cache = torch.zeros((64, 2, 16, 8, 128), dtype=torch.bfloat16, device="cuda")
    template = cache.view(torch.int64)[:, 0].permute(0, 2, 1, 3).unsqueeze(1)
    warm_up(template, 1, aligned=True)
    major, minor = torch.cuda.get_device_capability()
    variant = Variant(tuple(template.shape), template.stride(), 8, True, 0, 1)
    expected = compile_variant(variant, 10 * major + minor).registers
    try:
        caches = _accumulate_kernel.device_caches[torch.cuda.current_device()][0]
        compiled = list(caches.values())
        for kernel in compiled:
            kernel._init_handles()
        found = {kernel.n_regs for kernel in compiled}
    except (AttributeError, IndexError, KeyError, TypeError) as error:
        pytest.skip(f"this Triton keeps its compiled kernels elsewhere ({error})")
    assert expected in found
