"""Output folders read as strictly as record files (``kvaudit.output_folders``):
every bad line, marker or file is one line naming the file and line with exit status 2,
never a traceback, a hang or exit 3; a torn line (a write cut short by a crash or a full
disk) is skipped with a warning and the rest of the folder read; the writer starts a new
line after a torn one, rotates ``checksums.jsonl`` and its dump budget counts what is on
disk. Folders are written by kvaudit's own writers (``helpers.output_folders``)."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import kvbuild as kb
from helpers import reference as ref
from helpers.output_folders import MODEL, TOKENS, write_folder

from kvaudit import output_folders as output
from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.output_folders import read_output
from kvaudit.records import WorkerInfo

WORKER = WorkerInfo(0, 1, 0, 1, "producer", "test producer")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A one-worker producer's folder: one line per request of ``TOKENS``."""
    write_folder(tmp_path / "out", "producer")
    return tmp_path / "out"


def lines_file(folder: Path) -> Path:
    return folder / "workers" / "pp0-tp0" / "checksums.jsonl"


def want_totals(rid: str) -> np.ndarray:
    """The request's per-position totals, from the reference implementation."""
    index = list(TOKENS).index(rid)
    group = kb.reference_group(MODEL, 0, kb.make_request(MODEL, TOKENS[rid], index, 1), 1)
    return ref.total(ref.block_checksums(group, TOKENS[rid]))


def assert_whole(folder: Path) -> None:
    """Every request of ``TOKENS`` is read back with the reference's totals."""
    record = read_output(folder).record
    assert sorted(record.requests) == sorted(TOKENS)
    for rid in TOKENS:
        np.testing.assert_array_equal(record.requests[rid].groups[0].totals(), want_totals(rid))


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def set_in(path: tuple, value: object) -> Callable[[dict], None]:
    def change(line: dict) -> None:
        target = line
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def drop(key: str) -> Callable[[dict], None]:
    return lambda line: line.pop(key)


# Each change to the second line, and a word of the one-line error it gives.
CHANGES = [
    (
        "block size 0",
        set_in(("groups", "0", "block_size"), 0),
        "block_size: expected an integer from 1",
    ),
    ("start -5", set_in(("groups", "0", "start"), -5), "start: expected an integer from 0"),
    (
        "start past the tokens",
        set_in(("groups", "0", "start"), 9),
        "beyond the request's 20 tokens",
    ),
    ("num_tokens -1", set_in(("num_tokens",), -1), "num_tokens: expected an integer from 0"),
    ("num_tokens 10.7", set_in(("num_tokens",), 10.7), "num_tokens: expected an integer"),
    ("num_tokens 10**30", set_in(("num_tokens",), 10**30), "num_tokens: expected an integer"),
    (
        "positions sideways",
        set_in(("positions",), "sideways"),
        "positions: expected one of request, block",
    ),
    ("role evil", set_in(("role",), "evil"), "role: expected producer or consumer"),
    ("role offload", set_in(("role",), "offload"), "role: expected producer or consumer"),
    (
        "replica key 2**40",
        set_in(("groups", "0", "replica_keys"), [[2**40, 0]]),
        "replica_keys[0][0]",
    ),
    (
        "replica index past",
        set_in(("groups", "0", "replica_keys"), [[1, 1]]),
        "replica index 1 is not below 1",
    ),
    (
        "row width",
        set_in(("groups", "0", "values"), [["0" * 16, "1" * 16]] * 2),
        "one per replica key",
    ),
    ("value not hex", set_in(("groups", "0", "values"), [["xyz"], ["0" * 16]]), "16 lowercase hex"),
    ("fingerprint not hex", set_in(("fingerprints", "0"), 7), 'fingerprints["0"]'),
    ("group id 00", set_in(("groups", "00"), {}), "expected a group id"),
    ("unknown key", set_in(("extra",), 1), "extra: unknown key"),
    ("missing key", drop("groups"), "groups: missing"),
    ("wrong format", set_in(("format",), "kvaudit.other/1"), "format: expected"),
    ("tp_size 0", set_in(("worker", "tp_size"), 0), "worker.tp_size"),
    ("tp_rank past", set_in(("worker", "tp_rank"), 1), "worker.tp_rank: 1 is not in 0..0"),
    (
        "another worker's folder",
        set_in(
            ("worker",), {"tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "engine": "e"}
        ),
        "folder of pp0-tp0",
    ),
    (
        "other sizes than line 1",
        set_in(("worker", "pp_size"), 2),
        "worker.pp_size: 2, but the worker's earlier lines give 1",
    ),
    (
        "other numbering than line 1",
        set_in(("positions",), "block"),
        "positions: block, but the worker's earlier lines",
    ),
    ("request not a string", set_in(("request",), 7), "request: expected a string"),
    (
        "prompt not hex",
        set_in(("prompt",), "ABCDEF0123456789"),
        "prompt: expected 16 lowercase hex",
    ),
]


@pytest.mark.parametrize("command", ["checksum", "inspect", "diff"])
@pytest.mark.parametrize(("what", "change", "words"), CHANGES, ids=[c[0] for c in CHANGES])
def test_a_bad_line_is_one_line_naming_the_file_and_line(
    folder: Path, command: str, what: str, change: Callable[[dict], None], words: str
) -> None:
    path = lines_file(folder)
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    change(lines[1])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = [command, str(folder)]
    if command == "diff":
        write_folder(folder.parent / "good", "producer")
        args = ["diff", str(folder.parent / "good"), str(folder)]
    status, text = run(*args)
    assert status == 2, text
    assert "Traceback" not in text
    [message] = text.splitlines()
    assert message.startswith(f"kvaudit: error: {path}: line 2: ") and words in message, message


# Raw bytes as the second line, a good line after them.
RAW = [
    ("invalid UTF-8", b'{"format": "\xff\xfe"}', "line 2: not UTF-8 text"),
    (
        "nested 100,000 deep",
        b"[" * 100_000 + b"]" * 100_000,
        "line 2: nested more than 64 levels deep",
    ),
    ("nested 70 deep", b"[" * 70 + b"]" * 70, "nested more than 64 levels deep"),
    ("not JSON", b"{not json", "line 2: not a checksum line (not JSON"),
    ("extra data", b'{"a": 1}}', "line 2: not a checksum line (not JSON"),
    ("a key twice", b'{"a": 1, "a": 2}', 'line 2: key "a" appears twice'),
    ("5,000 digits", b'{"num_tokens": ' + b"1" * 5000 + b"}", "line 2: not a checksum line"),
    ("a list", b"[1, 2]", "line 2: record: expected an object"),
    ("a lone surrogate", b'{"request": "\\ud800"}', "line 2: request: not Unicode text"),
]


@pytest.mark.parametrize(("what", "raw", "words"), RAW, ids=[r[0] for r in RAW])
def test_bad_bytes_are_one_line_naming_the_line(
    folder: Path, what: str, raw: bytes, words: str
) -> None:
    path = lines_file(folder)
    first, *rest = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(first + raw + b"\n" + b"".join(rest))
    for command in ("checksum", "inspect"):
        status, text = run(command, str(folder))
        assert status == 2, text
        [message] = text.splitlines()
        assert message.startswith(f"kvaudit: error: {path}: ") and words in message, message


def test_a_line_past_the_length_limit_is_refused(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(output.reading, "MAX_LINE_BYTES", 400)
    status, text = run("checksum", str(folder))
    assert status == 2
    assert f"{lines_file(folder)}: line 1: longer than the 400 bytes of a checksum line" in text


MARKERS = [
    ("not JSON", b"{nope", "marker: not valid JSON"),
    ("a list", b"[]", "expected an object"),
    (
        "another format",
        b'{"format": "kvaudit.record/1", "engine": "vllm"}',
        "format: expected 'kvaudit.engine-output/1'",
    ),
    ("an unknown key", b'{"format": "kvaudit.engine-output/1", "extra": 1}', "extra: unknown key"),
    (
        "engine not a string",
        b'{"format": "kvaudit.engine-output/1", "engine": 5}',
        "engine: expected a string",
    ),
    ("invalid UTF-8", b'{"format": "\xff"}', "not UTF-8 text"),
    ("too large", b" " * (65 << 10), "larger than the 65536 bytes of a marker"),
]


@pytest.mark.parametrize(("what", "content", "words"), MARKERS, ids=[m[0] for m in MARKERS])
def test_the_marker_is_checked(folder: Path, what: str, content: bytes, words: str) -> None:
    marker = folder / "kvaudit-output.json"
    marker.write_bytes(content)
    status, text = run("checksum", str(folder))
    assert status == 2, text
    [message] = text.splitlines()
    assert message.startswith(f"kvaudit: error: {marker}: ") and words in message, message


def test_a_legacy_marker_names_its_own_format(folder: Path) -> None:
    (folder / "kvaudit-output.json").unlink()
    legacy = folder / "kvaudit-vllm.json"
    legacy.write_text('{"format": "kvaudit.engine-output/1"}')
    assert "format: expected 'kvaudit.vllm-output/1'" in run("checksum", str(folder))[1]
    legacy.write_text('{"format": "kvaudit.vllm-output/1"}')
    assert run("checksum", str(folder))[0] == 0


def _special(folder: Path, name: str, kind: str) -> Path:
    """``name`` under the folder made a FIFO, a link to /dev/zero or a directory."""
    path = folder / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    return path


@pytest.mark.parametrize(
    ("name", "kind", "words"),
    [
        ("workers/pp0-tp0/checksums.jsonl", "fifo", "is a FIFO, expected a regular file"),
        (
            "workers/pp0-tp0/checksums.jsonl",
            "zero",
            "is a character device, expected a regular file",
        ),
        ("workers/pp0-tp0/checksums.jsonl", "dir", "is a directory, expected a file"),
        ("kvaudit-output.json", "fifo", "is a FIFO, expected a regular file"),
        ("kvaudit-output.json", "zero", "is a character device, expected a regular file"),
        ("kvaudit-output.json", "dir", "is a directory, expected a file"),
    ],
)
def test_fifos_devices_and_directories_are_refused(
    folder: Path, name: str, kind: str, words: str
) -> None:
    path = _special(folder, name, kind)
    for command in ("checksum", "inspect", "diff"):
        args = [str(folder), str(folder)] if command == "diff" else [str(folder)]
        # A process of its own with a deadline: reading a FIFO would block, /dev/zero never end.
        result = subprocess.run(
            [sys.executable, "-m", "kvaudit", command, *args],
            capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert f"{path}: {words}" in result.stderr


def real_line(folder: Path) -> str:
    return lines_file(folder).read_text().splitlines()[0]


def test_a_torn_last_line_is_skipped_with_a_warning(folder: Path) -> None:
    path = lines_file(folder)
    torn = real_line(folder)[:200]
    with open(path, "a") as file:
        file.write(torn)
    read = read_output(folder)
    assert read.torn == [f"{path}: line 4"]
    assert_whole(folder)
    result = CliRunner().invoke(main, ["checksum", str(folder), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["requests"]) == set(TOKENS)
    assert f"kvaudit: warning: {folder}: 1 torn line skipped" in result.stderr
    assert f"{path}: line 4" in result.stderr
    # A diff says so in its report.
    write_folder(folder.parent / "p", "producer")
    differ = CliRunner().invoke(
        main, ["diff", str(folder.parent / "p"), str(folder), "--format", "json"]
    )
    assert differ.exit_code == 0, differ.output
    assert any("1 torn line skipped" in w for w in json.loads(differ.stdout)["warnings"])


def test_every_cut_of_a_line_is_a_torn_line_wherever_it_is(folder: Path) -> None:
    """Each start of a real line (a request id with escapes too) is torn: as the last
    line, after zeros a crash left, and followed by the new line the next append starts."""
    path = lines_file(folder)
    whole = path.read_bytes()
    record = read_output(folder).record
    line = output.checksum_line(
        kb_record(record),
        record.requests["r1"],
        "r\u00e9-\U0001f600\\x",
        "producer",
        "0123456789abcdef",
    )
    assert line.isascii()
    for cut in range(1, len(line)):
        start = line[:cut].encode()
        for tail in (b"", b"\x00" * 64, b"\n" + whole.splitlines(keepends=True)[0]):
            path.write_bytes(whole + start + tail)
            read = read_output(folder)
            assert read.torn == [f"{path}: line 4"], (cut, tail[:1])
            assert set(read.record.requests) == set(TOKENS)
    # A whole line is no torn line; lines that are wrong past their end are errors.
    path.write_bytes(whole + line.encode() + b"\n")
    assert read_output(folder).torn == []
    for bad in (
        line[:-1] + "]",
        line + "}",
        line[:40] + "@" + line[40:],
        line.replace(":", " ", 1),
    ):
        path.write_bytes(whole + bad.encode() + b"\n" + whole.splitlines(keepends=True)[0])
        with pytest.raises(KvauditError, match="line 4: "):
            read_output(folder)


def kb_record(record: object) -> object:
    """A worker record for ``checksum_line`` (the folder's one worker)."""
    from kvaudit.records import WorkerRecord

    summary = record.workers[0]  # type: ignore[attr-defined]
    return WorkerRecord(summary.worker, "request", summary.fingerprints, summary.not_covered, {})


def test_a_full_disk_leaves_a_torn_line_and_the_next_append_starts_a_new_one(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = lines_file(folder)
    lines = path.read_text().splitlines()
    before = path.stat().st_size
    real_write = os.write

    def full(descriptor: int, data: bytes) -> int:
        real_write(descriptor, bytes(data[: len(data) // 3]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output.writing.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        output.append_checksums(folder, [lines[0], lines[1]], WORKER)
    monkeypatch.undo()
    assert before < path.stat().st_size and not path.read_bytes().endswith(b"\n")
    assert_whole(folder)
    assert read_output(folder).torn == [f"{path}: line 4"]
    # Space freed: the next append is a line of its own, after the torn one.
    output.append_checksums(folder, [lines[2]], WORKER)
    assert path.read_text().splitlines()[-1] == lines[2]
    read = read_output(folder)
    assert read.torn == [f"{path}: line 4"]
    assert_whole(folder)


def test_short_writes_are_completed(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = lines_file(folder)
    lines = path.read_text().splitlines()
    path.unlink()
    real_write = os.write
    monkeypatch.setattr(
        output.writing.os, "write", lambda fd, data: real_write(fd, bytes(data[:7]))
    )
    output.append_checksums(folder, lines, WORKER)
    monkeypatch.undo()
    assert path.read_text() == "".join(line + "\n" for line in lines)


def test_checksums_rotate_past_max_bytes_and_are_read_oldest_first(folder: Path) -> None:
    path = lines_file(folder)
    good = path.read_text().splitlines()
    by_request = {json.loads(line)["request"]: line for line in good}
    changed = json.loads(by_request["r1"])
    changed["groups"]["0"]["values"][0][0] = "0" * 16
    stale = json.dumps(changed, separators=(",", ":"))
    path.unlink()
    size = max(len(line) for line in good) + 1
    # One line per file: r1's stale line rotates to .2, then r2, then r1's good line ...
    for line in (stale, by_request["r2"], by_request["r1"], by_request["r3"]):
        output.append_checksums(folder, [line], WORKER, max_bytes=size + 10, keep=2)
    names = sorted(p.name for p in path.parent.glob("checksums*.jsonl"))
    assert names == ["checksums.1.jsonl", "checksums.2.jsonl", "checksums.jsonl"]
    assert (path.parent / "checksums.2.jsonl").read_text() == by_request["r2"] + "\n"
    assert (path.parent / "checksums.1.jsonl").read_text() == by_request["r1"] + "\n"
    assert path.read_text() == by_request["r3"] + "\n"
    assert_whole(folder)  # r1's stale line was rotated out
    # Rotated files read oldest first, by number (10 before 2 and 1): the newer line wins.
    (path.parent / "checksums.10.jsonl").write_text(stale + "\n")
    assert_whole(folder)
    (path.parent / "checksums.10.jsonl").rename(
        path.parent / "checksums.0.jsonl"
    )  # no rotated name
    assert_whole(folder)


def test_rotation_keeps_at_most_keep_files(folder: Path) -> None:
    path = lines_file(folder)
    line = path.read_text().splitlines()[0]
    (path.parent / "checksums.9.jsonl").write_text(line + "\n")  # from a larger keep
    for _ in range(12):
        output.append_checksums(folder, [line, line], WORKER, max_bytes=3 * len(line), keep=3)
    names = sorted(p.name for p in path.parent.glob("checksums*.jsonl"))
    assert names == [
        "checksums.1.jsonl",
        "checksums.2.jsonl",
        "checksums.3.jsonl",
        "checksums.jsonl",
    ]
    for name in names:
        assert (path.parent / name).stat().st_size <= 3 * len(line)
    output.append_checksums(folder, [line], WORKER, max_bytes=len(line), keep=0)
    assert sorted(p.name for p in path.parent.glob("checksums*.jsonl"))[-1] == "checksums.jsonl"
    assert path.read_text() == line + "\n"
    # None never rotates; an append larger than max_bytes is written whole.
    output.append_checksums(folder, [line] * 5, WORKER, max_bytes=None)
    assert path.read_text() == (line + "\n") * 6
    output.append_checksums(folder, [line] * 5, WORKER, max_bytes=10, keep=1)
    assert path.read_text() == (line + "\n") * 5
    with pytest.raises(ValueError, match="max_bytes"):
        output.append_checksums(folder, [line], WORKER, max_bytes=0)
    with pytest.raises(ValueError, match="line break"):
        output.append_checksums(folder, [line + "\n" + line], WORKER)


def test_the_dump_budget_counts_what_is_on_disk(tmp_path: Path) -> None:
    """A random run of dumps, rewrites and refusals: the budget's count is always the
    bytes of the files it wrote that are still on disk, never past the limit."""
    for seed in range(20):
        rng = random.Random(seed)
        budget = output.DumpBudget(100)
        paths = [tmp_path / str(seed) / f"r{i}" / "pp0-tp0.safetensors" for i in range(5)]
        for _ in range(60):
            path = rng.choice(paths)
            size = rng.choice([0, 10, 30, 50, 60, 99, 100, 150])
            rotating = rng.random() < 0.7
            if budget.admits(path, size, rotating=rotating):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(b"x" * size)
                budget.written(path, size, rotating=rotating)
            on_disk = sum(p.stat().st_size for p in paths if p.exists())
            assert budget.used == on_disk <= 100, seed


def test_a_refused_rewrite_keeps_the_old_file_counted(tmp_path: Path) -> None:
    """The case of the issue: 150 bytes on disk against a limit of 100."""
    budget = output.DumpBudget(100)
    first, second, third = (tmp_path / name for name in ("a", "b", "c"))
    for path in (first, second):
        assert budget.admits(path, 50, rotating=True)
        path.write_bytes(b"x" * 50)
        budget.written(path, 50, rotating=True)
    assert not budget.admits(first, 150, rotating=True)  # never fits: first stays on disk
    assert budget.used == 100 and first.exists()
    assert budget.admits(third, 50, rotating=True)  # makes room: the oldest goes
    third.write_bytes(b"x" * 50)
    budget.written(third, 50, rotating=True)
    assert not first.exists() and budget.used == 100
    assert sum(p.stat().st_size for p in (second, third)) == budget.used


def test_worker_folders_that_are_not_folders_are_refused(folder: Path) -> None:
    odd = folder / "workers" / "pp0-tp1"
    odd.write_text("x")
    status, text = run("checksum", str(folder))
    assert status == 2 and f"{odd}: is not a folder" in text
