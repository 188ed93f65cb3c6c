"""The live agent: answers kvaudit's questions about a running engine's KV cache on a
local unix socket, at a point where the engine does not touch its cache.

An engine (one per worker) starts an ``Agent`` over its caches, its description, its
ranks and a function that returns the current requests' block tables. A background
thread accepts connections and reads requests (bounded in size and time); the requests
are answered at a safe point: in ``poll()``, which the engine calls at each step
boundary, or, when the engine hands over the lock it holds during its steps, on the
agent's own thread while it holds that lock. ``hello`` needs nothing of the engine and
is answered on the I/O thread. Every failure becomes an error reply; the engine never
sees an exception from a request. What the agent costs the engine is bounded: in time,
each safe point takes at most ``poll_share`` of the engine's time since the previous one
(answers are split into units, ``work``); in bytes, the copies one poll makes and the
reply bytes held for clients at once; the ids one request names.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any, BinaryIO

from ..checksum.checksummer import Checksummer
from ..core.errors import KvauditError
from ..core.validation import MAX_TOKENS, Role, check_int, short
from ..description import CacheDescription, description_to_dict
from ..dumps.writing import dump_bytes, write_dump, write_dump_into
from ..records import WorkerInfo
from ..views.inputs import LayerTensors, RequestBlocks, plain_requests, tensors_by_name
from .messages import group_infos
from .protocol import OPS, PROTOCOL, encode_header, request_id_list, token_limits
from .server import Reply, Server
from .work import BlockTables, Busy, ChecksumJob, Job, ListJob, OnceJob, Pace, SafePoint

__all__ = ["MAX_FETCH_BLOCKS", "Agent", "BlockTables", "socket_path"]

MAX_FETCH_BLOCKS = 4096
"""The most block positions one fetch returns."""


def socket_path(engine: str, pp_rank: int = 0, tp_rank: int = 0, root: str = "/run/kvaudit") -> str:
    """The conventional socket of a worker: ``ROOT/ENGINE/ppP-tpT.sock``.

    Args:
        engine: The engine's folder under ``root``.
        pp_rank: The worker's PP rank.
        tp_rank: The worker's TP rank.
        root: The folder of every engine's sockets.

    Returns:
        The socket's path (nothing is created).

    """
    return os.path.join(root, engine, f"pp{pp_rank}-tp{tp_rank}.sock")


class Agent:
    """Serves one worker's cache on a unix socket (docs/live.md).

    ``lock``: None to answer in ``poll()`` (call it at each step boundary); else a lock
    the engine holds during each step, and the agent answers on its own thread while it
    holds it. ``timeout`` bounds each connection's reading and writing (seconds),
    ``wait_timeout`` how long a request waits for its answer; ``max_reply_bytes``
    bounds what one fetch or dump may copy, ``max_held_bytes`` the reply bytes held for
    clients at once (a request past it is answered "busy"), ``max_poll_bytes`` what one
    ``poll()`` copies before it leaves the other requests for the next one.
    ``poll_share`` bounds a safe point's time: at most that share of the engine's time
    since the previous one (and never more than ``max_poll_seconds`` at once), the rest
    of the work left for the next ones.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        description: CacheDescription,
        tensors: LayerTensors,
        block_tables: BlockTables,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        role: Role = "consumer",
        engine: str = "",
        backend: str = "auto",
        lock: threading.Lock | threading.RLock | None = None,
        timeout: float = 10.0,
        wait_timeout: float = 30.0,
        max_reply_bytes: int = 1 << 30,
        max_held_bytes: int = 256 << 20,
        max_poll_bytes: int = 64 << 20,
        poll_share: float = 0.25,
        max_poll_seconds: float = 0.05,
    ) -> None:
        """Build the worker's checksummer and listen on ``path``.

        With a ``lock``, the agent's thread starts answering at once.

        Args:
            path: The unix socket the agent listens on (``socket_path`` gives the
                conventional one).
            description: The worker's cache description.
            tensors: The worker's layer tensors, as ``Checksummer`` takes them.
            block_tables: Returns the requests in the cache now: request id to its blocks
                (engine block ids).
            tp_rank: The worker's TP rank.
            tp_size: The engine's TP size.
            pp_rank: The worker's PP rank.
            pp_size: The engine's PP size.
            role: As ``Checksummer`` takes it.
            engine: The engine's name, kept in records and dumps.
            backend: As ``Checksummer`` takes it.
            lock: None to answer in ``poll()``; else the lock the engine holds during
                each step, which the agent's thread holds while it answers.
            timeout: Seconds each connection's reading and writing may take.
            wait_timeout: Seconds a request waits for its answer (queued, and computed
                over the engine's safe points); past it, an error reply.
            max_reply_bytes: The most bytes one fetch or dump may copy.
            max_held_bytes: The most reply bytes held for clients at once (a fetch past
                it is answered "busy").
            max_poll_bytes: What one ``poll()`` copies before it leaves the other requests
                for the next one.
            poll_share: The most time a safe point takes, as a share of the engine's time
                since the previous one (0.25: the agent takes at most a fifth of the
                engine's thread while clients ask; the engine keeps four fifths of its
                step rate, less what the agent's I/O thread costs).
            max_poll_seconds: The most seconds one safe point takes (past one unit of
                work that cannot be split, repaid at the next ones).

        Raises:
            KvauditError: Tensors, ranks or a role that ``Checksummer`` refuses, a share
                or time that is not a positive number, or a socket it cannot listen on.
            ValueError: An unknown ``backend``, as ``Checksummer`` raises it.

        """
        self.path = os.fspath(path)
        for name, value in (("poll_share", poll_share), ("max_poll_seconds", max_poll_seconds)):
            if not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
                raise KvauditError(f"{name}: expected a positive number, got {short(value)}")
        self.description = description
        self.tensors = tensors_by_name(description, tensors, self.path)
        self.block_tables = block_tables
        self.worker = WorkerInfo(tp_rank, tp_size, pp_rank, pp_size, role, engine, self.path)
        self.summer = Checksummer(
            description,
            self.tensors,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            role=role,
            backend=backend,
            engine=engine,
            source=self.path,
        )
        self.max_reply_bytes = max_reply_bytes
        self.max_held_bytes = max_held_bytes
        self.max_poll_bytes = max_poll_bytes
        self.poll_share = float(poll_share)
        self.max_poll_seconds = float(max_poll_seconds)
        self.lock = lock
        self.polls = 0
        self._hello_text = encode_header(self._hello(), 0)[12:]
        self._jobs: deque[Job] = deque()
        self._pace = Pace()
        # Seconds of the engine's time the agent may still take (negative: owed, after a
        # unit that could not be split), and when it last gave the engine back its time.
        self._clock = time.perf_counter
        self._credit = 0.0
        self._rested = self._clock()
        self._server = Server(self.path, timeout, wait_timeout, instant=self._instant)
        # An engine that ends without close() (or drops the agent) still removes its
        # socket file when the interpreter exits.
        self._closer = weakref.finalize(self, self._server.close)
        self._handler: threading.Thread | None = None
        self._stop = threading.Event()
        if lock is not None:
            self._handler = threading.Thread(target=self._serve, name="kvaudit-agent", daemon=True)
            self._handler.start()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll(self, max_requests: int = 16) -> int:
        """Work on the requests that have arrived, within this safe point's time.

        The engine calls it at a step boundary, when its cache is neither written nor
        freed. It takes at most ``poll_share`` of the engine's time since the previous
        call (``max_poll_seconds`` at most; one unit of work that cannot be split may
        pass it, and the next calls repay it): the rest of the work waits for them.

        Args:
            max_requests: The most requests answered in this call; so is what their
                replies copy (``max_poll_bytes``, past the first): the rest wait for the
                next call.

        Returns:
            How many requests it answered.

        """
        self.polls += 1
        if self.lock is not None:
            return 0
        return self._work(max_requests)

    def waiting(self) -> int:
        """How many requests wait for the next ``poll()``: queued, or partly answered."""
        return self._server.waiting() + len(self._jobs)

    def close(self) -> None:
        """Stop serving: close the socket (and remove its file) and the connections."""
        self._stop.set()
        self._closer()
        if self._handler is not None:
            self._handler.join(timeout=5)

    def _serve(self) -> None:
        """The handler thread: work on the requests while holding the engine's lock, for
        at most ``poll_share`` of the time it leaves the lock to the engine."""
        assert self.lock is not None
        while not self._stop.is_set():
            if not self._jobs and not self._server.has_request(wait=0.1):
                continue
            owed = -(self._credit + self.poll_share * (self._clock() - self._rested))
            if owed >= 0:
                # The engine's share first: the lock is left to it until the time is repaid.
                self._stop.wait(min(owed / self.poll_share + 1e-4, 0.1))
                continue
            with self.lock:
                self._work(1 << 30)

    def _work(self, max_requests: int) -> int:
        """One safe point: units of the requests in arrival order while this safe point
        has time left; how many requests it answered."""
        now = self._clock()
        earned = self.poll_share * max(now - self._rested, 0.0)
        self._credit = min(self._credit + earned, self.max_poll_seconds)
        self._server.safe_point()
        point = SafePoint(self.block_tables, self.path)
        answered = copied = 0
        try:
            while self._credit > 0 and answered < max_requests and copied < self.max_poll_bytes:
                job = self._next_job()
                if job is None:
                    break
                start = self._clock()
                reply = self._step(job, point)
                spent = self._clock() - start
                self._credit -= spent
                self._pace.learn(job.kind, job.blocks, spent)
                if reply is not None:
                    self._jobs.popleft()
                    self._server.reply(job.connection, reply)
                    answered += 1
                    copied += reply.payload_size
        finally:
            self._rested = self._clock()
        return answered

    def _next_job(self) -> Job | None:
        """The oldest request whose client still wants its answer (work for one that has
        gone, or is past its deadline, is dropped), else the next arrived; None when
        there is none."""
        while self._jobs:
            if self._server.wanted(self._jobs[0].connection):
                return self._jobs[0]
            self._jobs.popleft()
        arrived = self._server.next_request()
        if arrived is None:
            return None
        self._jobs.append(self._start(*arrived))
        return self._jobs[0]

    def _step(self, job: Job, point: SafePoint) -> Reply | None:
        """One unit of a job; its failure as an error reply."""
        job.blocks = 0
        try:
            return job.step(point, self._credit)
        except Exception as error:  # a request must never take the engine down
            return _error_reply(error)

    def _start(self, connection: int, message: dict[str, Any]) -> Job:
        """The job of one request (docs/live.md, "Protocol"); a request refused at once
        is a job whose one unit is its error reply."""
        op = message.get("op")
        try:
            if op == "list":
                self._check_held()
                return ListJob(connection, self.path, self._pace, lambda: self.polls)
            if op == "checksum":
                self._check_held()
                return ChecksumJob(
                    connection,
                    message,
                    self.summer,
                    self._pace,
                    lambda: self.polls,
                    self.max_poll_seconds,
                )
            if op == "fetch":
                return OnceJob(connection, lambda point: self._fetch(message, point.tables()))
            if op == "dump":
                return OnceJob(connection, lambda point: self._dump(message, point.tables()))
            # The I/O thread answers the others itself; a server without it would not.
            reply = self._instant(message) or Reply.of_json(self._hello_text)
        except Exception as error:
            reply = _error_reply(error)
        return OnceJob(connection, lambda point: reply)

    def _check_held(self) -> None:
        """Refuse a request with a JSON reply while replies and answers being written
        already hold ``max_held_bytes``."""
        held = self._server.held_bytes() + sum(job.held for job in self._jobs)
        if held >= self.max_held_bytes:
            raise Busy(
                f"busy: {held} bytes of replies wait for their clients (at most "
                f"{self.max_held_bytes} at once), try again later"
            )

    def _instant(self, message: dict[str, Any]) -> Reply | None:
        """The reply to a request that needs nothing of the engine (``hello``, or an
        unknown op), on the I/O thread; None for the others."""
        op = message.get("op")
        if op not in OPS:
            raise KvauditError(f"unknown op {short(op)}, expected one of {', '.join(OPS)}")
        if op == "hello":
            return Reply.of_json(self._hello_text)
        return None

    def _hello(self) -> dict[str, Any]:
        worker = self.worker
        return {
            "ok": True,
            "protocol": PROTOCOL,
            "worker": {
                "tp_rank": worker.tp_rank,
                "tp_size": worker.tp_size,
                "pp_rank": worker.pp_rank,
                "pp_size": worker.pp_size,
                "role": worker.role,
                "engine": worker.engine,
            },
            "rows": self.summer.num_blocks,
            "description": description_to_dict(self.description),
            "groups": group_infos(self.summer.groups, self.tensors),
        }

    def _dump(self, message: dict[str, Any], tables: Mapping[str, RequestBlocks]) -> Reply:
        """A dump of the requests it names (every request when none): written into the
        request's ``folder``, or, with none, sent back as the reply's payload."""
        ids = request_id_list(message.get("requests"), self.path)
        limits = token_limits(message.get("num_tokens"), self.path)
        chosen = _chosen(tables, ids, limits, self.path)
        folder = message.get("folder")
        if folder is None:
            return self._payload(chosen)
        if not isinstance(folder, str) or not os.path.isabs(folder) or not os.path.isdir(folder):
            raise KvauditError(f"folder: expected an existing absolute folder, got {short(folder)}")
        worker = self.worker
        target = os.path.join(folder, f"pp{worker.pp_rank}-tp{worker.tp_rank}.safetensors")
        if os.path.lexists(target):
            raise KvauditError(f"{target} exists; dumps are written to a new file")
        self._check_size(chosen)
        write_dump(target, self.description, self.tensors, chosen, worker=worker)
        return Reply({"ok": True, "polls": self.polls, "path": target})

    def _fetch(self, message: dict[str, Any], tables: Mapping[str, RequestBlocks]) -> Reply:
        """A dump's bytes holding one request's blocks at worker positions ``lo .. hi - 1``
        of one group (``num_tokens``: the tokens the client reads)."""
        ids = request_id_list([message.get("request")], self.path, "request") or []
        request = _chosen(tables, ids, {}, self.path)[ids[0]]
        group = check_int(message.get("group"), self.path, "group", 0, 1 << 20)
        lo = check_int(message.get("lo"), self.path, "lo", 0, MAX_TOKENS)
        hi = check_int(message.get("hi"), self.path, "hi", lo + 1, lo + MAX_FETCH_BLOCKS)
        num_tokens = check_int(message.get("num_tokens"), self.path, "num_tokens", 1, MAX_TOKENS)
        if group not in request.groups:
            raise KvauditError(f"request {ids[0]!r} has no blocks of group {group} now")
        start, block_ids = request.groups[group]
        if lo < start or hi > start + len(block_ids):
            raise KvauditError(
                f"request {ids[0]!r} group {group}: positions {lo}..{hi - 1} are not all "
                f"held now (held: {start}..{start + len(block_ids) - 1})"
            )
        chosen = {
            ids[0]: RequestBlocks(
                min(num_tokens, request.num_tokens),
                {group: (lo, block_ids[lo - start : hi - start])},
            )
        }
        return self._payload(chosen)

    def _payload(self, chosen: Mapping[str, RequestBlocks]) -> Reply:
        """A reply whose payload is a dump of the chosen blocks, in a file the server
        streams to the client: never held in memory whole."""
        size = self._check_size(chosen)
        held = self._server.held_bytes()
        if held and held + size > self.max_held_bytes:
            raise Busy(
                f"busy: {held} bytes of replies wait for their clients (at most "
                f"{self.max_held_bytes} at once), try again later"
            )
        # An unnamed temporary file: nothing is left behind, whatever ends the engine.
        file: BinaryIO = tempfile.TemporaryFile(prefix="kvaudit-fetch-")  # noqa: SIM115 (the reply owns it)
        try:
            write_dump_into(
                file, self.path, self.description, self.tensors, chosen, worker=self.worker
            )
            file.flush()
        except BaseException:
            file.close()
            raise
        return Reply({"ok": True, "polls": self.polls}, file)

    def _check_size(self, chosen: Mapping[str, RequestBlocks]) -> int:
        """The bytes a dump or fetch of the chosen blocks copies; refused past
        ``max_reply_bytes``."""
        blocks = {
            b for request in chosen.values() for _, ids in request.groups.values() for b in ids
        }
        # Each group's layers hold its own block space: a copy's size, known before copying.
        size = dump_bytes(self.description, self.tensors, chosen.values())
        if size > self.max_reply_bytes:
            raise KvauditError(
                f"{len(blocks)} blocks, {size} bytes: more than the "
                f"{self.max_reply_bytes} bytes one request may copy"
            )
        return size


def _chosen(
    tables: Mapping[str, RequestBlocks],
    ids: list[str] | None,
    limits: Mapping[str, int],
    source: str,
) -> dict[str, RequestBlocks]:
    """The named requests (all when ``ids`` is None) with plain block ids, each cut to its
    token limit; only these are read from the block tables."""
    if ids is None:
        ids = list(tables)
    missing = [rid for rid in ids if rid not in tables]
    if missing:
        raise KvauditError(f"request {missing[0]!r} is not in the cache now")
    requests = plain_requests({rid: tables[rid] for rid in ids}, source)
    return {
        rid: RequestBlocks(min(request.num_tokens, limits.get(rid, MAX_TOKENS)), request.groups)
        for rid, request in requests.items()
    }


def _error_reply(error: Exception) -> Reply:
    """An error reply saying what went wrong in one line (``"busy": true`` for a request
    refused for now)."""
    if isinstance(error, KvauditError):
        busy = {"busy": True} if isinstance(error, Busy) else {}
        return Reply({"ok": False, "error": error.message, **busy})
    text = " ".join(str(error).split())
    return Reply({"ok": False, "error": f"{type(error).__name__}: {text}"})
