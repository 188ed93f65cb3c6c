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

from llama_set import write_llama_set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        size = write_llama_set(folder, args.size_gib, args.workers, layer_bytes=32 << 20)
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
