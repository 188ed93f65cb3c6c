"""CPU path throughput against baselines on the same bytes, in one run.

    python bench/cpu.py [--layers 8] [--blocks 1024] [--repeats 3] [--dump-mib 512]

Prints GB/s of: hashlib.sha256 (the issue's baseline), numpy's sum (about memory
bandwidth), and kvaudit's CPU backends on a Llama-shaped cache (8 KV heads, head size 128,
bf16, 16-token blocks) in two layouts, its blocks in random order (gathered) and in order
(read in place), with the ratios of kvaudit to each baseline. The backends: numpy (the
default) with its C loop (``kvaudit._native._row_sums``, where it built) and with its numpy
code (``KVAUDIT_NATIVE=0``), and torch.

With ``--dump-mib N`` it instead writes an N MiB dump of such a cache (bench/llama_set.py)
to a temporary folder and times ``checksum_dump_set`` on it in this process (the compute,
without the start-up of a ``kvaudit`` process), with the C loop and with the numpy code,
against ``b3sum`` and ``sha256sum`` on the same file, all from the page cache,
alternating, medians of ``--repeats``. Whole processes against file tools:
``bench/cli.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import time
from collections.abc import Callable, Iterator

import torch

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.core import native
from kvaudit.description import parse_description

C_LOOP = "kvaudit._native._row_sums"


def paths() -> dict[str, bool]:
    """The numpy backend's paths to time, by label: the C loop (where it built) and the
    numpy code."""
    built = importlib.util.find_spec(C_LOOP) is not None
    if not built:
        print(f"{C_LOOP} did not build (no C compiler?): the numpy code alone is timed")
    return {"C loop": True, "numpy code": False} if built else {"numpy code": False}


@contextlib.contextmanager
def numpy_path(c_loop: bool) -> Iterator[None]:
    """Launches made inside run the C loop or the numpy code (``KVAUDIT_NATIVE``)."""
    before = os.environ.get(native.ENVIRONMENT)
    os.environ[native.ENVIRONMENT] = "1" if c_loop else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[native.ENVIRONMENT]
        else:
            os.environ[native.ENVIRONMENT] = before


def checksum_dump(folder: str, c_loop: bool) -> None:
    """``checksum_dump_set`` of the dump in ``folder`` by the C loop or the numpy code."""
    from kvaudit.checksum import checksum_dump_set
    from kvaudit.dumps import open_dump_set

    with numpy_path(c_loop):
        checksum_dump_set(open_dump_set([folder]))


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def llama_description(layers: int, blocks: int, layout: str) -> dict:
    return {
        "kvaudit": 1,
        "num_blocks": blocks,
        "groups": [
            {
                "spec": {
                    "type": "full_attention",
                    "block_size": 16,
                    "num_kv_heads": 8,
                    "head_size": 128,
                    "dtype": "bfloat16",
                    "layout": layout,
                },
                "layers": [f"model.layers.{i}.self_attn.attn" for i in range(layers)],
            }
        ],
    }


def dump_figures(size_mib: int, repeats: int) -> None:
    """The in-process checksum of an ``size_mib`` MiB dump against file hashes."""
    import shutil
    import statistics
    import subprocess
    import tempfile

    from llama_set import write_llama_set

    folder = tempfile.mkdtemp(prefix="kvaudit-cpu-")
    try:
        nbytes = write_llama_set(folder, size_mib / 1024, 1)
        path = os.path.join(folder, "rank0.safetensors")
        tools = [tool for tool in ("b3sum", "sha256sum") if shutil.which(tool)]
        runs: dict[str, Callable[[], object]] = {
            **{
                f"kvaudit, {label}": lambda c_loop=c_loop: checksum_dump(folder, c_loop)
                for label, c_loop in paths().items()
            },
            **{
                tool: lambda tool=tool: subprocess.run([tool, path], stdout=subprocess.DEVNULL)
                for tool in tools
            },
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # into the page cache
        for repeat in range(repeats):
            for name in list(runs)[:: 1 if repeat % 2 == 0 else -1]:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"{nbytes / 2**20:.0f} MiB dump from the page cache, median of {repeats}, "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    for name, seconds in median.items():
        print(f"  {name:28s} {seconds:7.3f} s {nbytes / seconds / 1e9:6.2f} GB/s")
    for name, ours in median.items():
        if name.startswith("kvaudit"):
            ratios = ", ".join(f"{ours / median[tool]:.2f}x {tool}" for tool in tools)
            print(f"  {name}: {ratios or 'no file tool installed'} (of its time)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dump-mib", type=int, default=0, help="time a dump of this size instead (see above)"
    )
    args = parser.parse_args()
    if args.dump_mib:
        dump_figures(args.dump_mib, args.repeats)
        return

    generator = torch.Generator().manual_seed(0)
    shapes = {"NTHC": (args.blocks, 16, 8, 256), "KNTHD": (2, args.blocks, 16, 8, 128)}
    caches = {
        layout: {
            f"model.layers.{i}.self_attn.attn": torch.randint(
                -(2**15), 2**15, shape, dtype=torch.int16, generator=generator
            ).view(torch.bfloat16)
            for i in range(args.layers)
        }
        for layout, shape in shapes.items()
    }
    nbytes = sum(t.numel() * t.element_size() for t in caches["NTHC"].values())
    raw = b"".join(t.view(torch.uint8).numpy().tobytes() for t in caches["NTHC"].values())
    words = [t.view(torch.int64).numpy() for t in caches["NTHC"].values()]
    order = torch.randperm(args.blocks, generator=generator).tolist()
    requests = {"bench": RequestBlocks(args.blocks * 16, {0: (0, order)})}

    results = {
        "hashlib.sha256": best_seconds(lambda: hashlib.sha256(raw).digest(), args.repeats),
        "numpy sum": best_seconds(lambda: [w.sum() for w in words], args.repeats),
    }
    in_order = {"bench": RequestBlocks(args.blocks * 16, {0: (0, list(range(args.blocks)))})}
    backends = [(f"numpy ({label})", "numpy", c_loop) for label, c_loop in paths().items()]
    for name, backend, c_loop in [*backends, ("torch", "torch", False)]:
        for layout, tensors in caches.items():
            description = parse_description(
                llama_description(args.layers, args.blocks, layout), "bench"
            )
            with numpy_path(c_loop):  # the launches choose their path when made
                checksummer = Checksummer(description, tensors, backend=backend)
            results[f"kvaudit {name} {layout}"] = best_seconds(
                lambda c=checksummer: c.checksum(requests), args.repeats
            )
            results[f"kvaudit {name} {layout}, blocks in order"] = best_seconds(
                lambda c=checksummer: c.checksum(in_order), args.repeats
            )

    print(
        f"{nbytes / 2**20:.0f} MiB of KV ({args.layers} layers, {args.blocks} blocks of 16 "
        f"tokens, 8 heads x 128, bf16), {torch.get_num_threads()} torch threads, best of "
        f"{args.repeats}"
    )
    for name, seconds in results.items():
        print(f"  {name:52s} {nbytes / seconds / 1e9:7.2f} GB/s")
    for name, seconds in results.items():
        if name.startswith("kvaudit"):
            print(
                f"  ratio {name.removeprefix('kvaudit ')}: "
                f"{results['hashlib.sha256'] / seconds:.2f}x sha256, "
                f"{results['numpy sum'] / seconds:.2f}x numpy sum"
            )


if __name__ == "__main__":
    main()
