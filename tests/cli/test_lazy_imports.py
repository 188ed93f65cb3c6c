"""Commands that compute nothing, and checksums of dumps on the CPU, never import torch
or Triton: their start-up stays that of numpy (issue 10). Nor do they import what only
other paths need: rich draws tables and progress bars on a terminal, YAML is parsed from a
description file, each source kind's module opens its own arguments, each format writes
its own output. Each command runs in a fresh interpreter (stdout and stderr pipes, not
terminals), which then lists the modules it imported."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.dumped_sets import Sets

from kvaudit.cli import main
from kvaudit.core import native

HEAVY = ("torch", "triton")
"""Never imported by the commands below."""
ELSEWHERE = (
    "rich",
    "yaml",
    "csv",
    "kvaudit.compare",
    "kvaudit.report",
    "kvaudit.description.loader",
    "kvaudit.formats.csv",
    "kvaudit.formats.junit",
    "kvaudit.sources.record_source",
    "kvaudit.sources.handle_source",
    "kvaudit.sources.socket_source",
    "kvaudit.sources.output_folder_source",
    "kvaudit.dumps.example_connector",
    "kvaudit.corrupt.result",
    "kvaudit.checksum.dump_staging",
    "kvaudit.workers.inventory",
    "kvaudit.records.reading",
    "numpy.ma",
    "concurrent.futures",
    "logging",
)
"""What a checksum of dumps written as JSON does not need (dump files, not ExampleConnector
folders; batches read in place, never staged; a record written, not read back nor listed;
numpy.ma and concurrent.futures, which brings logging, cost start-up time)."""

PROBE = """
import json, sys
from kvaudit.cli import main
try:
    main.main(sys.argv[1:], prog_name="kvaudit", standalone_mode=False)
except SystemExit:
    pass
print("MODULES=" + json.dumps(sorted(sys.modules)))
"""


def imported(*args: object) -> set[str]:
    """The modules a ``kvaudit`` command imported (it must also succeed), without the
    variables that make rich take a pipe for a terminal."""
    environment = {
        k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *[str(arg) for arg in args]],
        capture_output=True,
        text=True,
        check=False,
        env=environment,
    )
    assert done.returncode == 0, done.stderr
    line = [row for row in done.stdout.splitlines() if row.startswith("MODULES=")][-1]
    return set(json.loads(line.removeprefix("MODULES=")))


def imported_heavy(*args: object) -> list[str]:
    """The heavy modules a ``kvaudit`` command imported (it must also succeed)."""
    return sorted(set(HEAVY) & imported(*args))


def among(modules: set[str], names: tuple[str, ...]) -> list[str]:
    """The ``names`` (modules or packages) of which ``modules`` holds any."""
    return [n for n in names if any(m == n or m.startswith(n + ".") for m in modules)]


@pytest.fixture(scope="module")
def records(sets: Sets, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("records")
    paths = (folder / "producer.json", folder / "consumer.json")
    for dumped, path in zip((sets.producer, sets.consumer), paths, strict=True):
        result = CliRunner().invoke(
            main, ["checksum", *dumped.paths, "--format", "json", "-o", str(path), "-q"]
        )
        assert result.exit_code == 0, result.output
        assert json.loads(path.read_text())["requests"]
    return paths


def test_help_imports_no_torch() -> None:
    assert imported_heavy("--help") == []


def test_help_imports_click_and_little_else() -> None:
    modules = imported("--help")
    assert "click" in modules
    assert among(modules, ("numpy", "safetensors", *ELSEWHERE, "kvaudit.sources")) == []
    assert among(modules, ("kvaudit.formats", "kvaudit.dumps", "kvaudit.records")) == []


NATIVE = ("kvaudit.core.native", "kvaudit._native._row_sums")
"""The C extensions' loader and the checksum's C loop: loaded only by a path that
checksums."""


def test_commands_that_compute_nothing_load_no_c_extension(
    sets: Sets, records: tuple[Path, Path]
) -> None:
    producer, consumer = records
    for args in (
        ("--help",),
        ("inspect", *sets.producer.paths),
        ("diff", producer, consumer, "--format", "json", "-q"),
    ):
        assert among(imported(*args), NATIVE) == [], args


def test_inspect_imports_no_torch(sets: Sets, records: tuple[Path, Path]) -> None:
    assert imported_heavy("inspect", *sets.producer.paths) == []
    assert imported_heavy("inspect", records[0]) == []


def test_diff_and_verify_of_records_import_no_torch(records: tuple[Path, Path]) -> None:
    producer, consumer = records
    assert imported_heavy("diff", producer, consumer, "-q") == []
    assert imported_heavy("verify", consumer, "--against", producer, "-q") == []
    # As JSON, neither draws a table.
    for args in (("diff", producer, consumer), ("verify", consumer, "--against", producer)):
        modules = imported(*args, "--format", "json", "-q")
        assert among(modules, ("rich", "yaml", "xml", "kvaudit.formats.junit")) == []


def test_planting_and_locating_a_fault_in_dumps_on_the_cpu_import_no_torch(
    sets: Sets, tmp_path: Path
) -> None:
    consumer = [Path(path) for path in sets.consumer.paths]
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in consumer[1:]:
        (broken / path.name).symlink_to(path)
    plant = ("corrupt", consumer[0], "-o", broken / consumer[0].name, "--request", "req-a")
    plant += ("--group", "0", "--position", "1", "--mode", "flip", "--device", "cpu")
    assert imported_heavy(*plant) == []
    producer = Path(sets.producer.paths[0]).parent
    diff = ("diff", producer, broken, "--device", "cpu", "--format", "json", "-q")
    assert imported_heavy(*diff) == []
    # The diff did locate the fault (decoding the elements' values without torch).
    result = CliRunner().invoke(main, [str(arg) for arg in diff])
    assert result.exit_code == 1, result.output
    group = json.loads(result.stdout)["requests"]["req-a"]["groups"]["0"]
    assert group["mismatched_positions"] and group["located"]
    assert all(entry["max_abs_error"] > 0 for entry in group["located"])


def test_checksum_of_dumps_on_the_cpu_imports_no_torch(
    sets: Sets, records: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "record.json"
    args = ("checksum", *sets.consumer.paths, "--device", "cpu", "--format", "json", "-q")
    assert imported_heavy(*args, "-o", out) == []
    # The same record as the in-process run's.
    assert json.loads(out.read_text()) == json.loads(records[1].read_text())


def test_checksum_as_json_imports_only_what_it_writes(sets: Sets, tmp_path: Path) -> None:
    for quiet in ([], ["-q"]):  # the progress bar's stderr is a pipe: no rich either way
        args = ("checksum", *sets.consumer.paths, "--device", "cpu", "--format", "json")
        modules = imported(*args, *quiet, "-o", tmp_path / "record.json")
        assert among(modules, HEAVY + ELSEWHERE) == []
        assert among(modules, ("numpy", "kvaudit.formats.json", "kvaudit.sources.dump_source"))
        assert json.loads((tmp_path / "record.json").read_text())["requests"]


def test_each_path_imports_what_it_needs(
    sets: Sets, records: tuple[Path, Path], tmp_path: Path
) -> None:
    # The same probe sees the modules the other paths import (else the tests above would
    # pass vacuously).
    table = imported("checksum", *sets.consumer.paths, "--device", "cpu", "-q")
    assert among(table, ("rich", "kvaudit.report")) == ["rich", "kvaudit.report"]
    assert among(table, ("yaml",)) == []
    csv = imported("checksum", *sets.consumer.paths, "--device", "cpu", "--format", "csv", "-q")
    assert among(csv, ("kvaudit.formats.csv",)) == ["kvaudit.formats.csv"]
    # The checksum loads the C loop where it built and may run (test_native_kernel.py).
    loads = native.enabled() and importlib.util.find_spec("kvaudit._native._row_sums") is not None
    assert among(table, NATIVE) == list(NATIVE if loads else NATIVE[:1])
    record = imported("inspect", records[0], "--format", "json")
    assert among(record, ("kvaudit.sources.record_source",)) == ["kvaudit.sources.record_source"]
    assert among(record, ("kvaudit.sources.dump_source", "kvaudit.sources.socket_source")) == []
    description = tmp_path / "cache.yaml"  # JSON is YAML
    description.write_text(json.dumps(sets.consumer.workers[0].description))
    first = sets.consumer.paths[0]
    configured = imported("inspect", first, "-c", description, "--format", "json")
    assert among(configured, ("yaml",)) == ["yaml"]


BAR = """
import sys, time
from kvaudit.cli.progress import PROGRESS_DELAY_S, progress_bar
with progress_bar(1 << 30, "checksumming", enabled=True) as advance:
    time.sleep(PROGRESS_DELAY_S + 0.5)
    advance(1 << 29)
print("rich" in sys.modules)
"""


@pytest.mark.parametrize("forced", [False, True])
def test_the_progress_bar_imports_rich_only_where_it_may_show(forced: bool) -> None:
    # FORCE_COLOR makes rich take the stderr pipe for a terminal, where the bar shows.
    environment = {
        k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")
    }
    if forced:
        environment["FORCE_COLOR"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", BAR], capture_output=True, text=True, check=True, env=environment
    )
    assert done.stdout.strip() == str(forced)
    assert ("checksumming" in done.stderr) == forced
