"""Whole ``kvaudit`` processes timed against the tools beside it (issues 10 and 28).

    python bench/cli.py [--repeats 7] [--dir DIR] [--skip-diff] [--skip-cold] [--drop-caches]
                        [--shapes a,b,c,d,e | none] [--gib 4] [--shapes-only]

Writes the dumps it needs (one block; 512 MiB; two 1.5 GiB sides unless ``--skip-diff``)
to a fresh folder under DIR (default: the system's temporary directory, removed at the
end), then times each pair of commands ``--repeats`` times, alternating their order, and
reports the medians and their ratio: every figure is relative to a peer timed in the same
run, so the load of a shared machine cancels out as far as it can. Peers that are not
installed (``b3sum``, ``xxhsum``, ``sha256sum``; ``apt-get install b3sum xxhash``) are
skipped with a note. Files are read from the page cache (each is read once first), except
for the cold figures: there each run first evicts the file from the page cache
(``posix_fadvise(DONTNEED)``, which needs no root; ``--drop-caches`` drops the whole page
cache instead where this process may), and the script says whether dropping the whole page
cache (``/proc/sys/vm/drop_caches``) is allowed here.

kvaudit's modules are byte-compiled first, as installing the package does: where
``PYTHONDONTWRITEBYTECODE`` is set, every run would otherwise compile them again.

The checksum figures time ``kvaudit checksum --format json`` (stdout to /dev/null); the
default table output is timed once more against ``b3sum``, for information, and so is the
numpy code that runs without the C extension (``KVAUDIT_NATIVE=0``), where it built, and
the floor any kvaudit process starts from (``python -c "import numpy, click"``).

Targets: ``kvaudit --help`` <= 2x ``python -c "import numpy"``; a one-block dump's checksum
<= 2.5x ``python -c "import numpy, safetensors"``; a 512 MiB dump's checksum >= 5x faster
than ``sha256sum``; a diff of two 1.5 GiB sides <= 1.3x checksumming both. Whole processes
are judged where the data sets the time: a 4 GiB dump set's checksum <= 1.2x
``b3sum --num-threads 2`` on the same files, warm page cache, over each shape of
``bench/shape_sets.py`` (``--shapes``, default all; ``--gib`` scales the sets to try it
quickly, the target then judges a smaller set than it is set for), one set written,
timed and removed at a time (a shape that does not fit the folder's free space is
skipped with a note); a table gives each shape's figures and PASS or FAIL. The 512 MiB
dump's checksum against ``b3sum`` (once <= 3x, goal 1.5x: retired, the start-up then
weighs as much as the data) is printed for information, with no target.
``--shapes-only`` times the shape table alone. Peak memory has its own script,
``bench/dump_memory.py``.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dump_memory import evict
from llama_set import write_llama_set
from shape_sets import SHAPES, Shape, describe, write_shape_set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
KVAUDIT = [PYTHON, "-m", "kvaudit"]
CHECKSUM = [*KVAUDIT, "checksum", "-q", "--device", "cpu", "--format", "json"]
"""The checksum command every checksum figure times (the record as JSON)."""
SHAPE_LIMIT = 1.2
"""A shape's checksum against ``b3sum --num-threads 2``: the most it may take."""


@dataclass
class Command:
    """A command line, and what to do before each timed run (outside the timing)."""

    label: str
    argv: Sequence[Sequence[str]]
    before: Callable[[], None] | None = None
    environment: dict[str, str] | None = None
    """Variables set for this command only."""


@dataclass
class Figure:
    """One target: a kvaudit command against a peer; ``inverse`` for "at least N times
    faster than the peer" (the ratio is then peer / kvaudit)."""

    name: str
    ours: Command
    peer: Command
    limit: float
    inverse: bool = False
    goal: float | None = None
    who: str = "kvaudit"
    """What ``ours`` is, in the printed line."""


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    variables = dict(os.environ)
    variables["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, variables.get("PYTHONPATH")]))
    variables.update(extra or {})
    return variables


def c_loop_built() -> bool:
    """Whether the checksum's C loop (``kvaudit._native._row_sums``) built, in a child that
    runs as the timed commands do."""
    probe = (
        "import importlib.util as u; print(u.find_spec('kvaudit._native._row_sums') is not None)"
    )
    done = subprocess.run(
        [PYTHON, "-c", probe], env=env(), capture_output=True, text=True, check=True
    )
    return done.stdout.strip() == "True"


def run_once(command: Command) -> float:
    """Seconds one run of the command's command lines took (run one after the other)."""
    if command.before is not None:
        command.before()
    start = time.perf_counter()
    for argv in command.argv:
        subprocess.run(
            argv,
            check=True,
            env=env(command.environment),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return time.perf_counter() - start


def medians(commands: Sequence[Command], repeats: int) -> list[float]:
    """The median seconds of each command over ``repeats`` rounds, the order of the
    commands alternating from round to round; one warm-up round first."""
    for command in commands:
        run_once(command)
    times: list[list[float]] = [[] for _ in commands]
    for round_ in range(repeats):
        order = list(range(len(commands)))
        if round_ % 2:
            order.reverse()
        for index in order:
            times[index].append(run_once(commands[index]))
    return [statistics.median(values) for values in times]


def report(figure: Figure, repeats: int) -> None:
    ours, peer = medians([figure.ours, figure.peer], repeats)
    ratio = peer / ours if figure.inverse else ours / peer
    how = "faster than" if figure.inverse else "the time of"
    head = (
        f"{figure.name}: {figure.who} {ours:.3f} s, {figure.peer.label} {peer:.3f} s: "
        f"{ratio:.2f}x {how} the peer"
    )
    if figure.limit == float("inf"):
        print(f"{head} (no target; for information)", flush=True)
        return
    relation = ">=" if figure.inverse else "<="
    met = ratio >= figure.limit if figure.inverse else ratio <= figure.limit
    verdict = "ok" if met else "MISSED"
    if met and figure.goal is not None and ratio > figure.goal:
        verdict = f"ok (goal {figure.goal}x not reached)"
    print(f"{head} (target {relation} {figure.limit}x): {verdict}", flush=True)


def peer(tool: str, *args: str) -> list[str] | None:
    path = shutil.which(tool)
    if path is None:
        print(f"{tool} is not installed: its figures are skipped (apt-get install b3sum xxhash)")
        return None
    return [path, *args]


def write_one_block(path: str) -> None:
    """A dump of one 16-token block of two Llama-shaped layers."""
    import torch

    from kvaudit.checksum.checksummer import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.dumps import write_dump
    from kvaudit.records import WorkerInfo

    spec = {
        "type": "full_attention",
        "block_size": 16,
        "num_kv_heads": 8,
        "head_size": 128,
        "dtype": "bfloat16",
        "layout": "NTHC",
    }
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    raw = {"kvaudit": 1, "num_blocks": 4, "groups": [{"spec": spec, "layers": layers}]}
    description = parse_description(raw, "bench")
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randint(
            -(2**15), 2**15, (4, 16, 8, 256), dtype=torch.int16, generator=generator
        ).view(torch.bfloat16)
        for name in layers
    }
    write_dump(
        path,
        description,
        tensors,
        {"req": RequestBlocks(16, {0: (0, [2])})},
        worker=WorkerInfo(0, 1, 0, 1, "producer", "bench"),
    )


def write_sized(folder: str, size_gib: float) -> str:
    """A one-worker dump of about ``size_gib``; its path."""
    os.makedirs(folder)
    write_llama_set(folder, size_gib, 1)
    return os.path.join(folder, "rank0.safetensors")


def warm(*paths: str) -> None:
    for path in paths:
        with open(path, "rb") as file:
            while file.read(64 << 20):
                pass


@dataclass
class ShapeFigure:
    """One shape's row of the table: the medians of both commands, or why it was not
    timed."""

    shape: Shape
    about: str
    ours: float | None = None
    peer: float | None = None
    skipped: str | None = None

    def row(self) -> list[str]:
        if self.ours is None or self.peer is None:
            return [self.shape.key, "-", "-", "-", f"<= {SHAPE_LIMIT}x", f"skipped: {self.skipped}"]
        ratio = self.ours / self.peer
        verdict = "PASS" if ratio <= SHAPE_LIMIT else "FAIL"
        return [
            self.shape.key,
            f"{self.ours:.3f}",
            f"{self.peer:.3f}",
            f"{ratio:.2f}x",
            f"<= {SHAPE_LIMIT}x",
            verdict,
        ]


def parse_shapes(text: str) -> list[Shape]:
    """The shapes ``--shapes`` names: keys separated by commas, ``all`` or ``none``."""
    if text == "all":
        return list(SHAPES.values())
    if text == "none":
        return []
    keys = [key.strip() for key in text.split(",") if key.strip()]
    unknown = [key for key in keys if key not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}: expected some of {sorted(SHAPES)}")
    return [SHAPES[key] for key in dict.fromkeys(keys)]


def free_bytes(folder: str) -> int:
    return shutil.disk_usage(folder).free


def time_shape(shape: Shape, folder: str, size_gib: float, repeats: int, b3sum: str) -> ShapeFigure:
    """Write the shape's set under ``folder``, time its checksum against
    ``b3sum --num-threads 2`` on the same files (warm), and remove it."""
    about = describe(shape, size_gib)
    figure = ShapeFigure(shape, about)
    needed = int(size_gib * (1 << 30) * 1.05) + (256 << 20)
    if free_bytes(folder) < needed:
        figure.skipped = f"{needed / 2**30:.1f} GiB needed, {free_bytes(folder) / 2**30:.1f} free"
        return figure
    where = os.path.join(folder, f"shape-{shape.key}")
    try:
        paths = write_shape_set(where, shape, size_gib)
        warm(*paths)
        ours = Command("checksum", [[*CHECKSUM, *paths]])
        peer = Command("b3sum --num-threads 2", [[b3sum, "--num-threads", "2", *paths]])
        figure.ours, figure.peer = medians([ours, peer], repeats)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return figure


def shape_table(shapes: Sequence[Shape], folder: str, size_gib: float, repeats: int) -> None:
    """Each shape's checksum against ``b3sum --num-threads 2``, a row at a time, then the
    whole table."""
    b3sum = shutil.which("b3sum")
    if b3sum is None:
        print("b3sum is not installed: the shape table is skipped (apt-get install b3sum)")
        return
    print(
        f"shapes of {size_gib:g} GiB: kvaudit checksum --format json against "
        f"b3sum --num-threads 2, warm page cache, medians of {repeats}",
        flush=True,
    )
    figures = []
    for shape in shapes:
        figure = time_shape(shape, folder, size_gib, repeats, b3sum)
        figures.append(figure)
        print(f"  ({shape.key}) {figure.about}: {' | '.join(figure.row()[1:])}", flush=True)
    header = ["shape", "kvaudit s", "b3sum s", "ratio", "target", "verdict"]
    rows = [header, *(figure.row() for figure in figures)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print(f"\n{size_gib:g} GiB dump sets, kvaudit checksum against b3sum --num-threads 2:")
    for figure in figures:
        print(f"  ({figure.shape.key}) {figure.about}")
    for row in rows:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    failed = [figure.shape.key for figure in figures if figure.row()[-1] == "FAIL"]
    print(
        f"shapes over {SHAPE_LIMIT}x: {', '.join(failed)}"
        if failed
        else "every shape timed passes",
        flush=True,
    )


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_caches_allowed() -> bool:
    """Whether this process may drop the whole page cache (asked without doing it)."""
    return os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    """Drop the whole page cache (every process's clean pages; needs root)."""
    os.sync()
    with open(DROP_CACHES, "w") as file:
        file.write("3\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per figure")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--skip-diff", action="store_true", help="no 2 x 1.5 GiB diff figure")
    parser.add_argument("--skip-cold", action="store_true", help="no cold-file figures")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="cold runs drop the whole page cache where allowed (default: evict the file only)",
    )
    parser.add_argument(
        "--shapes",
        default="all",
        help=f"the dump set shapes timed against b3sum: some of {','.join(SHAPES)}, all or none",
    )
    parser.add_argument(
        "--gib", type=float, default=4.0, help="each shape's set size in GiB (default 4)"
    )
    parser.add_argument("--shapes-only", action="store_true", help="time the shape table alone")
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes)
    folder = tempfile.mkdtemp(prefix="kvaudit-bench-cli-", dir=args.dir)
    try:
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
        print(f"writing under {folder}: {free_bytes(folder) / 2**30:.1f} GiB free", flush=True)
        compileall.compile_dir(os.path.join(ROOT, "kvaudit"), quiet=1)
        built = c_loop_built()
        print(
            "the checksum's C loop (kvaudit._native._row_sums) "
            + ("built" if built else "did not build: the numpy code runs"),
            flush=True,
        )
        if args.shapes_only:
            shape_table(shapes, folder, args.gib, args.repeats)
            return
        small = os.path.join(folder, "one-block.safetensors")
        write_one_block(small)
        big = write_sized(os.path.join(folder, "512mib"), 0.5)
        warm(small, big)
        # The record as JSON: a file tool prints one line, and rich's table of every
        # block position (1024 rows here) is timed on its own below.
        checksum = CHECKSUM
        table = [*KVAUDIT, "checksum", "-q", "--device", "cpu"]
        figures = [
            Figure(
                "kvaudit --help",
                Command("kvaudit --help", [[*KVAUDIT, "--help"]]),
                Command("import numpy", [[PYTHON, "-c", "import numpy"]]),
                2.0,
            ),
            Figure(
                "one-block dump",
                Command("checksum", [[*checksum, small]]),
                Command("import numpy, safetensors", [[PYTHON, "-c", "import numpy, safetensors"]]),
                2.5,
            ),
        ]
        b3sum = peer("b3sum", big)
        if b3sum is not None:
            figures.append(
                Figure(
                    "512 MiB dump",
                    Command("checksum", [[*checksum, big]]),
                    Command("b3sum", [b3sum]),
                    float("inf"),
                )
            )
        if b3sum is not None:
            # The floor of any Python command of kvaudit's dependencies: the interpreter's
            # start and the imports of numpy and click alone, against the same peer.
            figures.append(
                Figure(
                    "512 MiB dump, the floor (import numpy, click; no checksum)",
                    Command("import numpy, click", [[PYTHON, "-c", "import numpy, click"]]),
                    Command("b3sum", [b3sum]),
                    float("inf"),
                    who="import numpy, click",
                )
            )
            figures.append(
                Figure(
                    "512 MiB dump, the default table output",
                    Command("checksum", [[*table, big]]),
                    Command("b3sum", [b3sum]),
                    float("inf"),
                )
            )
        if b3sum is not None and built:
            figures.append(
                Figure(
                    "512 MiB dump, the numpy code (KVAUDIT_NATIVE=0)",
                    Command("checksum", [[*checksum, big]], environment={"KVAUDIT_NATIVE": "0"}),
                    Command("b3sum", [b3sum]),
                    float("inf"),
                )
            )
        xxhsum = peer("xxhsum", "-H3", big)
        if xxhsum is not None:
            figures.append(
                Figure(
                    "512 MiB dump",
                    Command("checksum", [[*checksum, big]]),
                    Command("xxhsum -H3", [xxhsum]),
                    float("inf"),
                )
            )
        sha256sum = peer("sha256sum", big)
        if sha256sum is not None:
            figures.append(
                Figure(
                    "512 MiB dump",
                    Command("checksum", [[*checksum, big]]),
                    Command("sha256sum", [sha256sum]),
                    5.0,
                    inverse=True,
                )
            )
        if not args.skip_diff:
            left = write_sized(os.path.join(folder, "left"), 1.5)
            right = write_sized(os.path.join(folder, "right"), 1.5)
            warm(left, right)
            figures.append(
                Figure(
                    "diff of two 1.5 GiB sides",
                    Command("diff", [[*KVAUDIT, "diff", "-q", "--device", "cpu", left, right]]),
                    Command("checksum of both", [[*checksum, left], [*checksum, right]]),
                    1.3,
                )
            )
        for figure in figures:
            report(figure, args.repeats)
        if not args.skip_cold:
            allowed = drop_caches_allowed()
            whole = args.drop_caches and allowed
            print(
                f"dropping the whole page cache ({DROP_CACHES}) is "
                + ("allowed here" if allowed else "not allowed here")
                + "; cold runs "
                + ("drop it" if whole else "evict the file itself with posix_fadvise(DONTNEED)"),
                flush=True,
            )
            folder_of_big = os.path.dirname(big)

            def cold_start() -> None:
                if whole:
                    drop_caches()
                else:
                    evict(folder_of_big)

            cold = [
                Figure(
                    "512 MiB dump, cold",
                    Command("checksum", [[*checksum, big]], cold_start),
                    Command(label, [argv], cold_start),
                    float("inf"),
                )
                for label, argv in (("b3sum", b3sum), ("sha256sum", sha256sum))
                if argv is not None
            ]
            for figure in cold:
                report(figure, max(3, args.repeats // 2))
        # The small sets go first: the shapes' sets want the folder's space one at a time.
        shutil.rmtree(os.path.dirname(big), ignore_errors=True)
        if not args.skip_diff:
            shutil.rmtree(os.path.join(folder, "left"), ignore_errors=True)
            shutil.rmtree(os.path.join(folder, "right"), ignore_errors=True)
        if shapes:
            shape_table(shapes, folder, args.gib, args.repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
