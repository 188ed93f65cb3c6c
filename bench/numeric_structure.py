"""What ``diff --numeric`` spends on the bitwise diff's side of its work, before and after it
stopped running the whole ``diff_sources`` (issue #39): the sides are now paired, checksummed
and their records compared (``paired_sides``, ``checksum_compare``), neither located nor
traced by checksums.

    python bench/numeric_structure.py [--repeats 7] [--dir DIR]

Writes the README's example (``examples/make_example.py``: a TP=2 producer, a TP=4 consumer
and a copy of it with one stale block, about 7 MiB a set) into a fresh folder under DIR
(default: the system's temporary directory), then times ``numeric_sources`` (what ``kvaudit
diff --numeric`` runs) on the intact pair and on the broken one, now and as before (the same
call with its structure step replaced by ``diff_sources(..., locate=False)``, the former
code), the two in turn, best of ``--repeats``. Prints each time and the ratio before/now.
The reports of both ways are checked equal.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _former_structure() -> tuple[Any, Any]:
    """Stand-ins for ``paired_sides`` and ``checksum_compare`` that run the whole bitwise
    diff, as ``numeric_sources`` did before."""
    from kvaudit.compare.diff import diff_sources

    def paired(producer: Any, consumer: Any, options: Any) -> Any:
        class Sides:
            def trimmed(self) -> tuple[Any, Any]:
                return producer, consumer

            def warnings(self) -> list[str]:
                return []

        return Sides()

    def compared(
        sides: Any, producer: Any, consumer: Any, options: Any, warnings: Any
    ) -> tuple[Any, None, None]:
        return diff_sources(producer, consumer, options, locate=False), None, None

    return paired, compared


def _run(producer: str, consumer: str, before: bool) -> tuple[float, Any]:
    import kvaudit.numeric.driver as driver
    from kvaudit.sources import open_source

    saved = driver.paired_sides, driver.checksum_compare
    if before:
        driver.paired_sides, driver.checksum_compare = _former_structure()
    try:
        start = time.perf_counter()
        report = driver.numeric_sources(open_source([producer]), open_source([consumer]))
        return time.perf_counter() - start, report
    finally:
        driver.paired_sides, driver.checksum_compare = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "examples"))
    from make_example import make_example

    from kvaudit.formats.numeric import numeric_to_json

    folder = Path(tempfile.mkdtemp(prefix="kvaudit-numeric-structure-", dir=args.dir))
    try:
        make_example(str(folder), 0)
        for name in ("consumer", "consumer-broken"):
            producer, consumer = str(folder / "producer"), str(folder / name)
            _run(producer, consumer, before=False)  # imports and caches warm
            times: dict[bool, list[float]] = {True: [], False: []}
            reports = {}
            for _ in range(args.repeats):
                for before in (True, False):
                    seconds, report = _run(producer, consumer, before)
                    times[before].append(seconds)
                    reports[before] = numeric_to_json(report)
            assert reports[True] == reports[False], "the reports differ"
            was, now = min(times[True]), min(times[False])
            print(
                f"producer vs {name}: before {was * 1000:.1f} ms, now {now * 1000:.1f} ms, "
                f"ratio before/now {was / now:.2f}"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
