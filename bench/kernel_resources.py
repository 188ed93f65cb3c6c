"""What each Triton kernel variant needs of an SM, compiled here for GPUs that are not.

    python bench/kernel_resources.py [--matrix] [--arch 80,90,100] [--latency-ns 750]
        [--kernels seed,strong,fused]

For every variant the plans produce for real models (and with ``--matrix`` the test
matrix's layouts and dtypes), compiled for sm_80, sm_90 and sm_100 without a GPU, it prints
registers per thread, shared memory and spill bytes per program, resident programs per SM
and the bytes of loads one SM keeps in flight, then a Little's-law estimate of the read
bandwidth those loads sustain on H100, H200 and B200 (SMs x bytes in flight / loaded DRAM
latency, capped at the memory's peak). Each variant is compiled for the seed lane's kernel,
the strong lane's kernel alone and the fused kernel (both lanes in one pass); the strong and
fused lines end with their modelled bandwidth as a fraction of the seed kernel's, and the
summary gives the lowest fraction per GPU. docs/gpu.md explains the columns.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers.triton_compile import (  # noqa: E402
    ARCHES,
    KERNELS,
    Resources,
    Variant,
    compile_variant,
)


@dataclass(frozen=True)
class Gpu:
    """A GPU's SM count, peak memory bandwidth and compute capability."""

    name: str
    sms: int
    peak_tb_s: float
    arch: int


GPUS = (Gpu("H100", 132, 3.35, 90), Gpu("H200", 132, 4.8, 90), Gpu("B200", 148, 8.0, 100))


def sustained_tb_s(gpu: Gpu, resources: Resources, latency_ns: float) -> float:
    """Little's law: the bandwidth that the SMs' loads in flight sustain, capped at peak."""
    return min(gpu.peak_tb_s, gpu.sms * resources.bytes_in_flight / latency_ns / 1e3)


def variant_label(variant: Variant) -> str:
    """The kernel-side shape of a variant: kernel blocks x heads x tokens x pieces, dtype."""
    _, kernel_blocks, heads, tokens, pieces = variant.shape
    config = variant.config
    bits = variant.piece_bytes * 8
    tiling = f"{config.block_rows}x{config.block_pieces}x{config.tiles_per_program}"
    columns = f" {variant.columns}col" if variant.columns > 1 else ""
    return (
        f"{kernel_blocks}x{heads}x{tokens}x{pieces} i{bits} vec{config.vec} tile {tiling}{columns}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", action="store_true", help="the test matrix's variants too")
    parser.add_argument("--arch", default=",".join(map(str, ARCHES)))
    parser.add_argument("--latency-ns", type=float, default=750.0, help="loaded DRAM latency")
    parser.add_argument(
        "--kernels", default=",".join(KERNELS), help=f"kernels to compile, of {','.join(KERNELS)}"
    )
    args = parser.parse_args()
    from helpers import kernel_variants

    arches = [int(a) for a in args.arch.split(",")]
    kernels = [k for k in KERNELS if k in args.kernels.split(",")]
    cases = dict(kernel_variants.MODELS)
    if args.matrix:
        cases.update(kernel_variants.MATRIX)
    started = time.perf_counter()
    header = f"{'case':32s} {'variant':44s} {'kernel':6s} {'warps':>5s}"
    for arch in arches:
        header += (
            f" | sm_{arch}: {'regs':>4s} {'smem':>5s} {'spill':>5s} {'prog':>4s} {'KB fly':>6s}"
        )
    header += " | " + " ".join(f"{gpu.name:>6s}" for gpu in GPUS)
    header += " | " + " ".join(f"{'/seed':>6s}" for _ in GPUS)
    print(header)
    print("-" * len(header))
    spills = 0
    lowest: dict[tuple[str, str], float] = {}
    for name, make in cases.items():
        for variant in make():
            seed_rates: list[float | None] = []
            for kernel in kernels:
                found = {arch: compile_variant(variant, arch, kernel) for arch in arches}
                line = (
                    f"{name:32s} {variant_label(variant):44s} {kernel:6s} "
                    f"{variant.config.num_warps:5d}"
                )
                for arch in arches:
                    r = found[arch]
                    spills += r.spill_bytes + r.stack_bytes
                    line += (
                        f" | sm_{arch}: {r.registers:4d} {r.shared_bytes:5d} "
                        f"{r.spill_bytes + r.stack_bytes:5d} {r.programs_per_sm:4d} "
                        f"{r.bytes_in_flight / 1024:6.0f}"
                    )
                rates = [
                    sustained_tb_s(gpu, found[gpu.arch], args.latency_ns)
                    if gpu.arch in found
                    else None
                    for gpu in GPUS
                ]
                if kernel == "seed":
                    seed_rates = rates
                line += " | " + " ".join(
                    f"{rate:6.2f}" if rate is not None else f"{'-':>6s}" for rate in rates
                )
                if kernel != "seed" and seed_rates:
                    ratios = []
                    for gpu, rate, seed in zip(GPUS, rates, seed_rates, strict=True):
                        if rate is None or not seed:
                            ratios.append(f"{'-':>6s}")
                            continue
                        ratios.append(f"{rate / seed:6.2f}")
                        key = (kernel, gpu.name)
                        lowest[key] = min(lowest.get(key, 1.0), rate / seed)
                    line += " | " + " ".join(ratios)
                print(line)
    print(
        f"\nTB/s: Little's-law read bandwidth at {args.latency_ns:.0f} ns loaded latency, "
        f"capped at peak ({', '.join(f'{g.name} {g.peak_tb_s}' for g in GPUS)}); "
        f"compiled in {time.perf_counter() - started:.0f} s"
    )
    for kernel in kernels:
        if kernel == "seed" or "seed" not in kernels:
            continue
        worst = ", ".join(
            f"{gpu.name} {lowest[(kernel, gpu.name)]:.2f}"
            for gpu in GPUS
            if (kernel, gpu.name) in lowest
        )
        print(f"{kernel}: lowest modelled bandwidth over the seed kernel's: {worst}")
    print(
        "The model counts loads in flight only: the strong lane's extra integer work per "
        "element is not in it (bench/gpu.py's part (s) times both lanes on a GPU)."
    )
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
