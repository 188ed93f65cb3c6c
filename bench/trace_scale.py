"""The trace and the checksum table at scale (issue 36): what each costs as it grows.

    python bench/trace_scale.py [--requests 250,500,1000] [--tokens 1048576]
                                [--positions 65536,200000] [--only blocks,run,table]
                                [--dir DIR]

Three scenarios, each timed in this process (the fastest of one run: the shapes are
chosen to take seconds, not to be precise to a few percent):

- ``blocks``: R requests of 64 tokens (4 blocks of 16; 2 layers of 2 KV heads, bf16,
  head size 4) in which every consumer block differs from the producer's (a few bytes
  of one token changed). ``kvaudit diff --format json`` of the two dump sets: its whole
  time and the trace's (``trace_report``), per R, and the trace's time per differing
  block; a trace whose cost is the product of the differing blocks and the producer's
  blocks doubles its time per block when R doubles.
- ``run``: one request of ``--tokens`` tokens whose every even token holds the same cells
  (in every slice); the consumer holds those cells at one odd token. No producer block
  holds that block, so the token is traced on its own, and it matches half the request's
  places. The diff's time, the trace's, the process's peak RSS (the KV built included)
  and the JSON's size, with the run's ``matches`` as the JSON gives it.
- ``table``: ``kvaudit checksum``'s table of one request of P positions (one replica key)
  printed to a file (plain, as ``-o`` and a pipe get it) and to a colour terminal, per P,
  against the record's JSON.

The dumps go to a fresh folder under DIR (default: the system's temporary directory),
removed at the end.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from helpers import kvbuild as kb  # noqa: E402

import kvaudit.compare.diff  # noqa: E402
from kvaudit.cli import main as cli  # noqa: E402

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
MODEL = kb.Model(
    (kb.GroupModel(0, tuple(kb.Attn(name, 2, 4) for name in LAYERS), block_size=16),),
    model_kv_heads=2,
)


def write_sides(
    folder: Path, producer: dict[str, kb.RequestKV], consumer: dict[str, kb.RequestKV]
) -> tuple[Path, Path]:
    """Both sides' dumps (one TP rank each, the same block tables)."""
    engine = kb.Engine(1, seed=3)
    sides = []
    for name, requests in (("producer", producer), ("consumer", consumer)):
        workers = kb.build_engine(MODEL, requests, engine)
        sides.append(kb.write_workers(workers, folder / name, name))
    return sides[0], sides[1]


def timed_diff(producer: Path, consumer: Path) -> tuple[float, float, dict, int]:
    """The diff's wall time, the trace's, the JSON report and its size in bytes."""
    spent = [0.0]
    trace = kvaudit.compare.diff.trace_report

    def timed_trace(*args: object, **kwargs: object) -> None:
        start = time.perf_counter()
        try:
            trace(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent[0] += time.perf_counter() - start

    kvaudit.compare.diff.trace_report = timed_trace  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        result = CliRunner().invoke(cli, ["diff", str(producer), str(consumer), "--format", "json"])
        total = time.perf_counter() - start
    finally:
        kvaudit.compare.diff.trace_report = trace
    if result.exit_code != 1:
        sys.exit(f"diff ended {result.exit_code}: {result.output[-2000:]}")
    return total, spent[0], json.loads(result.output), len(result.output.encode())


def blocks(folder: Path, counts: list[int]) -> None:
    """Every consumer block of R requests differs: the diff's and the trace's time."""
    print("blocks: every block of R requests (4 blocks each) differs")
    print(f"{'R':>6} {'differing':>9} {'diff s':>8} {'trace s':>8} {'trace ms/block':>15}")
    for count in counts:
        producer = {f"req-{k}": kb.make_request(MODEL, 64, seed=k) for k in range(count)}
        consumer = copy.deepcopy(producer)
        for request in consumer.values():
            for block in range(4):
                cells = request.data[LAYERS[0]]
                assert isinstance(cells, np.ndarray)
                cells[block * 16 + 3, 0, :4] ^= np.uint8(0x5A)
        where = folder / f"blocks-{count}"
        total, trace, report, _ = timed_diff(*write_sides(where, producer, consumer))
        differing = sum(
            len(group["mismatched_positions"])
            for request in report["requests"].values()
            for group in request["groups"].values()
        )
        per_block = 1000 * trace / max(differing, 1)
        print(f"{count:>6} {differing:>9} {total:>8.2f} {trace:>8.2f} {per_block:>15.3f}")
        shutil.rmtree(where)


def run(folder: Path, tokens: int) -> None:
    """One token matching half of a long request's places."""
    print(f"run: one changed token of a {tokens}-token request matches every even token")
    request = kb.make_request(MODEL, tokens, seed=5)
    for name in LAYERS:
        cells = request.data[name]
        assert isinstance(cells, np.ndarray)
        cells[0::2] = cells[0]
    changed = copy.deepcopy(request)
    at = 16 * 5 + 7  # an odd token inside block 5
    for name in LAYERS:
        cells = changed.data[name]
        assert isinstance(cells, np.ndarray)
        cells[at] = cells[0]
    producer, consumer = write_sides(folder / "run", {"long": request}, {"long": changed})
    total, trace, report, size = timed_diff(producer, consumer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    runs = report["requests"]["long"]["groups"]["0"]["token_runs"]
    found = [(r["first"], r.get("matches", len(r["sources"])), len(r["sources"])) for r in runs]
    print(f"  diff {total:.2f} s, trace {trace:.2f} s, the process's peak RSS {peak:.0f} MiB")
    print(f"  JSON {size / 2**20:.2f} MiB; runs (first token, matches, sources listed): {found}")
    shutil.rmtree(folder / "run")


def table(counts: list[int]) -> None:
    """``checksum``'s table of a long request: to a file, to a colour terminal, as JSON."""
    from kvaudit.formats import json_text, record_to_json
    from kvaudit.records import (
        GroupChecksums,
        RequestChecksums,
        WorkerInfo,
        WorkerRecord,
        combine_workers,
    )
    from kvaudit.report import print_record
    from kvaudit.report.text import SafeConsole

    print("table: checksum's table of one request of P positions (one replica key)")
    print(f"{'P':>8} {'file s':>8} {'terminal s':>11} {'JSON s':>8}")
    for count in counts:
        rng = np.random.default_rng(count)
        values = rng.integers(0, 2**63, (count, 1), dtype=np.uint64) * np.uint64(2)
        group = GroupChecksums(16, 0, [(1, 0)], values, 0xAB)
        worker = WorkerInfo(0, 1, 0, 1, "producer", "p", "rank0.safetensors")
        requests = {"req": RequestChecksums(count * 16, {0: group})}
        record = combine_workers([WorkerRecord(worker, "request", {0: 0xAB}, {}, requests)])
        plain = SafeConsole(file=io.StringIO(), width=160, color_system=None)
        terminal = SafeConsole(
            file=io.StringIO(), width=160, force_terminal=True, color_system="truecolor"
        )
        figures = [
            seconds(print_record, plain, record),
            seconds(print_record, terminal, record),
            seconds(lambda data: json_text(record_to_json(data)), record),
        ]
        print(f"{count:>8} {figures[0]:>8.2f} {figures[1]:>11.2f} {figures[2]:>8.2f}")


def seconds(work: Callable[..., object], *args: object) -> float:
    """The wall time of one call of ``work(*args)``."""
    start = time.perf_counter()
    work(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="250,500,1000")
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--positions", default="65536,200000")
    parser.add_argument("--only", default="blocks,run,table")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    only = set(args.only.split(","))
    folder = Path(tempfile.mkdtemp(prefix="kvaudit-trace-", dir=args.dir))
    try:
        if "blocks" in only:
            blocks(folder, [int(n) for n in args.requests.split(",")])
        if "run" in only:
            run(folder, args.tokens)
        if "table" in only:
            table([int(n) for n in args.positions.split(",")])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
