"""Live caches: ``live:SOCKET`` sources served by ``kvaudit.live.Agent`` in toy engines
(``tests/helpers/live_engine.py``, separate processes whose step loop rewrites, frees and reuses
blocks while the command line asks), compared with the same KV checksummed here in
another layout; two workers (TP=2) and two engines with a planted fault; failures.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from helpers import live_engine as toy

from kvaudit import Checksummer, RequestBlocks, combine_workers
from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.formats import record_to_json
from kvaudit.live import Agent, call
from kvaudit.live.server import MAX_CONNECTIONS
from kvaudit.sources import socket_source
from kvaudit.sources.socket_source import dump_requests

ENGINE = Path(__file__).resolve().parents[1] / "helpers" / "live_engine.py"
ROOT = ENGINE.parent.parent


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def assert_exit_2_naming(result: Result, *names: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvaudit: error: "), result.stderr
    for name in names:
        assert name in lines[0]
    return lines[0]


def totals(record: dict, request_id: str) -> list[str]:
    return record["requests"][request_id]["groups"]["0"]["totals"]


def reference_totals(
    request_id: str, state: int, tp_size: int, fault: bool = False, ranks: tuple[int, ...] = ()
) -> list[str]:
    """The request's totals computed here: its KV written at blocks 0.. of a fresh cache
    of each rank (all by default) in the KNHTD layout, checksummed and summed."""
    records = []
    values = toy.model_kv(request_id, state, fault)
    blocks = list(range(-(-values.shape[1] // toy.BLOCK_SIZE)))
    description = parse_description(toy.description(tp_size, "KNHTD"), "reference")
    for rank in ranks or range(tp_size):
        heads = toy.KV_HEADS // tp_size
        caches = [torch.zeros((toy.NUM_BLOCKS, toy.BLOCK_SIZE, heads, 2, toy.HEAD_SIZE))]
        caches.append(torch.zeros_like(caches[0]))
        toy.write_request(caches, values, blocks, rank, tp_size)
        tensors = {n: toy.layer_tensor(c, "KNHTD") for n, c in zip(toy.LAYERS, caches)}
        summer = Checksummer(description, tensors, tp_rank=rank, tp_size=tp_size, backend="torch")
        requests = {request_id: RequestBlocks(values.shape[1], {0: (0, blocks)})}
        records.append(summer.checksum(requests))
    return totals(record_to_json(combine_workers(records)), request_id)


class Engines:
    """Toy engine processes, each serving one socket; stopped at the end."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvl-", dir="/tmp"))
        self.processes: list[subprocess.Popen] = []

    def start(self, folder: str, *args: str, rank: int = 0) -> Path:
        """Start an engine serving ``FOLDER/pp0-tpRANK.sock``; ``ready`` waits for it."""
        path = self.root / folder
        path.mkdir(mode=0o700, exist_ok=True)
        sock = path / f"pp0-tp{rank}.sock"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, str(ENGINE), "--socket", str(sock), "--tp-rank", str(rank)]
        process = subprocess.Popen(
            [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
        )
        self.processes.append(process)
        return path

    def ready(self) -> None:
        """Wait until every engine started prints ``ready``."""
        for process in self.processes:
            line = process.stdout.readline() if process.stdout else ""
            assert line.strip() == "ready", process.stderr.read() if process.stderr else ""

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    """Started at once: a producer at TP=2 (NTHC, answering in ``poll()``) in
    ``prefill``; a consumer at TP=1 (KNHTD, answering on the agent's thread) with a
    planted fault in ``decode``; one that exits when asked anything in ``gone``."""
    started = Engines()
    try:
        for rank in (0, 1):
            started.start("prefill", "--tp-size", "2", "--role", "producer", rank=rank)
        started.start("decode", "--layout", "KNHTD", "--fault", "--mode", "thread")
        started.start("gone", "--mode", "die")
        started.ready()
        yield started
    finally:
        started.stop()


@pytest.fixture
def producer(engines: Engines) -> Path:
    return engines.root / "prefill"


@pytest.fixture
def consumer(engines: Engines) -> Path:
    return engines.root / "decode"


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVAUDIT_LIVE_TIMEOUT", "20")


# Consistency under concurrent work.


def test_answers_equal_a_state_of_some_step(producer: Path, tmp_path: Path) -> None:
    # Each worker answers at its own step boundary: per worker, ``flip`` is one state.
    stable = reference_totals("stable", 0, 2)
    for rank in (0, 1):
        flip = [reference_totals("flip", state, 2, ranks=(rank,)) for state in (0, 1)]
        sock = producer / f"pp0-tp{rank}.sock"
        for _ in range(3):
            args = ("--request", "flip", "--format", "json")
            result = run("checksum", f"live:{sock}", *args)
            assert result.exit_code == 1, result.output  # one worker of two: incomplete
            assert totals(json.loads(result.stdout), "flip") in flip  # never torn
    for attempt in range(3):
        args = ("--request", "stable", "--request", "flip", "--format", "json")
        result = run("checksum", f"live:{producer}", *args)
        assert result.exit_code == 0, result.output
        record = json.loads(result.stdout)
        assert record["complete"] is True
        assert totals(record, "stable") == stable
        folder = tmp_path / f"dump{attempt}"
        folder.mkdir()
        written = dump_requests(str(producer), folder, ["flip", "stable"])
        assert sorted(Path(path).name for path in written) == [
            "pp0-tp0.safetensors",
            "pp0-tp1.safetensors",
        ]
        dumped = run("checksum", folder, "--format", "json")
        assert dumped.exit_code == 0, dumped.output
        assert totals(json.loads(dumped.stdout), "stable") == stable
        for rank in (0, 1):
            one = run("checksum", folder / f"pp0-tp{rank}.safetensors", "--format", "json")
            flip = [reference_totals("flip", state, 2, ranks=(rank,)) for state in (0, 1)]
            assert totals(json.loads(one.stdout), "flip") in flip


def test_inspect_lists_workers_and_requests(producer: Path) -> None:
    result = run("inspect", f"live:{producer}", "--format", "json")
    assert result.exit_code == 0, result.output
    inventory = json.loads(result.stdout)
    assert inventory["complete"] is True
    assert len(inventory["workers"]) == 2
    assert {"stable", "flip"} <= set(inventory["requests"])
    one = run("inspect", f"live:{producer / 'pp0-tp1.sock'}", "--format", "json")
    assert json.loads(one.stdout)["complete"] is False
    table = run("inspect", f"live:{producer}")
    assert table.stdout.splitlines()[0] == f"live: {producer} (2 workers of TP 2 x PP 1, complete)"


# Several workers and engines.


def test_two_engines_compared_live_fault_located(
    producer: Path, consumer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[dict] = []

    def recording(path: str, message: dict, **options: object) -> tuple:
        asked.append(dict(message))
        return call(path, message, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(socket_source, "call", recording)
    result = run(
        "diff", f"live:{producer}", f"live:{consumer}", "--request", "stable", "--format", "json"
    )
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert "running engine" in report["untraced"]  # tracing would read every block
    group = report["requests"]["stable"]["groups"]["0"]
    fault_position = toy.FAULT["token"] // toy.BLOCK_SIZE
    assert group["mismatched_positions"] == [fault_position]
    [located] = group["located"]
    assert located["layer"] == toy.LAYERS[toy.FAULT["layer"]]
    assert located["head"] == toy.FAULT["head"]
    assert located["tokens"] == [toy.FAULT["token"]]
    assert located["first_byte"] == 3 * 4
    fetches = [m for m in asked if m["op"] == "fetch"]
    # Only the differing position's block, from each worker that holds the head's data.
    assert fetches and all(
        (m["lo"], m["hi"]) == (fault_position, fault_position + 1) for m in fetches
    )
    assert len(fetches) == 3  # two producer workers, one consumer
    intact = run("diff", f"live:{producer}", f"live:{consumer}", "--request", "flip")
    assert intact.exit_code in (0, 1)  # the engines step independently: flip may differ


def test_dumps_against_live(producer: Path, consumer: Path, tmp_path: Path) -> None:
    dump_requests(f"live:{producer}", tmp_path, ["stable"])  # with live: as on the command line
    result = run("diff", tmp_path, f"live:{consumer}", "--request", "stable", "--format", "json")
    assert result.exit_code == 1, result.output
    group = json.loads(result.stdout)["requests"]["stable"]["groups"]["0"]
    assert [item["tokens"] for item in group["located"]] == [[toy.FAULT["token"]]]
    same = run("diff", tmp_path, f"live:{producer}", "--request", "stable")
    assert same.exit_code == 0, same.output
    assert reference_totals("stable", 0, 1, fault=True) == totals(
        json.loads(
            run("checksum", f"live:{consumer}", "--request", "stable", "--format", "json").stdout
        ),
        "stable",
    )


def numeric_figures(report: dict) -> dict:
    """A numeric report without the names of its sides (the figures alone)."""
    return {key: value for key, value in report.items() if key not in ("producer", "consumer")}


@pytest.mark.parametrize("native", ["1", "0"])
def test_numeric_diff_reads_live_sides(
    producer: Path, consumer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: str
) -> None:
    """``diff --numeric`` reads a running engine's KV as it reads dumps: live against
    live, dumps against live and live against dumps give the figures of dumps of the
    same KV, with the C code and without."""
    monkeypatch.setenv("KVAUDIT_NATIVE", native)
    dumped = {}
    for name, engine in (("prefill", producer), ("decode", consumer)):
        dumped[name] = tmp_path / name
        dumped[name].mkdir()
        dump_requests(str(engine), dumped[name], ["stable"])
    args = ("--numeric", "--request", "stable", "--format", "json")
    reference = run("diff", dumped["prefill"], dumped["decode"], *args)
    assert reference.exit_code == 1, reference.output
    expected = numeric_figures(json.loads(reference.stdout))
    for left, right in [
        (f"live:{producer}", f"live:{consumer}"),
        (dumped["prefill"], f"live:{consumer}"),
        (f"live:{producer}", dumped["decode"]),
    ]:
        result = run("diff", left, right, *args)
        assert result.exit_code == 1, result.output
        assert numeric_figures(json.loads(result.stdout)) == expected
    # The planted fault, by value: one element of one layer's K, off by 1.0.
    text = run("diff", f"live:{producer}", f"live:{consumer}", "--numeric", "--request", "stable")
    assert text.exit_code == 1 and toy.LAYERS[toy.FAULT["layer"]] in text.stdout, text.output


# Failures.


def test_dead_socket_exits_2_naming_it(engines: Engines) -> None:
    folder = engines.root / "dead"
    folder.mkdir(mode=0o700)
    path = folder / "pp0-tp0.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.close()  # the file stays, nothing listens
    assert_exit_2_naming(run("inspect", f"live:{folder}"), str(path), "connection refused")
    assert_exit_2_naming(run("checksum", f"live:{engines.root / 'none'}"), "no such socket")


def test_timeout_and_worker_gone_exit_2(
    agent_parts: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVAUDIT_LIVE_TIMEOUT", "1.5")
    folder = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    # An engine that never reaches a step boundary: its agent listens, nobody polls.
    with Agent(folder / "pp0-tp0.sock", *agent_parts):
        start = time.monotonic()
        line = assert_exit_2_naming(run("inspect", f"live:{folder}"), str(folder / "pp0-tp0.sock"))
        assert "no answer within 1.5 s" in line and time.monotonic() - start < 10
        monkeypatch.setenv("KVAUDIT_LIVE_TIMEOUT", "soon")
        assert_exit_2_naming(run("inspect", f"live:{folder}"), "KVAUDIT_LIVE_TIMEOUT")
    os.rmdir(folder)
    monkeypatch.setenv("KVAUDIT_LIVE_TIMEOUT", "20")


def test_worker_gone_mid_request_exits_2(engines: Engines) -> None:
    folder = engines.root / "gone"
    path = folder / "pp0-tp0.sock"
    line = assert_exit_2_naming(run("checksum", f"live:{folder}"), str(path))
    assert "closed the connection mid-request" in line


# The agent in this process: bad requests, files and modes.


@pytest.fixture
def toy_engine() -> toy.Engine:
    return toy.Engine(0, 1, False, "cpu", 3)


@pytest.fixture
def agent_parts(toy_engine: toy.Engine) -> tuple:
    """An in-process engine's description, tensors and block tables."""
    description = parse_description(toy.description(1, "NTHC"), "engine")
    tensors = {n: toy.layer_tensor(c, "NTHC") for n, c in zip(toy.LAYERS, toy_engine.caches)}

    def tables() -> dict[str, RequestBlocks]:
        listed = toy_engine.block_tables().items()
        return {rid: RequestBlocks(e["num_tokens"], e["groups"]) for rid, e in listed}

    return description, tensors, tables


@pytest.fixture
def agent(toy_engine: toy.Engine, agent_parts: tuple) -> Iterator[Agent]:
    """An agent over an in-process engine that steps and polls on a thread."""
    folder = tempfile.mkdtemp(prefix="kva-", dir="/tmp")
    engine = toy_engine
    served = Agent(os.path.join(folder, "w.sock"), *agent_parts, timeout=1.0)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            engine.step(0.0)
            served.poll()
            time.sleep(0.002)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield served
    finally:
        stop.set()
        thread.join()
        served.close()
        os.rmdir(folder)


def raw_exchange(path: str, data: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(data)
        header = sock.recv(12)
        size, _ = struct.unpack(">IQ", header)
        body = b""
        while len(body) < size:
            body += sock.recv(size - len(body))
        return json.loads(body)


def frame(text: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">IQ", len(text), len(payload)) + text + payload


def test_bad_requests_get_error_replies(agent: Agent) -> None:
    path = agent.path
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    bad = [
        struct.pack(">IQ", 1 << 31, 0),
        frame(b'{"op": "hello"}', b"x"),
        frame(b"\x80\x81 not json"),
        frame(b"[1, 2]"),
        frame(b"[" * 5000 + b"]" * 5000),
    ]
    for data in bad:
        assert raw_exchange(path, data)["ok"] is False
    for message, problem in [
        ({"op": "exec", "code": "import os"}, "unknown op"),
        ({"op": "checksum", "requests": ["nope"]}, "not in the cache"),
        ({"op": "checksum", "requests": "stable"}, "expected a list"),
        ({"op": "checksum", "requests": ["stable\n"]}, "bad request id"),
        ({"op": "checksum", "positions": "everywhere"}, "positions"),
        (
            {"op": "fetch", "request": "stable", "group": 0, "lo": 0, "hi": 10**6, "num_tokens": 5},
            "hi",
        ),
        ({"op": "dump", "folder": "relative/dir"}, "absolute folder"),
    ]:
        with pytest.raises(KvauditError, match=problem) as caught:
            call(path, message, timeout=5)
        assert path in str(caught.value)
    # A client that connects and says nothing is dropped; the engine still answers.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(path)
        reply, _ = call(path, {"op": "list"}, timeout=5)
        assert "stable" in reply["requests"]
        idle.settimeout(5)
        assert idle.recv(1) == b""


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary folder of everything started after it."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_the_agent_leaves_no_files_behind(scratch: Path, agent: Agent) -> None:
    # An engine may end without close(): nothing of the agent's may outlive its work.
    message = {"op": "fetch", "request": "stable", "group": 0, "lo": 0, "hi": 1, "num_tokens": 5}
    for _ in range(3):
        _, payload = call(agent.path, message, timeout=5)
        assert len(payload) > 8
    assert list(scratch.iterdir()) == []


def test_requests_of_clients_that_left_are_never_computed(agent_parts: tuple) -> None:
    # Clients that ask and go away between two polls cost the engine neither memory nor
    # work: their requests leave with them.
    folder = tempfile.mkdtemp(prefix="kva-", dir="/tmp")
    served = Agent(os.path.join(folder, "w.sock"), *agent_parts, timeout=5.0)
    try:
        computed = []
        served.summer.checksum = lambda *args: computed.append(args)  # type: ignore[method-assign]
        big = frame(json.dumps({"op": "checksum", "requests": ["x" * 1000] * 900}).encode())
        for _ in range(200):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(served.path)
                sock.sendall(big)
        deadline = time.monotonic() + 10
        while served.waiting() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.waiting() == 0
        assert served.poll(max_requests=1000) == 0 and computed == []
        # A client that stays is answered.
        reply, _ = call_polled(served, {"op": "list"})
        assert "stable" in reply["requests"]
    finally:
        served.close()
        os.rmdir(folder)


def call_polled(served: Agent, message: dict) -> tuple[dict, bytes]:
    """``call`` while this thread polls the agent."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call(served.path, message, timeout=5)))
    thread.start()
    while thread.is_alive():
        served.poll()
        time.sleep(0.002)
    thread.join()
    return result[0]


def test_an_engine_that_exits_without_close_leaves_no_socket(tmp_path: Path) -> None:
    folder = tmp_path / "engine"
    folder.mkdir(mode=0o700)
    script = f"""
import sys
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
from helpers import live_engine as toy
from kvaudit.description import parse_description
from kvaudit.live import Agent
engine = toy.Engine(0, 1, False, "cpu", 3)
description = parse_description(toy.description(1, "NTHC"), "engine")
tensors = {{n: toy.layer_tensor(c, "NTHC") for n, c in zip(toy.LAYERS, engine.caches)}}
agent = Agent({str(folder / "w.sock")!r}, description, tensors, dict)
print(sorted(p.name for p in __import__("pathlib").Path({str(folder)!r}).iterdir()))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['w.sock']"
    assert list(folder.iterdir()) == []


def test_a_busy_agent_says_so(agent: Agent) -> None:
    """With ``MAX_CONNECTIONS`` open, a client is told "busy" (after asking again until its
    timeout); once they close, the next call is answered."""
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(agent.path)
            idle.append(sock)
        deadline = time.monotonic() + 10
        while len(agent._server._connections) < MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)  # the agent's thread accepts them
        busy = f"busy: {MAX_CONNECTIONS} connections are open, try again later \\(asked again"
        with pytest.raises(KvauditError, match=busy):
            call(agent.path, {"op": "list"}, timeout=0.3)
        assert agent._server.refused > 1  # asked more than once
    finally:
        for sock in idle:
            sock.close()
    reply, _ = call(agent.path, {"op": "list"}, timeout=10)
    assert "stable" in reply["requests"]


def test_a_client_asks_a_busy_agent_again(agent: Agent) -> None:
    """A client told "busy: 64 connections are open" asks again with a growing pause and
    is answered once connections close (before: the first busy reply was its error)."""
    idle = []
    for _ in range(MAX_CONNECTIONS):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(agent.path)
        idle.append(sock)
    deadline = time.monotonic() + 10
    while len(agent._server._connections) < MAX_CONNECTIONS and time.monotonic() < deadline:
        time.sleep(0.01)
    got: list[object] = []

    def ask() -> None:
        try:
            got.append(call(agent.path, {"op": "list"}, timeout=30)[0])
        except KvauditError as error:
            got.append(error)

    thread = threading.Thread(target=ask)
    thread.start()
    try:
        while agent._server.refused < 2 and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agent._server.refused >= 2, got  # told busy, and asked again
    finally:
        for sock in idle:
            sock.close()
        thread.join()
    assert isinstance(got[0], dict) and "stable" in got[0]["requests"], got


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_socket_or_folder_of_another_user_is_refused(agent: Agent) -> None:
    """``live:PATH`` trusts what answers there: a socket, or its folder, owned by another
    user than this process's or root is refused in one line naming it."""
    other = 12345
    folder = os.path.dirname(agent.path)
    assert call(agent.path, {"op": "list"}, timeout=5)[0]["ok"]
    try:
        os.chown(agent.path, other, -1)
        with pytest.raises(KvauditError, match=r"the socket belongs to another user \(uid 12345\)"):
            call(agent.path, {"op": "list"}, timeout=5)
        line = assert_exit_2_naming(run("inspect", f"live:{agent.path}"), agent.path)
        assert "belongs to another user" in line
        os.chown(agent.path, 0, -1)
        os.chown(folder, other, -1)
        with pytest.raises(KvauditError, match="its folder belongs to another user"):
            call(agent.path, {"op": "list"}, timeout=5)
    finally:
        os.chown(agent.path, 0, -1)
        os.chown(folder, 0, -1)
    assert call(agent.path, {"op": "list"}, timeout=5)[0]["ok"]


def test_private_folder_required(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    description = parse_description(toy.description(1, "NTHC"), "engine")
    engine = toy.Engine(0, 1, False, "cpu", 3)
    tensors = {n: toy.layer_tensor(c, "NTHC") for n, c in zip(toy.LAYERS, engine.caches)}
    with pytest.raises(KvauditError, match="writable by others"):
        Agent(str(shared / "w.sock"), description, tensors, dict)


def _handle_text(marker: Path) -> str:
    """A Python handle of the toy engine that leaves ``marker`` when it is imported."""
    return f"""
import pathlib
import sys
sys.path.insert(0, {str(ENGINE.parent)!r})
from helpers import live_engine as toy

pathlib.Path({str(marker)!r}).touch()

def kvaudit_live():
    engine = toy.Engine(0, 1, False, "cpu", 5)
    tensors = {{n: toy.layer_tensor(c, "NTHC") for n, c in zip(toy.LAYERS, engine.caches)}}
    return toy.description(1, "NTHC"), tensors, {{}}, engine.block_tables()
"""


def test_python_handle_under_py_prefix(tmp_path: Path) -> None:
    handle = tmp_path / "handle.py"
    handle.write_text(_handle_text(tmp_path / "imported"))
    result = run("checksum", f"py:{handle}", "--request", "stable", "--format", "json")
    assert result.exit_code == 0, result.output
    assert totals(json.loads(result.stdout), "stable") == reference_totals("stable", 0, 1)


@pytest.mark.parametrize("form", ["file", "missing file", "module"])
def test_live_with_a_python_target_says_to_write_py(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """``live:`` names sockets only (docs/cli.md): a Python file, or a dotted module name
    that is no path, is one line saying to write ``py:TARGET``, and the handle is not run
    (the older spelling ran it)."""
    marker = tmp_path / "imported"
    package = tmp_path / "kvaudit_probe_handles"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "toy.py").write_text(_handle_text(marker))
    monkeypatch.syspath_prepend(str(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the module name is no path here
    target = {
        "file": str(package / "toy.py"),
        "missing file": str(tmp_path / "none.py"),
        "module": "kvaudit_probe_handles.toy",
    }[form]
    line = assert_exit_2_naming(run("checksum", f"live:{target}", "--request", "stable"))
    assert line.startswith(f"kvaudit: error: live:{target}: ")
    assert line.endswith(f"write py:{target} for a Python handle")
    assert not marker.exists()
    if form != "missing file":  # the same target under py: is the handle it names
        result = run("checksum", f"py:{target}", "--request", "stable", "--format", "json")
        assert result.exit_code == 0, result.output
        assert marker.exists()
        assert totals(json.loads(result.stdout), "stable") == reference_totals("stable", 0, 1)
