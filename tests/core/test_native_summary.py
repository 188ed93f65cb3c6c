"""``kvaudit --version`` says which C loops run: each extension that setup.py builds, or
the numpy code where one did not build or ``KVAUDIT_NATIVE=0`` turns them off."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvaudit.cli import main
from kvaudit.core import native

SETUP = Path(__file__).resolve().parents[2] / "setup.py"


def built_by_setup() -> list[str]:
    """The extension modules setup.py lists, read from its text."""
    return re.findall(r'extension\(\s*"([\w.]+)"', SETUP.read_text())


def version_lines() -> list[str]:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def test_every_extension_of_setup_is_named() -> None:
    assert sorted(built_by_setup()) == sorted(native.EXTENSIONS)
    assert len(built_by_setup()) == 4


def test_version_names_the_loops_that_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.ENVIRONMENT, raising=False)
    first, loops = version_lines()
    assert first.startswith("kvaudit, version ")
    loaded = [n for n in built_by_setup() if importlib.util.find_spec(n) is not None]
    names = [native.EXTENSIONS[n] for n in loaded]
    if len(loaded) == len(native.EXTENSIONS):
        assert loops == "C loops: " + ", ".join(names)
    else:
        assert "numpy runs" in loops and all(name in loops for name in names)


def test_version_says_what_did_not_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.ENVIRONMENT, raising=False)
    monkeypatch.setattr(native, "_LOADED", {"kvaudit._native._value_reads": None})
    monkeypatch.setattr(native.importlib, "import_module", lambda name: object())
    _, loops = version_lines()
    assert loops == (
        "C loops: checksum, numeric errors, strong lane; not built (no C compiler at install?), "
        "numpy runs: numeric reads"
    )
    monkeypatch.setattr(native, "_LOADED", dict.fromkeys(native.EXTENSIONS))
    assert version_lines()[1].startswith("C loops: not built")


def test_version_says_when_they_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENVIRONMENT, "0")
    assert version_lines()[1] == "C loops: off (KVAUDIT_NATIVE=0), the numpy code runs"
