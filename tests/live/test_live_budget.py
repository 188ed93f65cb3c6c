"""The live agent's cost per safe point is bounded in time (hardening round four): each
poll takes at most its share of the engine's time since the previous one, an answer
larger than that is split over the next polls, and what needs no safe point is answered
without one.

Time here is the agent's clock, replaced by a fake one that the tests move: the engine's
time between polls, and a fixed cost per block position read. What is asserted is
counted (requests answered per poll, positions read per unit, polls per answer), never
a time measured.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch

from kvaudit import Checksummer, RequestBlocks
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.live import Agent, call
from kvaudit.live.messages import listing_to_json
from kvaudit.records.encoding import worker_record_to_json
from kvaudit.views.inputs import plain_requests

BLOCK, HEADS, HEAD_SIZE = 16, 2, 64
LAYER = "model.layers.0.attn"
TICK = 1 / 1024
"""The fake cost of one block position read (a power of two: sums stay exact)."""


def frame(message: dict) -> bytes:
    text = json.dumps(message).encode()
    return struct.pack(">IQ", len(text), 0) + text


def read_reply(sock: socket.socket) -> dict:
    """One whole reply frame's JSON from a raw socket."""
    data = b""
    while True:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    size, _ = struct.unpack(">IQ", data[:12])
    return json.loads(data[12 : 12 + size])


class Clock:
    """The agent's clock: it moves only when told (the engine's steps, a unit's reads)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """One layer's float32 cache, its requests, and an agent whose clock is fake: each
    block position checksummed costs ``TICK``, each poll follows ``step`` of engine time."""

    def __init__(
        self, rows: int, requests: dict[str, RequestBlocks], folder: str, **options: object
    ) -> None:
        self.tensor = torch.randn(rows, HEADS, BLOCK, 2 * HEAD_SIZE)
        spec = {"type": "full_attention", "block_size": BLOCK, "num_kv_heads": HEADS,
                "head_size": HEAD_SIZE, "dtype": "float32", "layout": "NHTC"}  # fmt: skip
        self.description = parse_description(
            {"kvaudit": 1, "num_blocks": rows, "groups": [{"spec": spec, "layers": [LAYER]}]},
            "engine",
        )
        self.requests = requests
        self.agent = Agent(
            os.path.join(folder, "pp0-tp0.sock"),
            self.description,
            {LAYER: self.tensor},
            lambda: self.requests,
            **options,  # type: ignore[arg-type]
        )
        self.clock = Clock()
        self.agent._clock = self.clock
        self.agent._rested = self.clock()
        self.read: list[int] = []
        """The block positions of each checksum the agent computed."""
        original = self.agent.summer.checksum

        def costly(requests: dict, positions: str = "request") -> object:
            blocks = sum(len(ids) for r in requests.values() for _, ids in r.groups.values())
            self.read.append(blocks)
            self.clock.now += TICK * blocks
            return original(requests, positions)

        self.agent.summer.checksum = costly  # type: ignore[method-assign]

    def poll(self, step: float) -> int:
        """The engine steps for ``step`` seconds, then polls."""
        self.clock.now += step
        return self.agent.poll()

    def ask(self, message: dict) -> socket.socket:
        """A client that sent ``message`` and waits for its reply."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20)
        sock.connect(self.agent.path)
        sock.sendall(frame(message))
        return sock

    def arrived(self, count: int) -> None:
        """Wait until ``count`` requests are queued."""
        deadline = time.monotonic() + 10
        while self.agent.waiting() < count and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.agent.waiting() == count

    def reference(self, requests: dict[str, RequestBlocks], positions: str = "request") -> dict:
        """The record of a checksummer of its own over the same tensor (no agent)."""
        summer = Checksummer(
            self.description, {LAYER: self.tensor}, role="consumer", source=self.agent.path
        )
        return json.loads(json.dumps(worker_record_to_json(summer.checksum(requests, positions))))


@pytest.fixture
def folder() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def blocks_of(first: int, count: int) -> RequestBlocks:
    return RequestBlocks(count * BLOCK - 3, {0: (0, list(range(first, first + count)))})


def test_a_poll_answers_what_its_share_of_time_allows(folder: str) -> None:
    """16 checksums of one block each, 1 tick a block, 10 ticks of engine time between
    polls and a share of 0.5: 5 answered a poll (before: all 16 in the first poll)."""
    requests = {f"r{i}": blocks_of(i, 1) for i in range(16)}
    engine = Engine(20, requests, folder, poll_share=0.5)
    with engine.agent:
        clients = [engine.ask({"op": "checksum", "requests": [f"r{i}"]}) for i in range(16)]
        engine.arrived(16)
        answered = [engine.poll(10 * TICK) for _ in range(5)]
        assert answered == [5, 5, 5, 1, 0]
        for number, sock in enumerate(clients):
            reply = read_reply(sock)
            sock.close()
            assert reply["ok"] is True, reply
            expected = engine.reference({f"r{number}": requests[f"r{number}"]})
            assert reply["record"] == expected


def test_a_long_answer_is_split_over_polls_and_equals_one_computed_whole(folder: str) -> None:
    """A checksum of 64 requests of 4 blocks, with 8 ticks of time a poll: each poll reads
    at most 8 positions (2 requests) and returns, the work left for the next; the answer
    after 32 polls equals a checksum of every request at once (before: one poll read all
    256 positions)."""
    requests = {f"r{i}": blocks_of(i, 4) for i in range(64)}
    engine = Engine(80, requests, folder, poll_share=0.5)
    with engine.agent:
        engine.agent._pace.seconds["checksum"] = TICK  # learnt already: sized from the start
        client = engine.ask({"op": "checksum", "positions": "block"})
        engine.arrived(1)
        polls = 0
        while True:
            polls += 1
            if engine.poll(16 * TICK):
                break
            assert engine.agent.waiting() == 1  # in progress, not queued again
            assert polls < 100
        assert polls == 32
        reads = [blocks for blocks in engine.read if blocks]
        assert max(reads) <= 8 and sum(reads) == 256
        reply = read_reply(client)
        client.close()
    assert reply["ok"] is True
    assert reply["record"] == engine.reference(requests, "block")


def test_a_request_larger_than_a_poll_is_read_in_slices(folder: str) -> None:
    """One request of 300 positions, more than one poll may read (max_poll_seconds): read
    8 positions a poll, each slice while the request holds the same blocks; the result
    equals the request checksummed whole. A request whose blocks move meanwhile is an
    error reply, never checksums of blocks it no longer holds."""
    requests = {"big": blocks_of(0, 300), "other": blocks_of(300, 3)}
    engine = Engine(310, requests, folder, poll_share=0.5, max_poll_seconds=0.01)
    with engine.agent:
        engine.agent._pace.seconds["checksum"] = TICK
        client = engine.ask({"op": "checksum", "requests": ["other", "big"]})
        engine.arrived(1)
        polls = 0
        while not engine.poll(16 * TICK):
            polls += 1
            assert polls < 100
        reply = read_reply(client)
        client.close()
        assert reply["ok"] is True
        assert reply["record"] == engine.reference(requests)
        assert max(engine.read) <= 8 and polls >= 300 // 8

        client = engine.ask({"op": "checksum", "requests": ["big"]})
        engine.arrived(1)
        for _ in range(5):
            assert engine.poll(16 * TICK) == 0
        start, ids = requests["big"].groups[0]
        engine.requests = {"big": RequestBlocks(300 * BLOCK, {0: (start, ids[::-1])})}
        assert engine.poll(16 * TICK) == 1
        reply = read_reply(client)
        client.close()
    assert reply["ok"] is False and "changed its blocks" in reply["error"]


def test_a_listing_is_of_one_moment_and_written_over_polls(folder: str) -> None:
    """A listing of 64 requests is copied at one poll and written a few requests a poll:
    tables changed in place after that poll do not show in it."""
    requests = {f"r{i}": blocks_of(i, 4) for i in range(64)}
    expected = json.loads(json.dumps(listing_to_json(plain_requests(requests))))
    engine = Engine(80, requests, folder, poll_share=0.5)
    written: list[str] = []
    from kvaudit.live import work

    original = work.listing_entry

    def costly(request: RequestBlocks) -> dict:
        written.append("entry")
        engine.clock.now += TICK * 4
        return original(request)

    with engine.agent, pytest.MonkeyPatch.context() as patch:
        patch.setattr(work, "listing_entry", costly)
        engine.agent._pace.seconds["list"] = TICK
        client = engine.ask({"op": "list"})
        engine.arrived(1)
        assert engine.poll(16 * TICK) == 0
        for request in requests.values():
            request.groups[0][1][0] = 79  # the engine reuses its lists in place
        requests["new"] = blocks_of(70, 2)
        polls = 1
        while not engine.poll(16 * TICK):
            polls += 1
            assert polls < 100
        reply = read_reply(client)
        client.close()
    assert reply["ok"] is True and reply["requests"] == expected
    assert polls > 8 and len(written) == 64


def test_an_answer_past_its_deadline_is_an_error_and_its_work_dropped(folder: str) -> None:
    """A checksum the engine's polls cannot finish within ``wait_timeout``: its client
    gets a one-line error saying so, and the agent reads nothing more for it."""
    requests = {f"r{i}": blocks_of(i, 4) for i in range(64)}
    engine = Engine(80, requests, folder, poll_share=0.5, wait_timeout=0.5)
    with engine.agent:
        engine.agent._pace.seconds["checksum"] = TICK
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(engine.agent.path)
            sock.sendall(frame({"op": "checksum"}))
            engine.arrived(1)
            engine.poll(16 * TICK)
            engine.poll(16 * TICK)
            read = len(engine.read)
            reply = read_reply(sock)  # the server's answer at the deadline
        assert reply["ok"] is False
        assert "within 0.5 s" in reply["error"] and "\n" not in reply["error"]
        assert engine.poll(16 * TICK) == 0
        assert len(engine.read) == read and engine.agent.waiting() == 0


def test_the_default_share_is_a_quarter(folder: str) -> None:
    """By default a poll takes at most a quarter of the engine's time since the previous
    one: 40 ticks of engine time, 10 one-block checksums answered."""
    requests = {f"r{i}": blocks_of(i, 1) for i in range(12)}
    engine = Engine(20, requests, folder)
    with engine.agent:
        clients = [engine.ask({"op": "checksum", "requests": [f"r{i}"]}) for i in range(12)]
        engine.arrived(12)
        assert [engine.poll(40 * TICK), engine.poll(40 * TICK)] == [10, 2]
        for sock in clients:
            assert read_reply(sock)["ok"] is True
            sock.close()


def test_an_engine_without_requests_lists_and_checksums_none(folder: str) -> None:
    engine = Engine(4, {}, folder)
    with engine.agent:
        for message, key in (({"op": "list"}, "requests"), ({"op": "checksum"}, "record")):
            client = engine.ask(message)
            engine.arrived(1)
            while not engine.poll(TICK):
                pass
            reply = read_reply(client)
            client.close()
            assert reply["ok"] is True
            assert (reply[key] if key == "requests" else reply[key]["requests"]) == {}
        assert reply["record"] == engine.reference({})


def test_hello_needs_no_safe_point(folder: str) -> None:
    """``hello`` reads nothing of the engine: it is answered by an agent that is never
    polled (before: it waited for a poll like the rest)."""
    engine = Engine(4, {"r": blocks_of(0, 2)}, folder)
    with engine.agent:
        reply, _ = call(engine.agent.path, {"op": "hello"}, timeout=5)
        assert reply["protocol"] == 1 and reply["rows"] == 4
        with pytest.raises(KvauditError, match="unknown op"):
            call(engine.agent.path, {"op": "exec"}, timeout=5)
        assert engine.agent.polls == 0


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "1"])
def test_a_share_or_time_that_is_not_positive_is_refused(folder: str, value: object) -> None:
    with pytest.raises(KvauditError, match="poll_share: expected a positive number"):
        Engine(4, {}, folder, poll_share=value)


def test_the_replys_record_is_the_record_codecs_bytes(folder: str) -> None:
    """The record the agent sends, assembled piece by piece, is byte for byte the compact
    JSON of the record codec's encoding of the same checksums (``records.encoding``)."""
    requests = {f"r{i}": blocks_of(2 * i, 2) for i in range(3)}
    engine = Engine(20, requests, folder, poll_share=0.5)
    with engine.agent:
        client = engine.ask({"op": "checksum", "requests": ["r2", "r0", "r1"]})
        engine.arrived(1)
        assert any(engine.poll(100 * TICK) for _ in range(50))
        data = b""
        while chunk := client.recv(1 << 20):
            data += chunk
        client.close()
    size, _ = struct.unpack(">IQ", data[:12])
    text = data[12 : 12 + size]
    reply = json.loads(text)
    named = {rid: requests[rid] for rid in ("r2", "r0", "r1")}
    summer = Checksummer(
        engine.description, {LAYER: engine.tensor}, role="consumer", source=engine.agent.path
    )
    expected = {"ok": True, "polls": reply["polls"], "record": worker_record_to_json(
        summer.checksum(named, "request"))}  # fmt: skip
    assert text == json.dumps(expected, separators=(",", ":"), allow_nan=False).encode()
