"""How a command's processes run is one object chosen from the environment: one process
outside torchrun (nothing joined, every result written as it is), torchrun's runtime when
``WORLD_SIZE > 1`` (rank 0 writes, the JSON says how many processes computed it). The CLI
asks that object and never which one it runs under (the commands' own runs under torchrun
are in ``test_distributed``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvaudit.core.exit_status import ExitStatus
from kvaudit.distributed.processes import ONE_PROCESS, processes

CLI = Path(__file__).resolve().parents[2] / "kvaudit" / "cli"


def test_one_process_outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    runtime = processes()
    assert runtime is ONE_PROCESS
    assert runtime.writes
    data = {"requests": {}}
    assert runtime.stamp(data) == {"requests": {}}
    assert runtime.finish(["checksum", "x"], False, ExitStatus.MISMATCH, "a line") == (
        ExitStatus.MISMATCH,
        None,
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert processes() is ONE_PROCESS


@pytest.mark.parametrize(("rank", "writes"), [("0", True), ("1", False)])
def test_torchrun_under_several_processes(
    monkeypatch: pytest.MonkeyPatch, rank: str, writes: bool
) -> None:
    from kvaudit.distributed.torchrun import Torchrun

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", rank)
    runtime = processes()
    assert isinstance(runtime, Torchrun)
    assert processes() is runtime  # chosen once for the environment
    assert runtime.writes is writes
    assert runtime.stamp({"requests": {}}) == {"requests": {}, "processes": 3}


def _distributed_uses(path: Path) -> list[str]:
    """What a CLI module takes from ``kvaudit.distributed``: each imported module and
    name, and each call of ``spread``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distributed"):
            found += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "spread":
            found.append("spread()")
    return found


def test_the_cli_asks_the_runtime() -> None:
    # The commands ask processes() what differs; none tests for torchrun or reaches into
    # the torchrun runtime's modules.
    uses = {path.name: _distributed_uses(path) for path in sorted(CLI.glob("*.py"))}
    allowed = {"distributed.processes.processes", "distributed.Settled"}
    assert {use for found in uses.values() for use in found} == allowed, uses
