"""Hardening against signals and limits (issue 9): a write interrupted by SIGTERM, SIGHUP,
SIGINT or SIGKILL leaves the old file or the complete one and no temporary file (after
SIGKILL: once the next write into the directory has run); a dump truncated under the
reader is a one-line error; many dumps open at once hold no file descriptor each."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.safety_dumps import BLOCK_BYTES, make_dump

from kvaudit.checksum import checksum_dump_set
from kvaudit.core.errors import KvauditError
from kvaudit.core.files import atomic_path, remove_stale_temporaries
from kvaudit.dumps import open_dump_set

ROOT = Path(__file__).resolve().parents[2]
BIG_BLOCKS = (200 << 20) // BLOCK_BYTES
"""Blocks of a dump of about 200 MB."""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temporaries(folder: Path) -> list[str]:
    return [name for name in os.listdir(folder) if ".kvaudit-" in name and name.endswith(".tmp")]


def corrupt_command(source: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvaudit",
        "corrupt",
        str(source),
        "-o",
        str(out),
        "--request",
        "req-a",
        "--group",
        "0",
        "--position",
        str(BIG_BLOCKS - 1),
        "--mode",
        "zero",
        "-q",
    ]


def interrupted_write(source: Path, out: Path, number: int) -> subprocess.CompletedProcess:
    """Run ``corrupt -o out`` and send ``number`` as soon as its temporary file exists."""
    process = subprocess.Popen(
        corrupt_command(source, out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 300
        while not temporaries(out.parent) and process.poll() is None:
            assert time.monotonic() < deadline, "no temporary file appeared"
            time.sleep(0.002)
        process.send_signal(number)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.slow
def test_signals_during_corrupt_leave_old_or_complete_file(tmp_path: Path) -> None:
    source = make_dump(tmp_path / "big.safetensors", BIG_BLOCKS)
    outputs = tmp_path / "out"
    outputs.mkdir()
    out = outputs / "corrupted.safetensors"
    out.write_bytes(b"the old file")
    old = digest(out)
    complete = subprocess.run(
        corrupt_command(source, outputs / "complete.safetensors"),
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    assert complete.returncode == 0, complete.stderr
    new = digest(outputs / "complete.safetensors")
    landed = 0
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        result = interrupted_write(source, out, number)
        assert digest(out) in (old, new)
        assert temporaries(outputs) == []
        assert b"Traceback" not in result.stderr
        assert result.returncode in (0, 130), result.stderr
        landed += result.returncode == 130
        out.write_bytes(b"the old file")
    killed = interrupted_write(source, out, signal.SIGKILL)
    assert killed.returncode in (0, -signal.SIGKILL)
    assert digest(out) in (old, new)
    landed += killed.returncode == -signal.SIGKILL
    assert landed  # the signals came while the file was being written
    # The next write into the directory removes what the killed process left.
    with atomic_path(outputs / "next.txt") as temporary:
        Path(temporary).write_text("next")
    assert temporaries(outputs) == []


def test_stale_temporaries_of_dead_processes_only(tmp_path: Path) -> None:
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead = int(finished.stdout)
    stale = tmp_path / f".out.kvaudit-{dead}-0123456789ab.tmp"
    live = tmp_path / f".out.kvaudit-{os.getppid()}-0123456789ab.tmp"
    other = tmp_path / ".out.tmp"
    for path in (stale, live, other):
        path.write_text("x")
    assert remove_stale_temporaries(str(tmp_path)) == [str(stale)]
    assert live.exists() and other.exists()
    # Old enough, it is stale whatever its process.
    os.utime(live, (0, 0))
    assert remove_stale_temporaries(str(tmp_path)) == [str(live)]


def test_dump_truncated_after_opening_is_an_error(tmp_path: Path) -> None:
    path = make_dump(tmp_path / "d.safetensors", 64)
    dump_set = open_dump_set([path])
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(KvauditError, match="changed while reading"):
        checksum_dump_set(dump_set)


def test_sigbus_while_reading_is_one_line(tmp_path: Path) -> None:
    path = make_dump(tmp_path / "d.safetensors", 64)
    script = textwrap.dedent(
        f"""
        import os
        from kvaudit.dumps import open_dump
        from kvaudit.core.mapping import catch_bus_errors
        catch_bus_errors()
        dump = open_dump({str(path)!r})
        os.truncate({str(path)!r}, 4096)
        print(float(next(iter(dump.tensors.values())).float().sum()))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 2
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and "changed while reading" in lines[0], result.stderr


def test_many_open_dumps_hold_no_descriptors(tmp_path: Path) -> None:
    first = make_dump(tmp_path / "d0.safetensors", 1)
    count = 1500
    for number in range(1, count):
        os.link(first, tmp_path / f"d{number}.safetensors")
    script = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        from kvaudit.dumps import open_dump
        from kvaudit.checksum import checksum_dump_set
        from kvaudit.dumps import DumpSet
        dumps = [open_dump({str(tmp_path)!r} + f"/d{{n}}.safetensors") for n in range({count})]
        first = checksum_dump_set(DumpSet(dumps[:1], True))
        last = checksum_dump_set(DumpSet(dumps[-1:], True))
        values = [record.requests["req-a"].groups[0].values for record in (first, last)]
        print(len(dumps), len(last.requests), (values[0] == values[1]).all())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(count).encode(), b"1", b"True"]


POOL_UNDER_INTERRUPTIONS = textwrap.dedent(
    """
    import faulthandler, random, signal, time
    from kvaudit.checksum.kernels.numpy_cpu import shared_pool

    def interrupt(signum, frame):
        raise KeyboardInterrupt  # as Python's own Ctrl-C handler: kvaudit as a library

    signal.signal(signal.SIGALRM, interrupt)
    pool, rng, interrupted = shared_pool(), random.Random(7), 0
    faulthandler.dump_traceback_later(10, exit=True)  # a hang: its stacks, status 1
    end = time.monotonic() + 3
    while time.monotonic() < end:
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 2e-4))
                result = pool.map(lambda x: x + 1, range(4))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt:
            interrupted += 1
            continue
        assert result == [1, 2, 3, 4], result
    print(interrupted)
    """
)


def test_the_cpu_threads_survive_interruptions_at_any_moment() -> None:
    # An interruption may land anywhere in the thread pool's map, even inside the wait
    # for its calls: it must neither hang (as inside Event.wait it did) nor lose a result.
    done = subprocess.run(
        [sys.executable, "-c", POOL_UNDER_INTERRUPTIONS],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout) > 100  # the interruptions did land
