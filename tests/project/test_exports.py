"""Each package names its public names once: one mapping of name to module (``_EXPORTS``,
imported on first use by ``core.lazy.lazy_exports``), whose keys are ``__all__``.

Every ``__init__.py`` that holds such a mapping is parsed: a name listed again (a
``TYPE_CHECKING`` import, a hand-written ``__all__``) would drift from the mapping as
names are added. Each name is then asked of the package, so that a mapping pointing at
the wrong module fails here rather than at a user's first use.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvaudit"


def _exporting() -> dict[str, Path]:
    """Every package whose ``__init__`` assigns ``_EXPORTS``, by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("__init__.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = [
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        ]
        if "_EXPORTS" in targets:
            name = ".".join(("kvaudit", *path.parent.relative_to(PACKAGE).parts))
            found[name] = path
    return found


EXPORTING = _exporting()


def _mentions(path: Path, name: str) -> int:
    """How often the code of ``path`` (not its docstrings) names ``name``: as a string,
    an imported name or a variable."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = tree.body[1:] if ast.get_docstring(tree) is not None else tree.body
    nodes = (sub for top in body for sub in ast.walk(top))
    return sum(_written(node) == name for node in nodes)


def _written(node: ast.AST) -> object:
    """The name a node writes: a string's value, an import's bound name, a variable."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.alias):
        return node.asname or node.name
    return node.id if isinstance(node, ast.Name) else None


def test_the_packages_are_found() -> None:
    # The parse finds the mappings (else the checks below would pass on nothing).
    assert {"kvaudit", "kvaudit.sources", "kvaudit.workers", "kvaudit.compare"} <= set(EXPORTING)


@pytest.mark.parametrize("package", sorted(EXPORTING))
def test_all_is_the_mapping(package: str) -> None:
    module = importlib.import_module(package)
    exports = module._EXPORTS
    own = {"__version__"} if package == "kvaudit" else set()
    assert sorted(module.__all__) == sorted({*exports, *own})
    assert len(module.__all__) == len(set(module.__all__))


@pytest.mark.parametrize("package", sorted(EXPORTING))
def test_each_name_is_written_once(package: str) -> None:
    # Only the mapping names it; a dict.fromkeys tuple counts as that one place.
    module = importlib.import_module(package)
    twice = [name for name in module._EXPORTS if _mentions(EXPORTING[package], name) != 1]
    assert twice == [], f"{package} names these more than once: {twice}"


ENGINES = {"kvaudit.integrations.sglang": "sglang.srt", "kvaudit.integrations.vllm": "vllm.config"}
"""Packages whose names import an engine: resolved where it is installed (the engines'
own test stages, scripts/test.sh), else skipped."""


@pytest.mark.parametrize("package", sorted(EXPORTING))
def test_each_name_resolves(package: str) -> None:
    if package in ENGINES:
        pytest.importorskip(ENGINES[package])
    module = importlib.import_module(package)
    for name, home in module._EXPORTS.items():
        value = getattr(module, name)
        source = importlib.import_module(home, package)
        # The name is its module's own, or the module itself (``"dump_source": ...``).
        assert value is source or value is getattr(source, name), (package, name)
