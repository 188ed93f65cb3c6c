"""The cost of ``diff --numeric`` against checksumming both sides, in the same run.

    python bench/numeric.py [--size-gib 1.5] [--workers 2] [--requests 8] [--dir DIR]
                            [--repeats 3]

Writes a producer and a consumer dump set of SIZE GiB each (WORKERS TP ranks, Llama-shaped
layers: 16-token blocks, 8 KV heads x 128, bf16, NTHC; the consumer with other block ids
and other values, so every element differs: the comparison's slowest path; REQUESTS
requests share the blocks, in a random order), then, each in a fresh process, checksums
both sets and compares them by value (``numeric_sources``, what
``kvaudit diff --numeric`` runs). Prints both times, the ratio (target: at most 3), each
child's CPU time and peak RSS (VmHWM) and the ratio of CPU times (other jobs on the machine
sway it less). The best of ``--repeats`` runs counts (shared machines are noisy). The
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

from llama_set import REQUESTS, write_llama_set

MIB = 1 << 20


def child(mode: str, producer: str, consumer: str) -> None:
    """Checksum both sets, or compare them by value, in this process; print seconds and
    peak RSS as JSON."""
    from kvaudit.checksum import checksum_dump_set
    from kvaudit.numeric import numeric_sources
    from kvaudit.sources import open_source

    start, cpu = time.perf_counter(), time.process_time()
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
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_rss": peak_rss(), **detail}))


def peak_rss() -> int:
    """This process's peak resident bytes: Linux's VmHWM (``ru_maxrss`` would count the
    parent's pages from before ``exec``, here the writer's), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(*args: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), *args]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help="requests sharing the blocks"
    )
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
        sides = (("producer", producer), ("consumer", consumer))
        for seed, (role, side) in enumerate(sides):
            os.makedirs(side)
            nbytes = write_llama_set(
                side,
                args.size_gib,
                args.workers,
                role=role,
                seed=seed,
                values="normal",
                requests=args.requests,
            )
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
        for label, run_of in (("checksum both sides", checksum), ("numeric diff:      ", numeric)):
            print(
                f"{label}: {run_of['seconds']:.2f} s "
                f"({2 * nbytes / run_of['seconds'] / 1e9:.2f} GB/s), "
                f"CPU {run_of['cpu']:.2f} s, peak RSS {run_of['peak_rss'] / MIB:.0f} MiB"
            )
        print(f"numeric: {numeric['failed_slices']} slices over rtol 0.01")
        print(f"ratio numeric / checksum: {ratio:.2f} ({verdict}; best of {args.repeats})")
        print(
            f"CPU time ratio: {numeric['cpu'] / checksum['cpu']:.2f} (less sensitive to other "
            f"jobs; load average {os.getloadavg()[0]:.1f})"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
