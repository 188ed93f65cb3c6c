"""A live agent under misbehaving clients (hardening round three): what the agent costs
the engine stays bounded (memory, copies per poll, ids per request), every connection has
a deadline, a half-closed client still gets its reply, and a client retries an agent
whose queue of connections is full instead of failing at once."""

from __future__ import annotations

import json
import os
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
from click.testing import CliRunner
from helpers import live_engine as toy

from kvaudit import RequestBlocks
from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.live import Agent, call
from kvaudit.live.protocol import MAX_IDS

ROOT = Path(__file__).resolve().parents[2]
BLOCK, HEADS, HEAD_SIZE = 16, 2, 64
BLOCK_BYTES = BLOCK * HEADS * 2 * HEAD_SIZE * 4
LAYER = "model.layers.0.attn"


def frame(message: dict) -> bytes:
    text = json.dumps(message).encode()
    return struct.pack(">IQ", len(text), 0) + text


def read_reply(sock: socket.socket) -> tuple[dict, bytes]:
    """One whole reply frame from a raw socket."""
    data = b""
    while len(data) < 12:
        chunk = sock.recv(65536)
        assert chunk, "closed before the reply's header"
        data += chunk
    size, payload = struct.unpack(">IQ", data[:12])
    while len(data) < 12 + size + payload:
        chunk = sock.recv(1 << 20)
        assert chunk, "closed mid-reply"
        data += chunk
    return json.loads(data[12 : 12 + size]), data[12 + size :]


class Cache:
    """One layer's float32 cache of ``rows`` blocks, and requests over its blocks."""

    def __init__(self, rows: int, requests: dict[str, RequestBlocks]) -> None:
        self.tensor = torch.randn(rows, HEADS, BLOCK, 2 * HEAD_SIZE)
        spec = {"type": "full_attention", "block_size": BLOCK, "num_kv_heads": HEADS,
                "head_size": HEAD_SIZE, "dtype": "float32", "layout": "NHTC"}  # fmt: skip
        self.description = parse_description(
            {"kvaudit": 1, "num_blocks": rows, "groups": [{"spec": spec, "layers": [LAYER]}]},
            "engine",
        )
        self.requests = requests

    def agent(self, folder: str, **options: object) -> Agent:
        return Agent(
            os.path.join(folder, "pp0-tp0.sock"),
            self.description,
            {LAYER: self.tensor},
            lambda: self.requests,
            **options,  # type: ignore[arg-type]
        )


def whole(blocks: int) -> RequestBlocks:
    return RequestBlocks(blocks * BLOCK, {0: (0, list(range(blocks)))})


def fetch_of(blocks: int) -> dict:
    return {"op": "fetch", "request": "big", "group": 0, "lo": 0, "hi": blocks,
            "num_tokens": blocks * BLOCK}  # fmt: skip


@pytest.fixture
def folder() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvp-", dir="/tmp")
    yield path
    os.rmdir(path)


class Polling:
    """An engine thread that polls its agent every millisecond until stopped."""

    def __init__(self, agent: Agent) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(agent,))
        self.thread.start()

    def _loop(self, agent: Agent) -> None:
        while not self.stop.is_set():
            agent.poll()
            time.sleep(0.001)

    def end(self) -> None:
        self.stop.set()
        self.thread.join()


def test_the_engine_keeps_its_memory_and_steps_under_non_reading_clients() -> None:
    """64 clients each fetch 16 MiB and never read: the engine's RSS grows by no reply
    (before: every reply held whole in memory, 64 x 16 MiB) and it keeps stepping. Its
    step rate is measured by ``bench/live_pressure.py``, never asserted here (a rate
    depends on what else the machine runs)."""
    script = ROOT / "bench" / "live_pressure.py"
    command = [sys.executable, str(script), "--misbehave", "non-reading", "--clients", "64",
               "--fetch-mib", "16", "--seconds", "2", "--json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["rss_growth_mib"] < 96, figures
    assert figures["busy_steps"] > 0, figures


def test_reply_bytes_held_for_clients_are_bounded(folder: str) -> None:
    """Past ``max_held_bytes`` of replies waiting for their clients, a fetch is answered
    busy before anything is copied; once the reader takes its reply, fetches work again."""
    cache = Cache(40, {"big": whole(32)})
    with cache.agent(folder, max_held_bytes=32 * BLOCK_BYTES) as agent:
        polling = Polling(agent)
        try:
            stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stalled.connect(agent.path)
            stalled.sendall(frame(fetch_of(32)))
            deadline = time.monotonic() + 10
            while not agent._server.held_bytes() and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(KvauditError, match=r"busy: \d+ bytes of replies wait"):
                call(agent.path, fetch_of(32), timeout=1)  # asked again until its timeout
            reply, payload = read_reply(stalled)
            stalled.close()
            assert reply["ok"] is True and len(payload) > 32 * BLOCK_BYTES
            deadline = time.monotonic() + 10
            while agent._server.held_bytes() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert agent._server.held_bytes() == 0
            assert len(call(agent.path, fetch_of(32), timeout=5)[1]) == len(payload)
        finally:
            polling.end()


def test_one_poll_copies_a_bounded_amount(folder: str) -> None:
    """Requests whose replies copy more than ``max_poll_bytes`` are answered over several
    polls, one step boundary taking at most that much (and always one request)."""
    cache = Cache(20, {"big": whole(16)})
    # Time enough for every poll: only the bytes bound holds requests back here.
    with cache.agent(
        folder, max_poll_bytes=16 * BLOCK_BYTES, poll_share=1e9, max_poll_seconds=1e3
    ) as agent:
        clients = []
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(agent.path)
            sock.sendall(frame(fetch_of(16)))
            clients.append(sock)
        deadline = time.monotonic() + 10
        while agent.waiting() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [agent.poll(), agent.poll(), agent.poll(), agent.poll()] == [1, 1, 1, 0]
        for sock in clients:
            assert read_reply(sock)[0]["ok"] is True
            sock.close()


def test_a_queued_request_has_a_deadline(folder: str) -> None:
    """In an engine that stops polling, a queued request is answered with an error after
    ``wait_timeout`` and leaves its slot, instead of holding it for ever."""
    cache = Cache(4, {"big": whole(2)})
    with cache.agent(folder, wait_timeout=0.5) as agent:
        start = time.monotonic()
        with pytest.raises(KvauditError, match=r"reached no safe point within 0.5 s"):
            call(agent.path, {"op": "list"}, timeout=20)
        assert time.monotonic() - start < 10
        assert agent.waiting() == 0
        thread = Polling(agent)
        try:
            assert "big" in call(agent.path, {"op": "list"}, timeout=5)[0]["requests"]
        finally:
            thread.end()


def test_a_half_closed_client_gets_its_reply(folder: str) -> None:
    """A client that sends its request and shuts down its writing (``SHUT_WR``) gets the
    reply; one that half-closes mid-frame gets an error reply saying so."""
    cache = Cache(4, {"big": whole(2)})
    with cache.agent(folder) as agent:
        polling = Polling(agent)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(agent.path)
                sock.sendall(frame({"op": "list"}))
                sock.shutdown(socket.SHUT_WR)
                reply, _ = read_reply(sock)
                assert reply["ok"] is True and "big" in reply["requests"]
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(agent.path)
                sock.sendall(frame({"op": "list"})[:15])
                sock.shutdown(socket.SHUT_WR)
                reply, _ = read_reply(sock)
                assert reply["ok"] is False and "mid-frame" in reply["error"]
        finally:
            polling.end()


def test_a_client_retries_a_full_backlog(tmp_path: Path) -> None:
    """An agent whose queue of connections is full (a burst of clients) is retried with a
    growing pause: the call succeeds once the agent accepts again, and says "busy" when
    it never does."""
    path = str(tmp_path / "w.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    waiting = []
    for _ in range(4):  # fill the backlog: further connects fail with EAGAIN
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            break
        waiting.append(sock)
    with pytest.raises(KvauditError, match="busy: the agent's queue of connections stayed full"):
        call(path, {"op": "list"}, timeout=1)

    def agent_wakes() -> None:
        time.sleep(0.3)
        while True:
            conn, _ = listener.accept()
            head = conn.recv(12)
            if not head:  # one of the connections that filled the backlog
                conn.close()
                continue
            size, _ = struct.unpack(">IQ", head)
            conn.recv(size)
            conn.sendall(frame({"ok": True, "answer": 42}))
            conn.close()
            return

    thread = threading.Thread(target=agent_wakes)
    thread.start()
    for sock in waiting:
        sock.close()
    reply, _ = call(path, {"op": "list"}, timeout=10)
    thread.join()
    listener.close()
    assert reply == {"ok": True, "answer": 42}


def test_a_burst_of_clients_is_answered_or_told_busy(folder: str) -> None:
    """200 clients at once: each gets its answer or the documented busy reply, none a
    connection error."""
    cache = Cache(4, {"big": whole(2)})
    with cache.agent(folder) as agent:
        polling = Polling(agent)
        failures: list[str] = []
        answered: list[bool] = []

        def ask() -> None:
            try:
                answered.append(call(agent.path, {"op": "list"}, timeout=30)[0]["ok"])
            except KvauditError as error:
                if "busy:" not in str(error):
                    failures.append(str(error))

        threads = [threading.Thread(target=ask) for _ in range(200)]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            polling.end()
        assert failures == []
        assert answered and all(answered)


def test_ids_per_request_are_bounded(folder: str) -> None:
    """A request naming more than MAX_IDS ids is refused with an error reply, before any
    work; the command line asks about more requests in batches."""
    cache = Cache(4, {"big": whole(2)})
    with cache.agent(folder) as agent:
        polling = Polling(agent)
        try:
            # 100,000 ids cost the engine's thread about 0.4 s a request: 8,192 a tenth.
            assert MAX_IDS == 8192
            many = [f"r{i}" for i in range(8193)]
            with pytest.raises(KvauditError, match="at most 8192 request ids"):
                call(agent.path, {"op": "checksum", "requests": many}, timeout=10)
            many = {f"r{i}": 1 for i in range(8193)}
            with pytest.raises(KvauditError, match="num_tokens"):
                call(agent.path, {"op": "checksum", "num_tokens": many}, timeout=10)
        finally:
            polling.end()


def test_more_requests_than_one_request_names_are_asked_in_batches(folder: str) -> None:
    """A diff whose sides hold more than MAX_IDS requests to cut to shared token counts
    asks for them in batches of at most MAX_IDS ids; every request is compared."""
    count = MAX_IDS + 5
    held = Cache(4, {f"r{i}": RequestBlocks(BLOCK, {0: (0, [1])}) for i in range(count)})
    fewer = Cache(4, {f"r{i}": RequestBlocks(BLOCK // 2, {0: (0, [1])}) for i in range(count)})
    fewer.tensor = held.tensor
    os.mkdir(os.path.join(folder, "p"))
    os.mkdir(os.path.join(folder, "c"), 0o700)
    sent: list[int] = []
    # What is counted here is the batches, not the agent's share of the engine's time:
    # a whole share and a long wait, so that a busy machine cannot time the answer out.
    patient = {"poll_share": 1.0, "max_poll_seconds": 1.0, "wait_timeout": 600.0}
    with (
        held.agent(os.path.join(folder, "p"), **patient) as producer,
        fewer.agent(os.path.join(folder, "c"), **patient) as consumer,
    ):
        original = producer._start

        def counting(connection: int, message: dict) -> object:
            if message.get("op") == "checksum":
                sent.append(len(message.get("requests") or []))
            return original(connection, message)

        producer._start = counting  # type: ignore[method-assign]
        pollers = [Polling(producer), Polling(consumer)]
        try:
            result = CliRunner().invoke(
                main,
                [
                    "diff",
                    f"live:{producer.path}",
                    f"live:{consumer.path}",
                    "--allow-missing",
                    "--format",
                    "json",
                ],
            )
        finally:
            for poller in pollers:
                poller.end()
    os.rmdir(os.path.join(folder, "p"))
    os.rmdir(os.path.join(folder, "c"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["requests"]) == count
    groups = [item["groups"]["0"] for item in report["requests"].values()]
    assert all(group["compared"] == 1 and not group["mismatched_positions"] for group in groups)
    assert sent == [MAX_IDS, count - MAX_IDS]


def test_toy_engine_still_answers_a_whole_dump(folder: str) -> None:
    """A dump without a folder comes back as the reply's payload, readable as a dump."""
    engine = toy.Engine(0, 1, False, "cpu", 3)
    description = parse_description(toy.description(1, "NTHC"), "engine")
    tensors = {n: toy.layer_tensor(c, "NTHC") for n, c in zip(toy.LAYERS, engine.caches)}

    def tables() -> dict[str, RequestBlocks]:
        return {rid: RequestBlocks(e["num_tokens"], e["groups"]) for rid, e in
                engine.block_tables().items()}  # fmt: skip

    with Agent(os.path.join(folder, "w.sock"), description, tensors, tables) as agent:
        polling = Polling(agent)
        try:
            target = Path(folder).parent / f"{Path(folder).name}.safetensors"
            with open(target, "xb") as file:
                call(agent.path, {"op": "dump", "requests": ["stable"]}, payload_to=file)
        finally:
            polling.end()
    try:
        from kvaudit.dumps import open_dump

        dump = open_dump(str(target))
        assert list(dump.requests) == ["stable"]
        assert dump.requests["stable"].num_tokens == toy.REQUESTS["stable"]
    finally:
        target.unlink()
