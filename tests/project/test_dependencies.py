"""kvaudit's runtime dependencies are what pyproject.toml declares: safetensors is the
tests' reference reader only (kvaudit reads and writes the format itself, in
``kvaudit/dumps/safetensors_io.py``), so no kvaudit module imports it and the CLI runs
where it is not installed."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_roots(path: Path) -> set[str]:
    """The top-level names a module imports (absolute imports only)."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _toml_list(text: str, key: str) -> list[str]:
    """The strings of a one-level TOML list ``key = [...]`` (tomllib is Python 3.11+)."""
    found = re.search(rf"^{key} = \[(.*?)\]", text, re.MULTILINE | re.DOTALL)
    assert found is not None, key
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", found.group(1)))


def test_safetensors_is_a_test_dependency_only() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    runtime = _toml_list(text, "dependencies")
    assert "torch>=2.4" in runtime  # the list was found
    assert not any(spec.startswith("safetensors") for spec in runtime)
    assert any(spec.startswith("safetensors") for spec in _toml_list(text, "test"))


def test_no_kvaudit_module_imports_safetensors() -> None:
    importers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "kvaudit").rglob("*.py"))
        if "safetensors" in _imported_roots(path)
    ]
    assert importers == []


def test_the_cli_writes_and_diffs_dumps_without_safetensors(tmp_path: Path) -> None:
    # A None entry in sys.modules makes any import of safetensors fail, as where it is not
    # installed; the whole CLI is imported (every verb's modules) before the diff runs.
    script = (
        "import sys\n"
        "sys.modules['safetensors'] = None\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from helpers.safety_dumps import make_dump\n"
        "from kvaudit.cli import main\n"
        f"a = make_dump(__import__('pathlib').Path({str(tmp_path / 'a.safetensors')!r}))\n"
        f"b = make_dump(__import__('pathlib').Path({str(tmp_path / 'b.safetensors')!r}), "
        "role='consumer')\n"
        "sys.exit(main(['diff', str(a), str(b)], standalone_mode=False))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
