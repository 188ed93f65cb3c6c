"""Peak memory and throughput of checksumming a dump set much larger than its batches.

    python bench/dump_memory.py [--size-gib 4] [--workers 2] [--dir DIR] [--cold]
                                [--repeats 3]

Writes a dump set of SIZE GiB (WORKERS TP ranks of one engine, Llama-shaped layers:
16-token blocks, 8 KV heads x 128, bf16, NTHC) with ``write_dump``, then checksums it in a
subprocess and reports that subprocess's peak RSS (target: under 512 MiB) and the
throughput, with the threads of the CPU path and whether it imported torch (it must not).
The writer never holds the data: every layer is a view, at its own offset, of one 64 MiB
random buffer. The checksum runs ``--repeats`` times,
each in a fresh process, and the fastest run counts (shared machines are noisy); ``--cold``
evicts the files from the page cache first and runs it once, reading from the disk. The
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

from llama_set import write_llama_set

# The parent process imports neither torch nor kvaudit: a child's peak RSS as the kernel
# reports it includes the RSS of the process it was started from.
MIB = 1 << 20


def evict(folder: str) -> None:
    """Drop the (synced, clean) dump files from the page cache."""
    for name in os.listdir(folder):
        descriptor = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def child(folder: str) -> None:
    """Checksum the set in this process and print what it took, as JSON."""
    from kvaudit.checksum import checksum_dump_set
    from kvaudit.checksum.kernels.numpy_cpu import THREADS
    from kvaudit.dumps import open_dump_set

    after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    done = 0

    def progress(n: int) -> None:
        nonlocal done
        done += n

    start = time.perf_counter()
    record = checksum_dump_set(open_dump_set([folder]), progress=progress)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "seconds": seconds,
                "bytes": done,
                "requests": len(record.requests),
                "rss_after_import": after_import,
                "threads": THREADS,
                "torch_imported": "torch" in sys.modules,
            }
        )
    )


def run(*args: str) -> dict:
    """Run this script with ``args`` in a child process; its JSON output."""
    command = [sys.executable, os.path.abspath(__file__), *args]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout)


def measure(folder: str, repeats: int) -> None:
    """Checksum the set in child processes, one per repeat; print the fastest one's report
    and the peak RSS of them all as JSON."""
    reports = [run("--child", folder) for _ in range(repeats)]
    report = min(reports, key=lambda item: item["seconds"])
    report["peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--cold", action="store_true", help="evict the files from the cache")
    parser.add_argument("--repeats", type=int, default=3, help="checksum runs; the best counts")
    parser.add_argument("--write", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write is not None:
        start = time.perf_counter()
        nbytes = write_llama_set(args.write, args.size_gib, args.workers)
        seconds = time.perf_counter() - start
        print(json.dumps({"bytes": nbytes, "seconds": seconds}))
        return
    if args.measure is not None:
        measure(args.measure, args.repeats)
        return
    if args.child is not None:
        child(args.child)
        return

    folder = tempfile.mkdtemp(prefix="kvaudit-bench-", dir=args.dir)
    try:
        written = run(
            "--write", folder, "--size-gib", str(args.size_gib), "--workers", str(args.workers)
        )
        nbytes, seconds = written["bytes"], written["seconds"]
        print(
            f"wrote {nbytes / (1 << 30):.2f} GiB in {args.workers} dumps to {folder}: "
            f"{seconds:.1f} s, {nbytes / seconds / 1e9:.2f} GB/s"
        )
        if args.cold:
            evict(folder)
        report = run("--measure", folder, "--repeats", str(1 if args.cold else args.repeats))
        peak, seconds = report["peak_rss"], report["seconds"]
        verdict = "ok" if peak < 512 * MIB else "OVER the 512 MiB target"
        cache = "evicted from the page cache" if args.cold else "in the page cache"
        print(
            f"checksummed {report['bytes'] / (1 << 30):.2f} GiB ({report['requests']} "
            f"requests, files {cache}) in {seconds:.1f} s (best run): "
            f"{report['bytes'] / seconds / 1e9:.2f} GB/s, {report['threads']} threads, torch "
            f"{'imported' if report['torch_imported'] else 'not imported'}"
        )
        print(
            f"checksum process peak RSS {peak / MIB:.0f} MiB ({verdict}); "
            f"{report['rss_after_import'] / MIB:.0f} MiB of it after importing kvaudit"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
