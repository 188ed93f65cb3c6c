"""The Triton kernel compiled ahead of time for GPUs that are not here, and what each
compiled variant needs of an SM.

``triton.compile`` builds a cubin for any CUDA target with the ``ptxas`` that Triton's
wheel ships, and ``cuobjdump`` reads its registers, stack and local (spill) memory back. A
variant is specialised exactly as a launch would be: the kernel's own argument binder sees
stand-in tensors with the template's dtype and alignment and the launch's integers. The
binder and ``_pack_args`` are Triton internals, the same from 3.6 to 3.9: scripts/test.sh
runs the compile test at both ends of pyproject.toml's range.
"""

from __future__ import annotations

import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kvaudit.checksum.kernels.triton_kernel import TABLE_FIELDS, TritonLaunch, _accumulate_kernel
from kvaudit.checksum.kernels.triton_strong import _strong_kernel
from kvaudit.checksum.kernels.triton_tiling import (
    LaunchConfig,
    Shape,
    kernel_arguments,
    launch_config,
    layout_is_aligned,
)
from kvaudit.core.scheme import STRONG_TOKEN_PLACES

KERNELS = ("seed", "strong", "fused")
"""The kernels a variant compiles for: the seed lane's, the strong lane's alone, and the
strong kernel computing both lanes in one pass (kvaudit/checksum/kernels/triton_strong.py)."""

ARCHES = (80, 90, 100)
"""The compute capabilities checked: A100 (sm_80), H100/H200 (sm_90), B200 (sm_100)."""


@dataclass(frozen=True)
class SmLimits:
    """What one SM of an architecture offers resident programs."""

    registers: int = 65536
    threads: int = 2048
    programs: int = 32
    shared_bytes: int = 227 * 1024


SM_LIMITS = {80: SmLimits(shared_bytes=163 * 1024), 90: SmLimits(), 100: SmLimits()}


@dataclass(frozen=True)
class Variant:
    """One kernel variant as a launch meets it: the template's layout and dtype, whether
    16-byte loads were promised, the template's start modulo 16 and the output columns."""

    shape: Shape
    strides: Shape
    piece_bytes: int
    aligned: bool
    start_mod16: int = 0
    columns: int = 1

    @classmethod
    def of_launch(cls, launch: TritonLaunch, columns: int) -> Variant:
        """The variant a plan's launch compiles for an output of ``columns``."""
        template = launch.template
        return cls(
            tuple(template.shape),
            tuple(template.stride()),
            template.element_size(),
            launch.aligned,
            template.data_ptr() % 16,
            columns,
        )

    @property
    def config(self) -> LaunchConfig:
        """The tiling the launch chooses (the promise dropped where the layout rules it out)."""
        aligned = self.aligned and layout_is_aligned(
            self.shape, self.strides, self.piece_bytes, self.start_mod16
        )
        return launch_config(self.shape, self.strides, self.piece_bytes, aligned)


@dataclass(frozen=True)
class Resources:
    """A compiled variant's use of an SM and what that leaves for others."""

    arch: int
    registers: int
    spill_bytes: int
    stack_bytes: int
    shared_bytes: int
    num_warps: int
    programs_per_sm: int
    tile_bytes: int

    @property
    def bytes_in_flight(self) -> int:
        """Loads one SM can have outstanding: each resident program issues a whole tile
        before it uses any of it (one pipeline stage)."""
        return self.programs_per_sm * self.tile_bytes


def _programs_per_sm(arch: int, registers: int, shared: int, warps: int) -> int:
    """Resident programs per SM, limited by registers (allocated per warp in units of 256,
    warps in groups of 4), threads, programs and shared memory."""
    limits = SM_LIMITS[arch]
    per_warp = -(-registers * 32 // 256) * 256
    warps_by_registers = limits.registers // per_warp // 4 * 4
    by_shared = limits.shared_bytes // shared if shared else limits.programs
    return min(
        warps_by_registers // warps, limits.threads // (32 * warps), limits.programs, by_shared
    )


def _stand_in(piece_bytes: int, start_mod16: int) -> torch.Tensor:
    """A small CPU tensor of the piece dtype that starts ``start_mod16`` past 16 bytes."""
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16}[piece_bytes]
    storage = torch.empty(64 // piece_bytes, dtype=dtype)
    skip = (start_mod16 - storage.data_ptr()) % 16 // piece_bytes
    return storage[skip:]


def _specialisation(variant: Variant, arch: int, kernel_name: str) -> tuple[ASTSource, dict]:
    """The kernel source specialised as the launch would be, and its compile options."""
    config = variant.config
    stride_args, constants = kernel_arguments(
        variant.shape, variant.strides, variant.piece_bytes, config
    )
    longs = torch.empty(2, dtype=torch.int64)
    pointers = 5 if kernel_name == "seed" else 9
    args = [
        _stand_in(variant.piece_bytes, variant.start_mod16),
        *([longs] * pointers),
        variant.columns,
        *stride_args,
    ]
    options = {"num_warps": config.num_warps, "num_stages": 1}
    keywords = dict(constants, FIELDS=TABLE_FIELDS, **options)
    if kernel_name != "seed":
        keywords.update(TOKEN_PLACES=STRONG_TOKEN_PLACES, SEED=kernel_name == "fused")
    backend = make_backend(GPUTarget("cuda", arch, 32))
    kernel = _accumulate_kernel if kernel_name == "seed" else _strong_kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, parsed = binder(*args, **keywords)
    parsed, signature, constexprs, attrs = kernel._pack_args(
        backend, keywords, bound, specialization, parsed
    )
    return ASTSource(kernel, signature, constexprs, attrs), parsed.__dict__


def compile_variant(variant: Variant, arch: int, kernel_name: str = "seed") -> Resources:
    """Compiles ``variant`` of the kernel ``kernel_name`` (one of ``KERNELS``) for
    ``sm_<arch>`` and reads its resources (cached per distinct specialisation, so variants
    that compile alike are compiled once)."""
    with warnings.catch_warnings():
        # The kernel has no floating point: Triton 3.9's notice about FP fusion is moot.
        warnings.filterwarnings("ignore", message=".*FP_FUSION.*")
        source, options = _specialisation(variant, arch, kernel_name)
    config = variant.config
    tile = config.block_rows * config.block_pieces
    cell = variant.shape[1] * variant.shape[2] * variant.shape[3] * variant.shape[4]
    key = (source.hash(), options["num_warps"], arch)
    if key not in _COMPILED:
        _COMPILED[key] = _compile(source, options, arch)
    registers, stack, local, shared = _COMPILED[key]
    return Resources(
        arch=arch,
        registers=registers,
        spill_bytes=local,
        stack_bytes=stack,
        shared_bytes=shared,
        num_warps=config.num_warps,
        programs_per_sm=_programs_per_sm(arch, registers, shared, config.num_warps),
        tile_bytes=min(tile, cell) * variant.piece_bytes,
    )


_COMPILED: dict[tuple[str, int, int], tuple[int, int, int, int]] = {}
"""Resources of every specialisation compiled in this process, by (source hash, warps, arch)."""


def _compile(source: ASTSource, options: dict, arch: int) -> tuple[int, int, int, int]:
    """Registers, stack, local and shared bytes of one specialisation on ``arch``."""
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    registers, stack, local = _resource_usage(compiled.asm["cubin"])
    return registers, stack, local, compiled.metadata.shared


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """Registers per thread, stack bytes and local (spill) bytes that ``cuobjdump`` reports."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [str(tool), "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    fields = {}
    for line in report.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    if not fields:
        raise RuntimeError(f"cuobjdump reported no resource usage: {report.strip()[:200]}")
    return int(fields["REG"]), int(fields["STACK"]), int(fields["LOCAL"])
