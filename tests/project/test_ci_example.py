"""The CI example (examples/ci/) as copied: its workflow's shell steps, read from the YAML,
run with bash on dumps in the nested ``<case>/producer`` layout, with ``python`` and
``kvaudit`` on PATH; the pytest check it runs; and kvaudit installed from the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest
import yaml
from helpers.example_module import example

from kvaudit.core import native

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "examples" / "ci"
WORKFLOW = yaml.safe_load((CI / "kv-transfer.yml").read_text())
STEPS = {step.get("name"): step for step in WORKFLOW["jobs"]["kv-transfer"]["steps"]}
CHECK = "Check the KV with kvaudit"
REPORTS = "The diff reports in JUnit and JSON"
INSTALL = "Install"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two cases side by side, as a connector's test writes them: ``tp2-tp4/`` (producer,
    consumer, consumer-broken) and ``same/`` (producer, consumer: the producer's copy)."""
    root = tmp_path_factory.mktemp("kv-dumps")
    example.make_example(root / "tp2-tp4", seed=2)
    (root / "same").mkdir()
    shutil.copytree(root / "tp2-tp4" / "producer", root / "same" / "producer")
    shutil.copytree(root / "tp2-tp4" / "producer", root / "same" / "consumer")
    return root


def workspace(tmp_path: Path, dumps: Path) -> tuple[Path, dict[str, str]]:
    """A connector repository's checkout with the check copied where the workflow runs
    it, and the environment of its job: ``python`` and ``kvaudit`` on PATH."""
    (tmp_path / "tests" / "kv").mkdir(parents=True)
    shutil.copy(CI / "test_kv_transfer.py", tmp_path / "tests" / "kv" / "test_kv_transfer.py")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (("python", ""), ("kvaudit", " -m kvaudit")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}"{command} "$@"\n')
        shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "KVAUDIT_DUMPS": str(dumps),
    }
    return tmp_path, env


def run_step(name: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A step's ``run:`` block, run by bash as GitHub runs it."""
    command = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", STEPS[name]["run"]]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_no_step_hides_a_failure() -> None:
    for step in WORKFLOW["jobs"]["kv-transfer"]["steps"]:
        assert "|| true" not in step.get("run", ""), step.get("name")
    assert "kvaudit-reports/" in STEPS["Keep the dumps and reports"]["with"]["path"]


def test_the_check_and_the_reports_on_nested_cases(tmp_path: Path, dumps: Path) -> None:
    cwd, env = workspace(tmp_path, dumps)
    check = run_step(CHECK, cwd, env)
    assert check.returncode == 1, check.stdout + check.stderr  # consumer-broken differs
    suite = ET.parse(cwd / "kvaudit-junit.xml").getroot().find("testsuite")
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    failed = {name for name, case in cases.items() if case.find("failure") is not None}
    assert len(cases) == 4  # the dumps were found, and three consumers
    assert failed == {"test_consumer_holds_the_producers_kv[tp2-tp4/consumer-broken]"}

    reports = run_step(REPORTS, cwd, env)
    assert reports.returncode == 0, reports.stdout + reports.stderr
    assert "3 consumer(s) compared" in reports.stdout
    written = sorted(path.name for path in (cwd / "kvaudit-reports").iterdir())
    names = ["same_consumer", "tp2-tp4_consumer", "tp2-tp4_consumer-broken"]
    assert written == sorted(f"{name}.{form}" for name in names for form in ("json", "junit"))
    for name in names:
        report = json.loads((cwd / "kvaudit-reports" / f"{name}.json").read_text())
        assert report["ok"] is (name != "tp2-tp4_consumer-broken")
        junit = ET.parse(cwd / "kvaudit-reports" / f"{name}.junit").getroot()
        failures = sum(int(suite.get("failures", 0)) for suite in junit.iter("testsuite"))
        assert (failures > 0) is (name == "tp2-tp4_consumer-broken")


def test_a_report_that_cannot_be_written_fails_the_step(tmp_path: Path, dumps: Path) -> None:
    root = tmp_path / "dumps"
    shutil.copytree(dumps / "same" / "producer", root / "case" / "producer")
    bad = root / "case" / "consumer-bad"
    bad.mkdir()
    (bad / "rank0.safetensors").write_bytes(b"not a dump")
    cwd, env = workspace(tmp_path / "checkout", root)
    result = run_step(REPORTS, cwd, env)
    assert result.returncode != 0
    assert f"::error::no junit report of {bad} (kvaudit diff exited 2)" in result.stdout
    assert f"::error::no json report of {bad} (kvaudit diff exited 2)" in result.stdout


def test_no_dumps_fails_the_check_and_the_reports(tmp_path: Path) -> None:
    cwd, env = workspace(tmp_path, tmp_path / "nothing")
    check = run_step(CHECK, cwd, env)
    assert check.returncode == 1
    assert "no producer/consumer dump directories" in check.stdout
    reports = run_step(REPORTS, cwd, env)
    assert reports.returncode == 1
    assert "::error::no producer/consumer dump directories under" in reports.stdout


def test_install_takes_kvaudit_from_its_source(tmp_path: Path) -> None:
    """The install step runs pip on ``$KVAUDIT_SOURCE`` (with ``python`` recording what it
    is asked), refuses to run without it, and the repository builds as a package."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    for name in ("python", "kvaudit"):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    unset = run_step(INSTALL, tmp_path, {**env, "KVAUDIT_SOURCE": ""})
    assert unset.returncode == 1
    assert "::error::set the repository variable KVAUDIT_SOURCE" in unset.stdout
    assert not log.exists()
    done = run_step(INSTALL, tmp_path, {**env, "KVAUDIT_SOURCE": str(ROOT)})
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert f"python -m pip install {ROOT} pytest" in calls
    assert calls[-1] == "kvaudit --version"
    assert not any(call.endswith("install kvaudit pytest") for call in calls)


@pytest.mark.slow
def test_the_repository_builds_as_a_package(tmp_path: Path) -> None:
    """What ``pip install <path or git URL>`` builds from this repository: a wheel with the
    package, its ``kvaudit`` command and, where a C compiler is at hand, its C loops."""
    source = tmp_path / "kvaudit"  # a copy: building writes build/ and egg-info beside it
    shutil.copytree(
        ROOT / "kvaudit", source / "kvaudit", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "wheels"), str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "wheels").glob("kvaudit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvaudit/cli/__init__.py" in names and "kvaudit/cli/checksum_command.py" in names
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    assert "kvaudit = kvaudit.__main__:run" in zipfile.ZipFile(wheel).read(entry_points).decode()
    if os.environ.get("KVAUDIT_REQUIRE_NATIVE") == "1":  # CI: a compiler is there
        built = {name.split(".")[0].replace("/", ".") for name in names if name.endswith(".so")}
        assert built == set(native.EXTENSIONS)
