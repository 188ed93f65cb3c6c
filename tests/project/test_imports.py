"""The package's imports flow one way: no package imports a package of a higher layer,
and no import cycle exists (docs/architecture.md).

The layers are the picture under docs/architecture.md's ``## Layers``, read from the
document itself, so that the two cannot disagree. Every module under ``kvaudit/`` is
parsed (not imported); its ``import`` and ``from`` statements anywhere in the file,
type-only ones (``if TYPE_CHECKING:``) included, are resolved to kvaudit modules. A new
package must be drawn in the picture.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvaudit"

DOC = PACKAGE.parent / "docs" / "architecture.md"


def doc_layers() -> list[list[str]]:
    """The package layers docs/architecture.md draws under ``## Layers``, from the bottom
    up: the first fenced block there, one line per layer, the top line first; ``kvaudit``
    is the package itself (its ``__init__``), written ``""`` here."""
    text = DOC.read_text(encoding="utf-8").split("\n## Layers\n", 1)[1]
    picture = text.split("```", 2)[1].splitlines()[1:]
    layers = [[entry if entry != "kvaudit" else "" for entry in line.split()] for line in picture]
    return [layer for layer in reversed(layers) if layer]


LAYERS = doc_layers()
"""From the bottom up; a module may import modules of its own layer or below. An entry
names a package (with every module in it unless a longer entry names it) or a module at
the package's root; ``""`` is the ``kvaudit`` package itself."""


def module_names() -> dict[str, Path]:
    """Every module of the package, by its name relative to ``kvaudit`` (``dumps.dump``;
    a package by its own name, ``dumps``; ``kvaudit`` itself as ``""``)."""
    result = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        result[".".join(parts)] = path
    return result


MODULES = module_names()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """The lines of ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(name: str) -> list[tuple[str, bool]]:
    """The kvaudit modules ``name`` imports, each with whether the import is type-only."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    typing_only = _type_checking_lines(tree)
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [
                alias.name.removeprefix("kvaudit").lstrip(".")
                for alias in node.names
                if alias.name == "kvaudit" or alias.name.startswith("kvaudit.")
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "kvaudit" or node.module.startswith("kvaudit.")):
                module = node.module.removeprefix("kvaudit").lstrip(".")
            else:
                continue
            # ``from . import record_source`` imports a module; ``from .x import y`` imports x.
            submodules = [f"{module}.{a.name}".lstrip(".") for a in node.names]
            targets = [sub for sub in submodules if sub in MODULES] or [module]
        for target in targets:
            assert target in MODULES, f"{name} imports {target!r}, which is not a module"
            found.append((target, node.lineno in typing_only))
    return found


def layer_of(name: str) -> int:
    """The layer of a module: that of the longest entry naming it or a package above it."""
    best = None
    for index, layer in enumerate(LAYERS):
        for entry in layer:
            named = name == entry or (entry != "" and name.startswith(entry + "."))
            if named and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    assert best is not None, f"kvaudit.{name} is in no layer of LAYERS; place it there"
    return best[1]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_upward_import(name: str) -> None:
    own = layer_of(name)
    upward = [target for target, _ in imports(name) if target != name and layer_of(target) > own]
    assert not upward, f"kvaudit.{name} (layer {own}) imports higher layers: {upward}"


def test_no_import_cycle() -> None:
    # Type-only imports run no code, so only the others can close a cycle.
    graph = {
        name: sorted({t for t, typing_only in imports(name) if not typing_only and t != name})
        for name in MODULES
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(f"kvaudit.{m}" for m in cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_checks_see_the_imports() -> None:
    # The parser resolves relative, package and absolute imports (else the tests above
    # would pass vacuously).
    assert ("workers", False) in imports("locate.cells")
    assert ("workers.protocol", False) in imports("sources.raw")
    assert ("workers", True) in imports("report.inventory")
    assert ("cli.checksum_command", False) in imports("cli")
    assert ("compare.model", False) in imports("formats.junit")
    assert ("cli.group", False) in imports("cli.diff_command")
    assert layer_of("dumps.dump") < layer_of("workers.protocol") < layer_of("checksum")
    assert layer_of("checksum.kernels.triton_kernel") == layer_of("checksum")
    assert layer_of("integrations.vllm.worker") > layer_of("live")
    assert layer_of("") == layer_of("cli") > layer_of("distributed")


def test_every_package_is_on_the_picture() -> None:
    # Each package (the engine integrations each one) is drawn by name, not only
    # reached through a longer or shorter entry: the picture shows where it stands.
    drawn = {entry for layer in LAYERS for entry in layer}
    packages = {name.split(".")[0] for name in MODULES if name} | {
        name for name in MODULES if name.startswith("integrations.") and _is_package(name)
    }
    assert sorted(packages - drawn) == [], "packages missing from the picture"
    assert "" in drawn


def test_the_picture_is_about_ten_layers() -> None:
    # Package-level layers, each package once: a module-by-module table would be no
    # picture a reader holds in mind.
    entries = [entry for layer in LAYERS for entry in layer]
    assert len(entries) == len(set(entries)), "a package is drawn twice"
    assert 8 <= len(LAYERS) <= 16


def test_dumps_are_file_io() -> None:
    # Reading and writing dumps never needs the checksummer, sources or anything above.
    for name in MODULES:
        if name == "dumps" or name.startswith("dumps."):
            targets = {target for target, _ in imports(name)}
            assert not any(t.split(".")[0] in ("sources", "checksum") for t in targets), name


def test_core_imports_no_other_package() -> None:
    # The foundations stand on nothing above them: every package may use them.
    for name in MODULES:
        if name == "core" or name.startswith("core."):
            targets = {target for target, _ in imports(name)}
            outside = {t for t in targets if t != "core" and not t.startswith("core.")}
            assert not outside, f"kvaudit.{name} imports {sorted(outside)}"


def map_bullets() -> dict[str, str]:
    """The text of each bullet of docs/architecture.md's module list, by its package's
    path (``checksum``, ``integrations/vllm``; ``""`` for the ``kvaudit/`` bullet)."""
    text = DOC.read_text(encoding="utf-8")
    listing = text.split("\nEvery module, by package:\n", 1)[1].split("\n## ", 1)[0]
    bullets = {}
    for item in re.split(r"\n(?=- `)", listing.strip()):
        label = re.match(r"- `([\w/]+)/`:", item)
        assert label is not None, f"a bullet names no package: {item[:60]!r}"
        path = label.group(1)
        bullets["" if path == "kvaudit" else path] = item
    return bullets


def test_every_module_is_on_the_map() -> None:
    # docs/architecture.md names every module and C file under its own package's bullet
    # (a subpackage's under the nearest bullet above it): a newcomer finds each there.
    bullets = map_bullets()
    absent = []
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")]:
        relative = path.relative_to(PACKAGE)
        if path.name == "__init__.py":
            continue
        folder = relative.parent.as_posix().removeprefix(".")
        while folder not in bullets:
            folder = folder.rpartition("/")[0]
        named = set(re.findall(r"`([\w./]+)`", bullets[folder]))
        words = {part for item in named for part in re.split(r"[./]", item)} | named
        if path.stem not in words and path.name not in words:
            absent.append(f"{relative} (bullet `{folder or 'kvaudit'}/`)")
    assert absent == [], f"not named under their package in docs/architecture.md: {absent}"
