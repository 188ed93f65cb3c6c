"""Commands that compute nothing, and checksums of dumps on the CPU, never import torch
or Triton: their start-up stays that of numpy (issue 10). Each command runs in a fresh
interpreter, which then lists the modules it imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from dumped_sets import Sets

from kvaudit.cli import main

HEAVY = ("torch", "triton")

PROBE = """
import sys
from kvaudit.cli import main
try:
    main.main(sys.argv[1:], prog_name="kvaudit", standalone_mode=False)
except SystemExit:
    pass
heavy = sorted(name for name in ("torch", "triton") if name in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


def imported_heavy(*args: object) -> list[str]:
    """The heavy modules a ``kvaudit`` command imported (it must also succeed)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *[str(arg) for arg in args]],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    line = [row for row in done.stdout.splitlines() if row.startswith("HEAVY=")][-1]
    return [name for name in line.removeprefix("HEAVY=").split(",") if name]


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


def test_inspect_imports_no_torch(sets: Sets, records: tuple[Path, Path]) -> None:
    assert imported_heavy("inspect", *sets.producer.paths) == []
    assert imported_heavy("inspect", records[0]) == []


def test_diff_and_verify_of_records_import_no_torch(records: tuple[Path, Path]) -> None:
    producer, consumer = records
    assert imported_heavy("diff", producer, consumer, "-q") == []
    assert imported_heavy("verify", consumer, "--against", producer, "-q") == []


def test_checksum_of_dumps_on_the_cpu_imports_no_torch(
    sets: Sets, records: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "record.json"
    args = ("checksum", *sets.consumer.paths, "--device", "cpu", "--format", "json", "-q")
    assert imported_heavy(*args, "-o", out) == []
    # The same record as the in-process run's.
    assert json.loads(out.read_text()) == json.loads(records[1].read_text())
