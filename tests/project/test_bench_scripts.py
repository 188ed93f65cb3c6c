"""The benchmarks stay runnable: each script's ``--help`` works, and every name a script
imports from a sibling script (at module level or inside a function) exists there."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(path.stem for path in BENCH.glob("*.py"))
# Not run with --help: live_gpu exits early without CUDA, before parsing arguments, and
# llama_set is a module of helpers for the others.
NOT_COMMANDS = {"live_gpu", "llama_set"}


def _defined_names(module: str) -> set[str]:
    tree = ast.parse((BENCH / f"{module}.py").read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


@pytest.mark.parametrize("script", SCRIPTS)
def test_names_imported_from_sibling_scripts_exist(script: str) -> None:
    tree = ast.parse((BENCH / f"{script}.py").read_text())
    missing = [
        f"{node.module}.{alias.name} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in SCRIPTS
        for alias in node.names
        if alias.name not in _defined_names(node.module)
    ]
    assert not missing, f"bench/{script}.py imports names its siblings lack: {missing}"


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in NOT_COMMANDS])
def test_help_runs(script: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    done = subprocess.run(
        [sys.executable, str(BENCH / f"{script}.py"), "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
