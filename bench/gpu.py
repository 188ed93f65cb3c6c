"""GPU run: the CUDA tests, then the Triton kernel against the copy bandwidth and torch.

    python bench/gpu.py [--tokens 65536] [--request-tokens 2048] [--repeats 20] [--skip-tests]

On one CUDA GPU, in one run of a few minutes (docs/gpu.md):

1. ``pytest -q -m cuda tests/``: the compiled kernel against the tests' reference.
2. On a Llama-3.1-8B-shaped cache (32 layers, 8 KV heads of 128 bf16, K and V stored
   apart in 16-token blocks, one tensor per layer, blocks in random order), with CUDA
   events, the median of ``--repeats`` runs, L2 flushed before each:
   (a) a device-to-device copy of the same bytes (the read-bandwidth baseline);
   (b) the kernel on a large batch (``--tokens``) in two layouts, aligned and not;
   (c) the kernel on one ``--request-tokens`` request (target: under 100 us for 2048);
   (d) a torch gather-multiply-sum of the same blocks (index_select, int64 mul, sum);
   (e) the library end to end (``Checksummer.checksum``, host time included);
   (f) the compiled variants' registers, spills and programs per SM for this GPU
       (tests/helpers/triton_compile.py, as bench/kernel_resources.py prints them);
   (s) the strong lane (kvaudit/checksum/kernels/triton_strong.py) on the batch and the
       request, aligned: its kernel alone and fused with the seed lane (what Triton plans
       run), each against the seed kernel's time (issue 37: the fused pass within 10% of
       the seed kernel's bandwidth), and the library's strong lane against the CPU's.
   It checks that (b), (c), (d), (e) and (s) agree and prints GB/s and the ratios.
3. (g) A ``--dump-gib`` dump (bench/dump_memory.py's Llama-shaped layers) checksummed with
   ``--device cuda`` (rows staged through two pinned buffers, host-to-device copies on
   their own stream overlapping the checksums), the median of 3 runs against a pinned
   host-to-device copy of the same bytes and the CPU path; the GPU's record must equal the
   CPU's. Then the rows' movement alone, as that path stages them with no checksums (to
   the GPU; into host buffers), and whole ``kvaudit checksum`` processes on that dump,
   ``--device cuda`` and ``--device cpu`` (``--skip-dump`` leaves all of (g) out).
4. (h) The vLLM connector's per-step overhead for one ``--request-tokens`` producer
   request (bench/vllm_overhead.py: side stream and asynchronous host copy, steps with
   and without the audit back to back).
5. (i) kvaudit's SGLang inline check for one ``--request-tokens`` request on a TP=2 rank
   of SGLang-shaped pool buffers (bench/sglang_inline.py: the checksum of the request's
   pages against a gather of the same pages; SGLang itself is not needed).
6. Live caches (bench/live_gpu.py): toy engines with CUDA tensors behind live agents,
   read, dumped and compared through the command line (``--skip-live`` leaves it out).

It stays under 10 minutes on an H200 (the tests are stopped after 300 s). A part that
raises is printed with its traceback and counts as a failed check; the parts after it
still run.

Exits 2 without CUDA, 1 if a test fails or results disagree, else 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvaudit.description import CacheDescription
    from kvaudit.dumps import Dump

REPO = Path(__file__).resolve().parents[1]
LAYERS, HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
PIECES = HEAD_SIZE * 2 // 8  # 8-byte pieces of one K (or V) row
MAX_HEADS = 65536
REQUEST_TARGET_US = 100.0
# The whole script stays under 10 minutes: the tests get at most this, the figures the rest.
TESTS_TIMEOUT_S = 300
DEVICE = "cuda"


@dataclass
class Cache:
    """One layout's per-layer tensors and their int64 piece views."""

    layout: str
    layers: list[torch.Tensor]  # bf16, NKTHD [blocks, 2, T, H, D] or NKHTD [blocks, 2, H, T, D]
    planes: list[torch.Tensor]  # int64 [blocks, 1, H, T, P], K and V of each layer in order

    @property
    def nbytes_per_block(self) -> int:
        return LAYERS * 2 * BLOCK * HEADS * HEAD_SIZE * 2


def run_tests() -> bool:
    """Runs the CUDA-marked tests; prints their summary; True when they passed."""
    print("== pytest -q -m cuda tests/", flush=True)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=TESTS_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        print(f"  the tests ran past {TESTS_TIMEOUT_S} s and were stopped")
        return False
    lines = (done.stdout + done.stderr).strip().splitlines()
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    for line in failures[:20] + lines[-3:]:
        print("  " + line)
    # pytest exits 5 when nothing was collected under the marker: not a pass.
    return done.returncode == 0


def make_cache(layout: str, blocks: int, generator: torch.Generator) -> Cache:
    """Random bf16 KV of every layer, and the K and V piece views the kernel reads."""
    shape = (blocks, 2, BLOCK, HEADS, HEAD_SIZE)
    if layout == "NKHTD":
        shape = (blocks, 2, HEADS, BLOCK, HEAD_SIZE)
    layers = []
    planes = []
    for _ in range(LAYERS):
        tensor = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        torch.cuda.manual_seed(seed)
        tensor.view(torch.int16).random_(-(2**15), 2**15 - 1)
        layers.append(tensor)
        words = tensor.view(torch.int64)
        for plane in range(2):
            view = words[:, plane]
            if layout == "NKTHD":
                view = view.permute(0, 2, 1, 3)
            planes.append(view.unsqueeze(1))
    return Cache(layout, layers, planes)


def entry_table(cache: Cache) -> torch.Tensor:
    """The kernel's table: every layer's K and V, offsets from the first K view."""
    from kvaudit.checksum.kernels import LaunchPart
    from kvaudit.checksum.kernels.triton_kernel import entry_table as kernel_table

    parts = []
    for index, view in enumerate(cache.planes):
        layer, plane = divmod(index, 2)
        parts.append(LaunchPart(view, layer * MAX_HEADS, 0, plane * PIECES, 2 * PIECES))
    return kernel_table(parts)


def request_rows(block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of one request whose blocks are full: ids, first tokens, valid tokens."""
    count = block_ids.numel()
    first = torch.arange(count, dtype=torch.int64, device=DEVICE) * BLOCK
    valid = torch.full((count,), BLOCK, dtype=torch.int64, device=DEVICE)
    return block_ids, first, valid


def torch_checksum(
    cache: Cache, block_ids: torch.Tensor, first: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The same checksums with plain torch: gather the blocks, multiply by weights, sum."""
    device = block_ids.device
    u = torch.arange(BLOCK, dtype=torch.int64, device=device)
    p = torch.arange(2 * PIECES, dtype=torch.int64, device=device).view(2, PIECES)
    j = (first[:, None] + u[None, :])[:, None, :, None] * (2 * PIECES) + p[None, :, None, :]
    weights = (2 * j + 1) * (u[None, :] < valid[:, None])[:, None, :, None]  # [rows, 2, T, P]
    heads = torch.arange(HEADS, dtype=torch.int64, device=device)
    total = torch.zeros(block_ids.numel(), dtype=torch.int64, device=device)
    for layer, tensor in enumerate(cache.layers):
        x = tensor.view(torch.int64).index_select(0, block_ids)
        if cache.layout == "NKTHD":  # [rows, 2, T, H, P]
            sums = (x * weights[:, :, :, None, :]).sum(dim=(1, 2, 4))
        else:  # [rows, 2, H, T, P]
            sums = (x * weights[:, :, None, :, :]).sum(dim=(1, 3, 4))
        total += (sums * (2 * (layer * MAX_HEADS + heads) + 1)).sum(dim=1)
    return total


def median_ms(run: Callable[[], object], repeats: int, flush: torch.Tensor) -> float:
    """Median device time of ``run`` with CUDA events, L2 flushed before each repeat.

    The flush also keeps the GPU busy while the host launches ``run``, so host launch
    overhead stays outside the events.
    """
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def back_to_back_ms(run: Callable[[], object], count: int) -> float:
    """Mean device time per call of ``count`` calls between one pair of events."""
    run()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / count


def kernel_report(template: torch.Tensor, aligned: bool) -> str:
    """Registers, spills and resident programs of the variant this layout compiles, as
    bench/kernel_resources.py works them out for this GPU's architecture."""
    sys.path.insert(0, str(REPO / "tests"))  # the compile tooling lives with the tests
    from helpers.triton_compile import Variant, compile_variant

    major, minor = torch.cuda.get_device_capability()
    variant = Variant(
        tuple(template.shape), template.stride(), 8, aligned, template.data_ptr() % 16
    )
    r = compile_variant(variant, 10 * major + minor)
    return (
        f"sm_{10 * major + minor}: {r.registers} regs, {r.spill_bytes} B spilled, "
        f"{r.programs_per_sm} programs/SM, {r.bytes_in_flight // 1024} KB in flight per SM"
    )


def _description(cache: Cache, num_blocks: int) -> CacheDescription:
    """The bench model's description for a cache of ``num_blocks`` blocks."""
    from kvaudit.description import parse_description

    return parse_description(
        {
            "kvaudit": 1,
            "num_blocks": num_blocks,
            "groups": [
                {
                    "spec": {
                        "type": "full_attention",
                        "block_size": BLOCK,
                        "num_kv_heads": HEADS,
                        "head_size": HEAD_SIZE,
                        "dtype": "bfloat16",
                        "layout": cache.layout,
                    },
                    "layers": [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
                }
            ],
        },
        "bench",
    )


def end_to_end(cache: Cache, block_ids: list[int]) -> tuple[float, torch.Tensor, np.ndarray]:
    """Checksummer.checksum of one request over this cache: wall seconds, the seed lane's
    totals and the strong lane's residues."""
    from kvaudit.checksum.checksummer import Checksummer, RequestBlocks

    description = _description(cache, cache.layers[0].shape[0])
    tensors = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(cache.layers)}
    checksummer = Checksummer(description, tensors, backend="triton")
    requests = {"bench": RequestBlocks(len(block_ids) * BLOCK, {0: (0, block_ids)})}
    checksummer.checksum(requests)  # results come back to the host: no sync needed
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        record = checksummer.checksum(requests)
        best = min(best, time.perf_counter() - started)
    group = record.requests["bench"].groups[0]
    strong = np.asarray(group.strong, dtype=np.uint64)[:, 0].copy()
    return best, torch.from_numpy(group.values.view("int64")[:, 0].copy()), strong


def cpu_strong(cache: Cache, block_ids: list[int]) -> np.ndarray:
    """The strong lane of the request's blocks from the CPU path (the C loop), on a host
    copy of just those blocks."""
    from kvaudit.checksum.checksummer import Checksummer, RequestBlocks

    index = torch.tensor(block_ids, dtype=torch.int64, device=DEVICE)
    tensors = {
        f"model.layers.{i}.self_attn.attn": t.index_select(0, index).cpu()
        for i, t in enumerate(cache.layers)
    }
    checksummer = Checksummer(_description(cache, len(block_ids)), tensors, backend="numpy")
    local = list(range(len(block_ids)))
    record = checksummer.checksum({"bench": RequestBlocks(len(local) * BLOCK, {0: (0, local)})})
    return np.asarray(record.requests["bench"].groups[0].strong, dtype=np.uint64)[:, 0]


def bench_strong(
    cache: Cache,
    seed_results: dict[tuple[str, bool], tuple[float, torch.Tensor]],
    rows: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    args: argparse.Namespace,
    flush: torch.Tensor,
) -> dict[str, bool]:
    """(s): the strong kernel alone and fused with the seed lane, timed against the seed
    kernel (aligned) on the batch and the request; the checks that their results agree."""
    from kvaudit.checksum.kernels import LaunchPart
    from kvaudit.checksum.kernels.triton_strong import strong_launches

    parts = []
    for index, view in enumerate(cache.planes):
        layer, plane = divmod(index, 2)
        parts.append(LaunchPart(view, layer * MAX_HEADS, 0, plane * PIECES, 2 * PIECES))
    (launch,) = strong_launches(parts)
    checks = {}
    for name, these in (("batch", rows[0]), ("request", rows[1])):
        count = these[0].numel()
        nbytes = count * cache.nbytes_per_block
        seed_ms, seed_values = seed_results[(name, True)]
        limbs = torch.zeros((count, 1, 2), dtype=torch.int64, device=DEVICE)
        seed = torch.zeros((count, 1), dtype=torch.int64, device=DEVICE)
        alone_ms = median_ms(lambda r=these, o=limbs: launch.accumulate(*r, o), args.repeats, flush)
        fused_ms = median_ms(
            lambda r=these, o=limbs, s=seed: launch.accumulate(*r, o, s), args.repeats, flush
        )
        limbs.zero_()
        launch.accumulate(*these, limbs)
        alone = limbs.clone()
        limbs.zero_()
        seed.zero_()
        launch.accumulate(*these, limbs, seed)
        checks[f"strong {name}: fused == alone"] = torch.equal(alone, limbs)
        checks[f"strong {name}: fused seed lane == seed kernel"] = torch.equal(
            seed[:, 0], seed_values
        )
        for kind, ms in (("strong alone", alone_ms), ("fused (both)", fused_ms)):
            print(
                f"  (s) {kind} {name:7s} {ms * 1e3:10.1f} us  {nbytes / ms / 1e6:7.0f} GB/s  "
                f"{seed_ms / ms:5.2f}x the seed kernel's bandwidth"
            )
        verdict = "within" if fused_ms <= seed_ms / 0.9 else "NOT within"
        print(f"  (s) fused {name}: {verdict} 10% of the seed kernel's bandwidth")
    return checks


def bench_layout(
    cache: Cache, order: torch.Tensor, args: argparse.Namespace, flush: torch.Tensor
) -> bool:
    """Measures (a) to (e) on one layout's cache; prints them; True when all results agree."""
    from kvaudit.checksum.kernels.triton_kernel import accumulate_triton, warm_up
    from kvaudit.checksum.kernels.triton_tiling import launch_config

    blocks = order.numel()
    request_blocks = args.request_tokens // BLOCK
    table = entry_table(cache)
    template = cache.planes[0]
    nbytes = blocks * cache.nbytes_per_block
    request_bytes = request_blocks * cache.nbytes_per_block
    config = launch_config(tuple(template.shape), template.stride(), 8, True)
    print(f"\n== {cache.layout}: {nbytes / 1e9:.2f} GB over {blocks} blocks, {config}")

    scratch = torch.empty_like(cache.layers[0])

    def copy_all() -> None:
        for tensor in cache.layers:
            scratch.copy_(tensor)

    copy_ms = median_ms(copy_all, args.repeats, flush)
    copy_read = nbytes / copy_ms / 1e6
    print(
        f"  (a) device copy         {copy_ms:9.3f} ms  {copy_read:7.0f} GB/s read "
        f"({2 * copy_read:.0f} GB/s read + written)"
    )

    big_rows = request_rows(order)
    small_rows = request_rows(order[:request_blocks])
    results: dict[tuple[str, bool], tuple[float, torch.Tensor]] = {}
    for aligned in (True, False):
        warm_up(template, 1, aligned)
        for name, rows in (("batch", big_rows), ("request", small_rows)):
            out = torch.zeros((rows[0].numel(), 1), dtype=torch.int64, device=DEVICE)

            def kernel(r=rows, o=out, a=aligned) -> None:
                accumulate_triton(template, table, *r, o, aligned=a)

            ms = median_ms(kernel, args.repeats, flush)
            out.zero_()
            kernel()
            results[(name, aligned)] = (ms, out[:, 0].clone())
            kind = "aligned" if aligned else "unaligned"
            if name == "batch":
                rate = nbytes / ms / 1e6
                print(
                    f"  (b) kernel batch {kind:9s}{ms:9.3f} ms  {rate:7.0f} GB/s  "
                    f"{rate / copy_read:5.2f}x copy read"
                )
            else:
                us = ms * 1e3
                steady = back_to_back_ms(kernel, 50) * 1e3
                verdict = "meets" if us < REQUEST_TARGET_US else "MISSES"
                print(
                    f"  (c) kernel {args.request_tokens}-token request {kind}: {us:8.1f} us "
                    f"({request_bytes / us / 1e3:5.0f} GB/s; back to back {steady:6.1f} us)"
                    f"  {verdict} the {REQUEST_TARGET_US:.0f} us target"
                )
    for aligned in (True, False):
        kind = "aligned" if aligned else "unaligned"
        print(f"  {kind} variant: " + kernel_report(template, aligned))

    torch_small_ms = median_ms(lambda: torch_checksum(cache, *small_rows), 5, flush)
    torch_small = torch_checksum(cache, *small_rows)
    torch_big_ms = median_ms(lambda: torch_checksum(cache, *big_rows), 3, flush)
    torch_big = torch_checksum(cache, *big_rows)
    print(
        f"  (d) torch gather batch  {torch_big_ms:9.3f} ms  "
        f"{nbytes / torch_big_ms / 1e6:7.0f} GB/s  kernel is "
        f"{torch_big_ms / results[('batch', True)][0]:5.1f}x faster"
    )
    print(
        f"  (d) torch gather request {torch_small_ms * 1e3:8.1f} us  kernel is "
        f"{torch_small_ms / results[('request', True)][0]:5.1f}x faster"
    )

    seconds, library, library_strong = end_to_end(cache, order[:request_blocks].tolist())
    print(f"  (e) Checksummer.checksum of the request: {seconds * 1e3:.2f} ms wall")
    strong_checks = bench_strong(cache, results, (big_rows, small_rows), args, flush)
    strong_checks["library strong == CPU strong"] = np.array_equal(
        library_strong, cpu_strong(cache, order[:request_blocks].tolist())
    )

    checks = {
        f"{name} {'aligned' if aligned else 'unaligned'} == torch": torch.equal(
            values, torch_big if name == "batch" else torch_small
        )
        for (name, aligned), (_, values) in results.items()
    }
    checks["library == torch"] = torch.equal(library, torch_small.cpu())
    checks.update(strong_checks)
    for name, same in checks.items():
        print(f"  {'ok  ' if same else 'FAIL'} {name}")
    return all(checks.values())


def h2d_seconds(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` from a pinned host buffer to the GPU, 64 MiB at a time."""
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device=DEVICE)
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(max(1, nbytes // host.numel())):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def bench_dump(size_gib: float) -> bool:
    """(g) A dump checksummed on the GPU against the pinned host-to-device copy of its bytes
    and the CPU path; True when the GPU's record equals the CPU's."""
    sys.path.insert(0, str(REPO / "bench"))
    from llama_set import write_llama_set

    from kvaudit.checksum import checksum_dump_set
    from kvaudit.dumps import open_dump_set
    from kvaudit.formats import record_to_json

    folder = tempfile.mkdtemp(prefix="kvaudit-gpu-dump-")
    try:
        nbytes = write_llama_set(folder, size_gib, 1)
        dump_set = open_dump_set([folder])

        def timed(device: str) -> tuple[float, dict]:
            runs = []
            for _ in range(3):
                started = time.perf_counter()
                record = checksum_dump_set(dump_set, device=device)
                runs.append(time.perf_counter() - started)
            return statistics.median(runs), record_to_json(record)

        checksum_dump_set(dump_set, device="cuda")  # compiles, and reads the file into the cache
        gpu_s, gpu = timed("cuda")
        cpu_s, cpu = timed("cpu")
        copy_s = h2d_seconds(nbytes)
        agree = gpu == cpu
        gib = nbytes / (1 << 30)
        print(
            f"\n(g) a {gib:.2f} GiB dump, --device cuda: {gpu_s:.3f} s "
            f"({nbytes / gpu_s / 1e9:.2f} GB/s, {gpu_s / copy_s:.2f}x a pinned host-to-device "
            f"copy of its bytes: {copy_s:.3f} s, {nbytes / copy_s / 1e9:.2f} GB/s); the CPU "
            f"path on {os.cpu_count()} cores: {cpu_s:.3f} s ({nbytes / cpu_s / 1e9:.2f} GB/s); "
            f"records {'agree' if agree else 'DISAGREE'}",
            flush=True,
        )
        dump = dump_set.dumps[0]
        moved_s = statistics.median(movement_seconds(dump, "cuda") for _ in range(3))
        staged_s = statistics.median(movement_seconds(dump, "cpu") for _ in range(3))
        print(
            f"    its rows' movement alone (no checksums): to the GPU {moved_s:.3f} s, into "
            f"host buffers {staged_s:.3f} s"
        )
        for device in ("cuda", "cpu"):
            seconds = process_seconds(folder, device)
            print(f"    one whole process, kvaudit checksum --device {device}: {seconds:.2f} s")
        return agree
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def movement_seconds(dump: Dump, device: str) -> float:
    """Seconds to move every row of a dump as ``--device DEVICE`` stages it, batch by
    batch, with no checksums: on CUDA into pinned buffers and on to the GPU; on the CPU
    into the staging buffers alone (what the path costs before any kernel runs)."""
    from kvaudit.checksum import BATCH_BYTES
    from kvaudit.checksum.dump_staging import StagedBatches

    backend = "auto" if device == "cuda" else "torch"
    batches = StagedBatches(dump, device, backend, BATCH_BYTES)
    started = time.perf_counter()
    for first in range(0, dump.num_rows, batches.rows):
        count = min(batches.rows, dump.num_rows - first)
        batches.submit(first, count, [], lambda _: None)
    batches.drain()
    return time.perf_counter() - started


def process_seconds(folder: str, device: str) -> float:
    """The best of 2 whole ``kvaudit checksum --device DEVICE`` processes on a dump set
    (after one that fills Triton's cache): what a CI job that calls kvaudit pays."""
    command = [sys.executable, "-m", "kvaudit", "checksum", folder, "--device", device]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([*command, "--format", "json"], capture_output=True, env=env, check=True)
        runs.append(time.perf_counter() - started)
    return min(runs[1:])


def vllm_overhead(request_tokens: int) -> bool:
    """(h) The vLLM connector's per-step overhead, printed; True (it checks nothing)."""
    from vllm_overhead import measure_overhead, report

    overhead = measure_overhead(DEVICE, request_tokens)
    print("\n" + report(overhead, DEVICE, request_tokens), flush=True)
    return True


def sglang_inline(request_tokens: int) -> bool:
    """(i) The SGLang inline check's cost for one request, printed; True if (a) repeats."""
    from sglang_inline import measure, report

    result = measure(DEVICE, request_tokens, tp=2, page_size=16)
    print("\n" + report(result, DEVICE, request_tokens, 2, 16), flush=True)
    return bool(result["agree"])


def stage(name: str, run: Callable[[], bool]) -> bool:
    """Runs one part of the script; an exception there is printed and counts as a failed
    check, and the parts after it still run (the script is often run once, on a lent GPU)."""
    try:
        return run()
    except Exception:
        print(f"\n{name}: FAILED with an exception", flush=True)
        traceback.print_exc(file=sys.stdout)
        sys.stdout.flush()
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536, help="large batch, in tokens")
    parser.add_argument("--request-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layouts", default="NKTHD,NKHTD")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--dump-gib", type=float, default=2.0, help="dump size for (g)")
    parser.add_argument("--skip-dump", action="store_true", help="leave out (g)")
    parser.add_argument("--skip-live", action="store_true", help="leave out the live agents")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("bench/gpu.py: needs a CUDA GPU, and torch sees none", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    import triton

    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
        flush=True,
    )
    started = time.perf_counter()
    ok = True
    if not args.skip_tests:
        ok = stage("tests", run_tests) and ok

    generator = torch.Generator().manual_seed(0)
    blocks = args.tokens // BLOCK
    order = torch.randperm(blocks, generator=generator).to(DEVICE)
    flush = torch.empty(1 << 29, dtype=torch.uint8, device=DEVICE)
    for layout in args.layouts.split(","):

        def measure_layout(layout: str = layout) -> bool:
            cache = make_cache(layout, blocks, generator)
            try:
                return bench_layout(cache, order, args, flush)
            finally:
                del cache
                torch.cuda.empty_cache()

        ok = stage(layout, measure_layout) and ok
    if not args.skip_dump:
        ok = stage("dump", lambda: bench_dump(args.dump_gib)) and ok
    ok = stage("vLLM overhead", lambda: vllm_overhead(args.request_tokens)) and ok
    ok = stage("SGLang inline", lambda: sglang_inline(args.request_tokens)) and ok
    if not args.skip_live:
        from live_gpu import check_live

        ok = stage("live", lambda: check_live(DEVICE)) and ok

    print(f"\n{time.perf_counter() - started:.0f} s in all")
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
