"""Which of kvaudit's modules and packages one comparison runs through, and which package
calls which: a measure of how far a change to a verb reaches (docs/architecture.md).

    python scripts/crossings.py [--repo PATH]

The example's producer and broken consumer (examples/make_example.py, written to a
temporary folder) are compared twice, in one process each: by checksums
(``diff_sources``, what ``kvaudit diff`` runs) and by value (``numeric_sources``,
``kvaudit diff --numeric``). A profiler hook (``sys.setprofile``) notes every Python
function that runs under ``kvaudit/`` during the comparison alone (the sources are
opened before it), and each call whose caller sits in another package. A call into a package
on a higher line of docs/architecture.md's layer picture is counted as upward (a callback
or an import against the layers). ``--repo`` runs
the same measure on another checkout (a worktree of an older commit, with its C
extensions built in place) for a before-and-after in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_MEASURE = r"""
import json, sys
from pathlib import Path

package_root = Path(sys.argv[1]).resolve() / "kvaudit"
verb, producer, consumer = sys.argv[2:5]

from kvaudit.sources import open_source

producer_source = open_source([producer])
consumer_source = open_source([consumer])
if verb == "diff":
    from kvaudit.compare import diff_sources as compare
else:
    from kvaudit.numeric import numeric_sources as compare


def module_of(filename):
    path = Path(filename)
    if not path.is_absolute() or package_root not in path.parents:
        return None
    parts = path.relative_to(package_root).with_suffix("").parts
    return ".".join(part for part in parts if part != "__init__")


modules = {}
ran = set()
edges = {}


def profile(frame, event, arg):
    if event != "call":
        return
    callee = modules.get(frame.f_code.co_filename, False)
    if callee is False:
        callee = modules[frame.f_code.co_filename] = module_of(frame.f_code.co_filename)
    if callee is None:
        return
    ran.add(callee)
    caller_frame = frame.f_back
    if caller_frame is None:
        return
    filename = caller_frame.f_code.co_filename
    caller = modules.get(filename, False)
    if caller is False:
        caller = modules[filename] = module_of(filename)
    if caller is not None:
        edges.setdefault(caller, set()).add(callee)


sys.setprofile(profile)
try:
    compare(producer_source, consumer_source)
finally:
    sys.setprofile(None)
print(json.dumps({"modules": sorted(ran), "edges": {k: sorted(v) for k, v in edges.items()}}))
"""


def layer_ranks() -> dict[str, int]:
    """Each package's layer in docs/architecture.md's picture (0 the bottom), by name."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    picture = text.split("\n## Layers\n", 1)[1].split("```", 2)[1].splitlines()[1:]
    lines = [line.split() for line in reversed(picture) if line.strip()]
    return {
        ("" if name == "kvaudit" else name): rank
        for rank, line in enumerate(lines)
        for name in line
    }


def package_of(module: str) -> str:
    """A module's package: its first dotted part (``""``: the ``kvaudit`` package itself)."""
    return module.split(".", 1)[0] if "." in module else ""


def measure(repo: Path, verb: str, example: Path) -> dict[str, object]:
    """One comparison's modules, packages and crossings, measured in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _MEASURE,
            str(repo),
            verb,
            str(example / "producer"),
            str(example / "consumer-broken"),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd=repo,
    )
    found = json.loads(done.stdout.splitlines()[-1])
    modules: list[str] = found["modules"]
    crossings = Counter(
        (package_of(caller), package_of(callee))
        for caller, callees in found["edges"].items()
        for callee in callees
        if package_of(caller) != package_of(callee)
    )
    ranks = layer_ranks()
    upward = [(a, b) for a, b in crossings if ranks.get(a, -1) < ranks.get(b, -1)]
    return {
        "modules": len(modules),
        "packages": sorted({package_of(module) for module in modules}),
        "package_crossings": sorted(f"{a or 'kvaudit'} -> {b or 'kvaudit'}" for a, b in crossings),
        "upward": sorted(f"{a or 'kvaudit'} -> {b or 'kvaudit'}" for a, b in upward),
    }


def main(argv: list[str] | None = None) -> int:
    """Measure both comparisons in this checkout (and in ``--repo``), print them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, help="another checkout, measured the same way")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        example = Path(folder) / "example"
        subprocess.run(
            [sys.executable, str(ROOT / "examples" / "make_example.py"), str(example)],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        repos = {"this checkout": ROOT}
        if args.repo is not None:
            repos["--repo"] = args.repo.resolve()
        result = {
            name: {verb: measure(repo, verb, example) for verb in ("diff", "numeric")}
            for name, repo in repos.items()
        }
    for name, verbs in result.items():
        for verb, found in verbs.items():
            packages = found["packages"]
            print(
                f"{name}: {verb}: {found['modules']} modules in {len(packages)} packages, "
                f"{len(found['package_crossings'])} package-to-package call edges, "
                f"{len(found['upward'])} of them upward in docs/architecture.md's layers"
            )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
