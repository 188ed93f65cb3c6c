"""How a ``kvaudit`` process ends (kvaudit.cli.exits.end_process): with the command's status,
all its output written, every exit handler run, and any thread that is not a daemon
waited for, though the interpreter's teardown of its modules is skipped; an interruption
near the end, or one a library turns into another error, still ends it with status 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.dumped_sets import Sets

from kvaudit.core import interrupts
from kvaudit.core.errors import Interrupted
from kvaudit.core.files import atomic_path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import atexit, os, signal, sys, threading, time, weakref
    marker = sys.argv[1]
    mode = sys.argv[2]

    def mark(text):
        with open(marker, "a") as file:
            file.write(text + "\\n")

    class Held:
        pass

    held = Held()
    atexit.register(mark, "atexit")
    weakref.finalize(held, mark, "finalize")
    if mode == "thread":
        def late():
            time.sleep(0.5)
            mark("thread")
        threading.Thread(target=late, daemon=False).start()
    if mode == "interrupted at exit":
        def interrupt_then_wait():
            mark("handler")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            mark("not interrupted")
        atexit.register(interrupt_then_wait)
    if mode == "interrupted import":
        from kvaudit.cli import main

        @main.command("probe")
        def probe():
            # What numpy does when Ctrl-C lands in its C import: an ImportError.
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            except KeyboardInterrupt:
                raise ImportError("numpy._core.multiarray failed to import") from None
    if mode == "interrupted in a finalizer":
        import click
        from kvaudit.cli import main
        from kvaudit.core.files import atomic_path
        from kvaudit.core.interrupts import _raise_interrupted  # what SIGTERM runs

        @main.command("probe")
        @click.argument("output")
        def probe(output):
            class Doomed:
                pass

            doomed = Doomed()
            # SIGTERM's handler run inside a finalizer, as a signal may land: Python only
            # prints what a finalizer raises, and the command runs on.
            weakref.finalize(doomed, _raise_interrupted, signal.SIGTERM, None)
            del doomed
            mark("ran-on")
            with atomic_path(output) as path:
                with open(path, "w") as file:
                    file.write("a result")
    if mode == "interrupted pool":
        from kvaudit.cli import main
        from kvaudit.checksum.kernels.numpy_cpu import shared_pool

        @main.command("probe")
        def probe():
            def work(index):
                if index == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)
                mark(f"ended-{index}")

            shared_pool().map(work, range(4))
            mark("returned")
    sys.argv = ["kvaudit", *sys.argv[3:]]
    from kvaudit.__main__ import run
    run()
    """
)


def probe(tmp_path: Path, mode: str, *args: object) -> tuple[subprocess.CompletedProcess, list]:
    """A ``kvaudit`` process with an exit handler, a finalizer and (mode ``thread``) a
    late thread that is not a daemon, each of which writes a line to a marker file."""
    marker = tmp_path / f"marker-{mode}"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(marker), mode, *[str(a) for a in args]],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = marker.read_text().split() if marker.exists() else []
    return done, lines


def test_output_is_whole_and_exit_handlers_run(sets: Sets, tmp_path: Path) -> None:
    done, lines = probe(tmp_path, "plain", "checksum", *sets.producer.paths, "--format", "json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["format"] == "kvaudit.record/1" and record["requests"]
    assert sorted(lines) == ["atexit", "finalize"]


def test_statuses_and_error_lines_stay(tmp_path: Path) -> None:
    done, lines = probe(tmp_path, "plain", "checksum", tmp_path / "missing.safetensors")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("kvaudit: error:") and "missing" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert sorted(lines) == ["atexit", "finalize"]
    done, _ = probe(tmp_path, "plain", "--help")
    assert done.returncode == 0 and "Usage: kvaudit" in done.stdout


def test_a_thread_that_is_not_a_daemon_is_waited_for(tmp_path: Path) -> None:
    done, lines = probe(tmp_path, "thread", "--help")
    assert done.returncode == 0, done.stderr
    assert "thread" in lines and "atexit" in lines


def test_a_reader_gone_before_the_end_keeps_the_status(sets: Sets, tmp_path: Path) -> None:
    command = (
        f"{sys.executable} -m kvaudit checksum {' '.join(map(str, sets.producer.paths))} "
        "--format json | true; exit ${PIPESTATUS[0]}"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_an_interruption_at_the_end_exits_130(tmp_path: Path) -> None:
    done, lines = probe(tmp_path, "interrupted at exit", "--help")
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert "handler" in lines and "not interrupted" not in lines
    assert "Traceback" not in done.stderr and "Usage: kvaudit" in done.stdout


def test_an_error_raised_by_an_interruption_is_no_bug(tmp_path: Path) -> None:
    done, _ = probe(tmp_path, "interrupted import", "probe")
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr == "kvaudit: interrupted\n"


def test_an_interruption_a_finalizer_swallowed_ends_the_command(tmp_path: Path) -> None:
    output = tmp_path / "out.txt"
    done, lines = probe(tmp_path, "interrupted in a finalizer", "probe", output)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr == "kvaudit: interrupted\n"  # no "Exception ignored", no traceback
    assert "ran-on" in lines
    assert sorted(os.listdir(tmp_path)) == ["marker-interrupted in a finalizer"]  # no output


def test_an_interruption_waits_for_the_threads_handed_work(tmp_path: Path) -> None:
    # The calls already handed to the CPU path's threads end before the command unwinds
    # (they may read a dump's mapping); the interruption is raised after them.
    done, lines = probe(tmp_path, "interrupted pool", "probe")
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr == "kvaudit: interrupted\n"
    assert {"ended-0", "ended-1", "ended-2", "ended-3"} <= set(lines)
    assert "returned" not in lines


def test_an_interruption_is_deferred_then_ends_with_its_command(tmp_path: Path) -> None:
    # Within a command: raised at once, or at the end of a section that defers it, and by
    # every later check (an output about to be committed). After the command, kvaudit as a
    # library carries on.
    with interrupts.interrupt_signals():
        with pytest.raises(Interrupted):
            interrupts._raise_interrupted(signal.SIGTERM, None)
        with pytest.raises(Interrupted), interrupts.deferred_interrupts():
            interrupts._raise_interrupted(signal.SIGHUP, None)  # deferred: no raise here
            reached = True
        assert reached
        with pytest.raises(KeyboardInterrupt), atomic_path(tmp_path / "out") as path:
            Path(path).write_text("a result")
        assert os.listdir(tmp_path) == []
    assert interrupts.interrupt_received()
    interrupts.check_interrupted()
    with atomic_path(tmp_path / "out") as path:
        Path(path).write_text("a result")
    assert (tmp_path / "out").read_text() == "a result"
