"""Hardening of the command line (issue 9): outputs never clobber what they replace or
the command's inputs, inputs that would block are refused, every failure ends in a
status of its own with one line, and nothing printed can drive the terminal."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from helpers.safety_dumps import description, make_dump

import kvaudit.report
from kvaudit.cli import main
from kvaudit.core.errors import ECHO_LIMIT, KvauditError, capped, one_line, printable
from kvaudit.core.files import atomic_path, check_input, check_output, output_place
from kvaudit.dumps import open_dump
from kvaudit.report.text import render_text

ROOT = Path(__file__).resolve().parents[2]


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def assert_error(result: Result, *fragments: str, status: int = 2) -> str:
    """One ``kvaudit: error:`` line on stderr holding every fragment, nothing on stdout."""
    assert result.exit_code == status, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvaudit: error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (rather than hang the suite) when the block blocks for ``seconds``."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dump(tmp_path_factory.mktemp("dump") / "rank0.safetensors")


def record_text(dump: Path) -> str:
    result = run("checksum", dump, "--format", "json")
    assert result.exit_code == 0, result.output
    return result.stdout


# Class 1: outputs.


def test_regular_output_is_replaced_whole(dump: Path, tmp_path: Path) -> None:
    out = tmp_path / "rec.json"
    out.write_text("old")
    assert run("checksum", dump, "--format", "json", "-o", out).exit_code == 0
    assert out.read_text() == record_text(dump)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]


def test_symlink_output_writes_its_target(dump: Path, tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert run("checksum", dump, "--format", "json", "-o", link).exit_code == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == record_text(dump)


def test_dangling_symlink_output_creates_its_target(dump: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "new.json")
    assert run("checksum", dump, "--format", "json", "-o", link).exit_code == 0
    assert link.is_symlink() and (tmp_path / "new.json").read_text() == record_text(dump)


def test_dev_null_is_written_in_place(dump: Path) -> None:
    before = os.stat("/dev/null")
    assert run("checksum", dump, "-o", "/dev/null").exit_code == 0
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


def test_fifo_output_is_written_in_place(dump: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    with deadline(60):
        result = run("checksum", dump, "--format", "json", "-o", fifo)
    reader.join(60)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert received == [record_text(dump).encode()]


def test_dev_stdout_output_goes_to_stdout(dump: Path) -> None:
    command = [sys.executable, "-m", "kvaudit", "checksum", str(dump), "--format", "json"]
    plain = subprocess.run(command, capture_output=True, timeout=300, cwd=ROOT)
    through = subprocess.run(
        [*command, "-o", "/dev/stdout"], capture_output=True, timeout=300, cwd=ROOT
    )
    assert plain.returncode == through.returncode == 0, through.stderr
    assert through.stdout == plain.stdout and json.loads(through.stdout)["requests"]


def test_output_place_kinds(tmp_path: Path) -> None:
    assert output_place("/dev/stdout").descriptor == 1
    assert output_place("/dev/fd/2").descriptor == 2
    assert output_place("/dev/null").in_place
    assert not output_place(tmp_path / "new").in_place
    with pytest.raises(KvauditError, match="is a directory"):
        output_place(tmp_path)


def test_two_outputs_naming_one_file_are_refused(dump: Path, tmp_path: Path) -> None:
    """Every command's writing options, two at a time on one file (by the same name, a
    hardlink, a symlink, another spelling): refused before any work, the file untouched."""
    target = tmp_path / "report"
    target.write_text("kept")
    hard, soft = tmp_path / "hard", tmp_path / "soft"
    os.link(target, hard)
    soft.symlink_to(target)
    record = tmp_path / "rec.json"
    record.write_text(record_text(dump))
    spellings = (target, hard, soft, tmp_path / "." / "report")
    cases = [
        ("diff", dump, dump, "--json", target, "--junit"),
        ("diff", dump, dump, "-o", target, "--json"),
        ("diff", dump, dump, "--junit", target, "--html"),
        ("verify", dump, "--against", record, "-o", target, "--junit"),
    ]
    for *command, first, same, second in cases:
        for other in spellings:
            line = assert_error(run(*command, first, same, second, other), "name the same file")
            assert f"{second} and {first} name the same file" in line
            assert target.read_text() == "kept"
    new = tmp_path / "new.json"
    assert_error(run("diff", dump, dump, "--json", new, "--junit", new), "--junit and --json")
    assert not new.exists()
    assert_error(run("diff", dump, dump, "--json", "/dev/stdout", "--junit", "/dev/fd/1"),
                 "name the same file")  # fmt: skip


def test_output_that_is_an_input_is_refused(dump: Path, tmp_path: Path) -> None:
    copy = tmp_path / "d.safetensors"
    copy.write_bytes(dump.read_bytes())
    hard = tmp_path / "hard.safetensors"
    os.link(copy, hard)
    soft = tmp_path / "soft.safetensors"
    soft.symlink_to(copy)
    original = copy.read_bytes()
    for output in (copy, hard, soft):
        assert_error(run("checksum", copy, "-o", output), "-o is one of the command's inputs")
    # A file of an input directory.
    assert_error(run("checksum", tmp_path, "-o", copy), "inputs")
    assert copy.read_bytes() == original
    # The saved record of verify, the consumer of diff, the description, corrupt's source.
    record = tmp_path / "rec.json"
    record.write_text(record_text(copy))
    saved = record.read_text()
    assert_error(run("verify", copy, "--against", record, "-o", record), "inputs")
    assert_error(run("diff", copy, record, "-o", record), "inputs")
    config = tmp_path / "cache.yaml"
    config.write_text(json.dumps(description(4)))
    assert_error(run("checksum", copy, "-c", config, "-o", config), "inputs")
    assert_error(
        run("corrupt", copy, "-o", hard, "--request", "req-a", "--group", 0, "--position", 0),
        "SOURCE itself",
    )
    assert record.read_text() == saved and copy.read_bytes() == original
    # A new file next to the inputs is fine.
    assert run("verify", copy, "--against", record, "-o", tmp_path / "v.txt").exit_code == 0


def test_empty_output_name_is_named(dump: Path) -> None:
    assert_error(run("checksum", dump, "-o", ""), "-o", "empty")
    assert_error(
        run("corrupt", dump, "-o", "", "--request", "req-a", "--group", 0, "--position", 0),
        "-o",
        "empty",
    )


def test_a_report_that_cannot_be_written_is_found_before_any_work(
    dump: Path, tmp_path: Path
) -> None:
    kept = tmp_path / "kept.json"
    kept.write_text("KEEP")
    missing = tmp_path / "no" / "such" / "x.xml"
    result = run("diff", dump, dump, "--json", kept, "--junit", missing)
    assert_error(result, "cannot write: its folder", "does not exist")
    assert kept.read_text() == "KEEP"
    with pytest.raises(KvauditError, match="does not exist"):
        check_output(missing, [], "--html")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("form", [["--format", "json"], [], ["--numeric"]])
def test_a_full_stdout_is_an_error_not_a_bug(dump: Path, form: list[str]) -> None:
    command = [sys.executable, "-m", "kvaudit", "diff", str(dump), str(dump), "-q", *form]
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "kvaudit: error: stdout: cannot write: No space left on device"
    )


def test_check_output_is_shared(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    inner = data / "x.safetensors"
    inner.write_bytes(b"x")
    with pytest.raises(KvauditError, match="--json is one of"):
        check_output(inner, [data], "--json")
    check_output(tmp_path / "other.json", [data], "--json")


# Class 3: inputs that would block.


@pytest.mark.parametrize(
    "role", ["dump", "config", "against", "in-directory", "live", "corrupt", "library"]
)
def test_fifo_inputs_are_refused_without_blocking(dump: Path, tmp_path: Path, role: str) -> None:
    fifo = tmp_path / "in.fifo"
    if role == "in-directory":
        folder = tmp_path / "set"
        folder.mkdir()
        (folder / "rank0.safetensors").write_bytes(dump.read_bytes())
        fifo = folder / "rank1.safetensors"
    os.mkfifo(fifo)
    args = {
        "dump": ["checksum", fifo],
        "config": ["checksum", dump, "-c", fifo],
        "against": ["verify", dump, "--against", fifo],
        "in-directory": ["inspect", tmp_path / "set"],
        "live": ["inspect", f"live:{fifo}"],
        "corrupt": ["corrupt", fifo, "-o", tmp_path / "out.safetensors", "--request", "r"],
        "library": [],
    }[role]
    with deadline(60):
        if role == "library":
            with pytest.raises(KvauditError, match="is a FIFO"):
                open_dump(fifo)
            return
        result = run(*args, "--group", "0", "--position", "0") if role == "corrupt" else run(*args)
    assert_error(result, "is a FIFO", fifo.name)


def test_check_input_kinds(tmp_path: Path) -> None:
    check_input(tmp_path, directory=True)
    with pytest.raises(KvauditError, match="is a directory"):
        check_input(tmp_path)
    with pytest.raises(KvauditError, match="is a character device"):
        check_input("/dev/zero")
    check_input(tmp_path / "missing")  # the reader names a missing file


# Class 4: statuses.


def test_internal_error_is_status_3_with_where(dump: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError("an unexpected type")

    monkeypatch.setattr(kvaudit.report, "print_record", broken)
    result = run("checksum", dump)
    line = result.stderr.strip()
    assert result.exit_code == 3
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert "internal error (a bug in kvaudit)" in line
    assert f"test_safety:{broken.__code__.co_firstlineno + 1}" in line
    assert "TypeError: an unexpected type" in line and "--debug" in line
    debug = run("--debug", "checksum", dump)
    assert debug.exit_code == 3
    assert "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.splitlines()[-1].startswith("kvaudit: internal error")


def test_interrupt_is_130_without_traceback(dump: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvaudit.report, "print_record", interrupted)
    result = run("checksum", dump)
    assert result.exit_code == 130
    assert "Traceback" not in result.stderr and "interrupted" in result.stderr


# Runs ``kvaudit --version`` with an import hook that holds the import of kvaudit.cli (the
# start-up the handlers of kvaudit.__main__ cover) until the test has signalled, so the
# signal always lands during start-up, however fast the machine is.
_HELD_START_UP = """
import runpy, sys, time
class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "kvaudit.cli":
            sys.meta_path.remove(self)
            sys.stderr.write("holding start-up\\n")
            sys.stderr.flush()
            time.sleep(120)
        return None
sys.meta_path.insert(0, Hold())
sys.argv = ["kvaudit", "--version"]
runpy.run_module("kvaudit", run_name="__main__")
"""


def test_ctrl_c_during_start_up_is_130() -> None:
    for number in (signal.SIGINT, signal.SIGTERM):
        process = subprocess.Popen(
            [sys.executable, "-c", _HELD_START_UP],
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
        )
        try:
            assert process.stderr is not None
            first = process.stderr.readline()
            assert first == b"holding start-up\n", first
            process.send_signal(number)
            _, rest = process.communicate(timeout=120)
        finally:
            process.kill()
        stderr = first + rest
        assert process.returncode == 130, stderr[-2000:]
        assert b"Traceback" not in stderr and b"kvaudit: interrupted" in stderr


def test_unprintable_text_never_crashes() -> None:
    assert printable("a\udcffb") == "a\\udcffb"
    line = one_line("x: \udcff\x1b]0;title\x07 bad")
    assert "\x1b" not in line and "\\x1b" in line and "\\udcff" in line
    line.encode("utf-8")  # no lone surrogate left


def test_surrogate_in_an_error_is_printed(tmp_path: Path) -> None:
    name = os.fsdecode(b"caf\xe9.safetensors")  # not UTF-8: a lone surrogate in Python
    result = subprocess.run(
        [sys.executable, "-m", "kvaudit", "checksum", str(tmp_path / name)],
        capture_output=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert b"Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


# Class 7: control characters and markup.


HOSTILE = "req\x1b]0;owned\x07\x1b[2J\x9b31m[bold red]x[/bold red]\x7f"


def test_control_characters_are_escaped_in_tables(dump: Path, tmp_path: Path) -> None:
    record = json.loads(record_text(dump))
    record["requests"] = {HOSTILE: record["requests"]["req-a"]}
    record["workers"][0]["engine"] = HOSTILE
    record["workers"][0]["source"] = HOSTILE
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(record))
    for command in ("inspect", "checksum"):
        result = run(command, path)
        assert result.exit_code == 0, result.output
        shown = result.stdout
        assert not any(c in shown for c in "\x1b\x07\x9b\x7f"), repr(shown)
        assert "\\x1b]0;owned" in shown and "[bold red]x[/bold red]" in shown
    out = tmp_path / "table.txt"
    assert run("checksum", path, "-o", out).exit_code == 0
    assert "\x1b" not in out.read_text() and "\\x1b" in out.read_text()
    # An error that echoes the id.
    line = assert_error(run("checksum", path, "--request", HOSTILE + "?"))
    assert "\x1b" not in line and "\\x1b" in line


def test_render_text_escapes_text_cells() -> None:
    from rich.table import Table
    from rich.text import Text

    def render(console: object) -> None:
        table = Table(title="t\x1b[2J")
        table.add_column("a")
        table.add_row(Text("v\x1b[31m"))
        console.print(table)  # type: ignore[attr-defined]

    text = render_text(render)
    assert "\x1b" not in text and text.count("\\x1b") == 2


# Class 8: long values.


def test_echoed_values_are_capped(dump: Path) -> None:
    long_id = "r" * 1_000_000
    line = assert_error(run("checksum", dump, "--request", long_id))
    assert len(line) < 1000 and "(1000002 characters)" in line  # the id, quoted
    assert capped("x" * ECHO_LIMIT) == "x" * ECHO_LIMIT
    assert len(one_line("a " * 1_000_000)) < 2100


# Class 10: live handles.


@pytest.mark.parametrize("where", ["call", "import"])
def test_live_handle_calling_system_exit_is_refused(tmp_path: Path, where: str) -> None:
    handle = tmp_path / "handle.py"
    body = "import sys\n"
    if where == "import":
        body += "sys.exit(0)\n"
    body += "def kvaudit_live():\n    sys.exit(0)\n"
    handle.write_text(body)
    assert_error(run("inspect", f"py:{handle}"), "SystemExit", "handle.py")


# Output writes and their temporary files.


def test_atomic_path_leaves_nothing_on_error(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as temporary:
        Path(temporary).write_text("half")
        raise RuntimeError("stop")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out"]
