"""One process against several: ``kvaudit checksum`` of one dump set, then under torchrun.

    python bench/scale.py [--size-gib 1] [--workers 4] [--processes N] [--device cpu]
                          [--repeats 3] [--dir DIR]

Writes a dump set of SIZE GiB (WORKERS TP ranks of one engine, Llama-shaped layers:
16-token blocks, 8 KV heads x 128, bf16, NTHC), then times ``kvaudit checksum --format
json`` on it in one process and under ``torchrun --nproc-per-node N`` (N: one per GPU with
``--device cuda``, else 2), each run a fresh command, the fastest of ``--repeats`` counting.
Prints each run's wall time (torch's import and, for torchrun, the process group's start
included), its GB/s and the ratio; the records of both must be equal (``processes``
aside). The files go to a fresh folder under DIR (default: the system's temporary
directory), removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

BLOCK_SIZE, HEADS, CELL = 16, 8, 256  # bf16 cell: K and V rows of 128
BLOCK_BYTES = BLOCK_SIZE * HEADS * CELL * 2
LAYER_BYTES = 32 << 20
REQUESTS = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_set(folder: str, size_gib: float, workers: int) -> int:
    """Write the dump set (every layer a view of one random buffer); returns its bytes."""
    import torch

    from kvaudit.checksummer import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.dumps import write_dump
    from kvaudit.records import WorkerInfo

    layers = max(1, int(size_gib * (1 << 30)) // workers // LAYER_BYTES)
    num_blocks = LAYER_BYTES // BLOCK_BYTES
    spec = {
        "type": "full_attention",
        "block_size": BLOCK_SIZE,
        "num_kv_heads": HEADS,
        "head_size": CELL // 2,
        "dtype": "bfloat16",
        "layout": "NTHC",
    }
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    description = parse_description(
        {"kvaudit": 1, "num_blocks": num_blocks, "groups": [{"spec": spec, "layers": names}]},
        "bench",
    )
    generator = torch.Generator().manual_seed(0)
    shift = 32  # elements between the layers' views of the buffer
    base = torch.randint(
        -(2**15), 2**15, (LAYER_BYTES // 2 + (layers + workers) * shift,), dtype=torch.int16,
        generator=generator,
    ).view(torch.bfloat16)  # fmt: skip
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
            name: base[(i + rank) * shift : (i + rank) * shift + LAYER_BYTES // 2].view(
                num_blocks, BLOCK_SIZE, HEADS, CELL
            )
            for i, name in enumerate(names)
        }
        write_dump(
            os.path.join(folder, f"rank{rank}.safetensors"),
            description,
            tensors,
            requests,
            worker=WorkerInfo(rank, workers, 0, 1, "producer", "bench"),
        )
    return workers * layers * LAYER_BYTES


def timed(command: list[str], repeats: int) -> tuple[float, dict]:
    """The fastest wall time of ``command`` and the record it printed."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    best, record = float("inf"), {}
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        best, record = min(best, seconds), json.loads(done.stdout)
    record.pop("processes", None)
    return best, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    processes = args.processes
    if processes is None:
        import torch

        processes = torch.cuda.device_count() if args.device == "cuda" else 2
    folder = tempfile.mkdtemp(prefix="kvaudit-scale-", dir=args.dir)
    try:
        size = write_set(folder, args.size_gib, args.workers)
        kvaudit = ["-m", "kvaudit", "checksum", folder, "--format", "json", "-q"]
        kvaudit += ["--device", args.device]
        one, single = timed([sys.executable, *kvaudit], args.repeats)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        torchrun += ["--nproc-per-node", str(processes), *kvaudit]
        many, spread = timed(torchrun, args.repeats)
        for record in (single, spread):
            for worker in record["workers"]:
                worker.pop("source")
        if single != spread:
            sys.exit("the records of one process and of torchrun differ")
        gb = size / 1e9
        print(f"dump set: {gb:.2f} GB, {args.workers} workers, device {args.device}")
        print(f"1 process:   {one:6.2f} s  {gb / one:6.2f} GB/s")
        print(f"{processes} processes: {many:6.2f} s  {gb / many:6.2f} GB/s")
        print(f"ratio (1 process / {processes}): {one / many:.2f}x; records equal")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
