"""The cost of ``diff --numeric`` against checksumming both sides, in the same run.

    python bench/numeric.py [--size-gib 1.5] [--workers 2] [--dir DIR] [--repeats 3]

Writes a producer and a consumer dump set of SIZE GiB each (WORKERS TP ranks, Llama-shaped
layers: 16-token blocks, 8 KV heads x 128, bf16, NTHC; the consumer with other block ids
and other values, so every element differs: the comparison's slowest path), then, each in
a fresh process, checksums both sets and compares them by value (``numeric_sources``, what
``kvaudit diff --numeric`` runs). Prints both times, the ratio (target: at most 3) and each
child's peak RSS. The best of ``--repeats`` runs counts (shared machines are noisy). The
files go to a fresh folder under DIR (default: the system's temporary directory), removed
at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

BLOCK_SIZE, HEADS, CELL = 16, 8, 256  # bf16 cell: K and V rows of 128
BLOCK_BYTES = BLOCK_SIZE * HEADS * CELL * 2
LAYER_BYTES = 64 << 20
REQUESTS = 8
MIB = 1 << 20


def description(layers: int, num_blocks: int) -> dict:
    spec = {
        "type": "full_attention",
        "block_size": BLOCK_SIZE,
        "num_kv_heads": HEADS,
        "head_size": CELL // 2,
        "dtype": "bfloat16",
        "layout": "NTHC",
    }
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return {"kvaudit": 1, "num_blocks": num_blocks, "groups": [{"spec": spec, "layers": names}]}


def write_set(folder: str, size_gib: float, workers: int, role: str, seed: int) -> int:
    """One engine's dump set; returns its bytes. Layers are shifted views of one buffer."""
    import torch

    from kvaudit.checksummer import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.dumps import write_dump
    from kvaudit.records import WorkerInfo

    os.makedirs(folder)
    layers = max(1, int(size_gib * (1 << 30)) // workers // LAYER_BYTES)
    num_blocks = LAYER_BYTES // BLOCK_BYTES
    desc = parse_description(description(layers, num_blocks), "bench")
    generator = torch.Generator().manual_seed(seed)
    shift = 32
    # Normal values (no NaN or Inf): what a real cache holds.
    base = torch.randn(LAYER_BYTES // 2 + layers * shift, generator=generator)
    base = base.to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    per_request = num_blocks // REQUESTS
    requests = {
        f"req-{i}": RequestBlocks(
            per_request * BLOCK_SIZE - 5, {0: (0, order[i * per_request : (i + 1) * per_request])}
        )
        for i in range(REQUESTS)
    }
    for rank in range(workers):
        tensors = {
            f"model.layers.{i}.self_attn.attn": base[
                (i + rank) * shift : (i + rank) * shift + LAYER_BYTES // 2
            ].view(num_blocks, BLOCK_SIZE, HEADS, CELL)
            for i in range(layers)
        }
        write_dump(
            os.path.join(folder, f"rank{rank}.safetensors"),
            desc,
            tensors,
            requests,
            worker=WorkerInfo(rank, workers, 0, 1, role, "bench"),
        )
    return workers * layers * LAYER_BYTES


def child(mode: str, producer: str, consumer: str) -> None:
    """Checksum both sets, or compare them by value, in this process; print seconds and
    peak RSS as JSON."""
    from kvaudit.diffing import numeric_sources
    from kvaudit.sources import checksum_dump_set, open_source

    start = time.perf_counter()
    if mode == "checksum":
        from kvaudit.dumps import open_dump_set

        for folder in (producer, consumer):
            checksum_dump_set(open_dump_set([folder]))
        detail = {}
    else:
        report = numeric_sources(
            open_source([producer], None), open_source([consumer], None), rtol=0.01
        )
        detail = {"failed_slices": report.failed_slices}
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": peak, **detail}))


def run(*args: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *args]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; the best counts")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(*args.child)
        return
    folder = tempfile.mkdtemp(prefix="kvaudit-numeric-", dir=args.dir)
    try:
        producer, consumer = os.path.join(folder, "p"), os.path.join(folder, "c")
        nbytes = write_set(producer, args.size_gib, args.workers, "producer", 0)
        write_set(consumer, args.size_gib, args.workers, "consumer", 1)
        print(f"two dump sets of {nbytes / (1 << 30):.2f} GiB each in {folder}")
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            # Alternate the two so that both see the same machine load and page cache.
            for mode in ("checksum", "numeric"):
                report = run("--child", mode, producer, consumer)
                if mode not in best or report["seconds"] < best[mode]["seconds"]:
                    best[mode] = report
        checksum, numeric = best["checksum"], best["numeric"]
        ratio = numeric["seconds"] / checksum["seconds"]
        verdict = "ok" if ratio <= 3 else "OVER the 3x target"
        print(
            f"checksum both sides: {checksum['seconds']:.2f} s "
            f"({2 * nbytes / checksum['seconds'] / 1e9:.2f} GB/s), "
            f"peak RSS {checksum['peak_rss'] / MIB:.0f} MiB"
        )
        print(
            f"numeric diff:        {numeric['seconds']:.2f} s "
            f"({2 * nbytes / numeric['seconds'] / 1e9:.2f} GB/s), "
            f"peak RSS {numeric['peak_rss'] / MIB:.0f} MiB, "
            f"{numeric['failed_slices']} slices over rtol 0.01"
        )
        print(f"ratio numeric / checksum: {ratio:.2f} ({verdict}; best of {args.repeats})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
