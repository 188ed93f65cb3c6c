"""The live agent: answers kvaudit's questions about a running engine's KV cache on a
local unix socket, at a point where the engine does not touch its cache.

An engine (one per worker) starts an ``Agent`` over its caches, its description, its
ranks and a function that returns the current requests' block tables. A background
thread accepts connections and reads requests (bounded in size and time); the requests
are answered at a safe point: in ``poll()``, which the engine calls at each step
boundary, or, when the engine hands over the lock it holds during its steps, on the
agent's own thread while it holds that lock. Every failure becomes an error reply; the
engine never sees an exception from a request. What the agent costs the engine is
bounded: the copies one poll makes, the reply bytes held for clients at once, the ids
one request names.
"""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

from ..checksum.checksummer import Checksummer
from ..core.errors import KvauditError
from ..core.validation import MAX_TOKENS, Role, check_int, short
from ..description import CacheDescription, description_to_dict
from ..dumps.writing import write_dump, write_dump_into
from ..records import WorkerInfo
from ..views.inputs import LayerTensors, RequestBlocks, plain_requests, tensors_by_name
from .messages import group_infos, listing_to_json, worker_record_to_json
from .protocol import OPS, PROTOCOL, request_id_list, token_limits
from .server import Reply, Server

BlockTables = Callable[[], Mapping[str, RequestBlocks]]
"""Returns the requests in the cache now: request id to its blocks (engine block ids)."""
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
    ``wait_timeout`` how long a request waits for a safe point; ``max_reply_bytes``
    bounds what one fetch or dump may copy, ``max_held_bytes`` the reply bytes held for
    clients at once (a fetch past it is answered "busy"), ``max_poll_bytes`` what one
    ``poll()`` copies before it leaves the other requests for the next one.
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
            wait_timeout: Seconds a request waits for a safe point.
            max_reply_bytes: The most bytes one fetch or dump may copy.
            max_held_bytes: The most reply bytes held for clients at once (a fetch past
                it is answered "busy").
            max_poll_bytes: What one ``poll()`` copies before it leaves the other requests
                for the next one.

        Raises:
            KvauditError: Tensors, ranks or a role that ``Checksummer`` refuses, or a
                socket it cannot listen on.
            ValueError: An unknown ``backend``, as ``Checksummer`` raises it.

        """
        self.path = os.fspath(path)
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
        # What one block holds over every layer: a copy's size, known before copying.
        self._block_bytes = sum(
            part.numel() * part.element_size()
            for tensor in self.tensors.values()
            for part in (tensor if isinstance(tensor, tuple) else (tensor,))
        ) // max(self.summer.num_blocks, 1)
        self.max_held_bytes = max_held_bytes
        self.max_poll_bytes = max_poll_bytes
        self.lock = lock
        self.polls = 0
        self._server = Server(self.path, timeout, wait_timeout)
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
        """Answer the requests that have arrived.

        The engine calls it at a step boundary, when its cache is neither written nor
        freed.

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
        answered = copied = 0
        while answered < max_requests and copied < self.max_poll_bytes:
            arrived = self._server.next_request()
            if arrived is None:
                break
            copied += self._answer(*arrived)
            answered += 1
        return answered

    def waiting(self) -> int:
        """How many requests wait for the next ``poll()``."""
        return self._server.waiting()

    def close(self) -> None:
        """Stop serving: close the socket (and remove its file) and the connections."""
        self._stop.set()
        self._closer()
        if self._handler is not None:
            self._handler.join(timeout=5)

    def _serve(self) -> None:
        """The handler thread: answer each request while holding the engine's lock."""
        assert self.lock is not None
        while not self._stop.is_set():
            arrived = self._server.next_request(wait=0.1)
            if arrived is None:
                continue
            with self.lock:
                self._answer(*arrived)

    def _answer(self, connection: int, message: dict[str, Any]) -> int:
        """Compute one reply and hand it to the server to send; the bytes it copied."""
        try:
            reply = self._handle(message)
        except KvauditError as error:
            reply = Reply({"ok": False, "error": error.message})
        except Exception as error:  # a request must never take the engine down
            text = " ".join(str(error).split())
            reply = Reply({"ok": False, "error": f"{type(error).__name__}: {text}"})
        self._server.reply(connection, reply)
        return reply.payload_size

    def _handle(self, message: dict[str, Any]) -> Reply:
        """The reply to one request (docs/live.md, "Protocol")."""
        op = message.get("op")
        if op not in OPS:
            raise KvauditError(f"unknown op {short(op)}, expected one of {', '.join(OPS)}")
        if op == "hello":
            return Reply(self._hello())
        requests = plain_requests(self.block_tables(), self.path)
        if op == "list":
            return Reply({"ok": True, "polls": self.polls, "requests": listing_to_json(requests)})
        if op == "fetch":
            return self._fetch(message, requests)
        ids = request_id_list(message.get("requests"), self.path)
        chosen = _chosen(requests, ids, token_limits(message.get("num_tokens"), self.path))
        if op == "checksum":
            positions = message.get("positions", "request")
            if positions not in ("request", "block"):
                raise KvauditError(f"positions: expected request or block, got {short(positions)}")
            record = self.summer.checksum(chosen, positions)
            return Reply({"ok": True, "polls": self.polls, "record": worker_record_to_json(record)})
        return self._dump(message, chosen)

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

    def _dump(self, message: dict[str, Any], chosen: dict[str, RequestBlocks]) -> Reply:
        """A dump of the chosen requests: written into the request's ``folder``, or, with
        none, sent back as the reply's payload."""
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

    def _fetch(self, message: dict[str, Any], requests: dict[str, RequestBlocks]) -> Reply:
        """A dump's bytes holding one request's blocks at worker positions ``lo .. hi - 1``
        of one group (``num_tokens``: the tokens the client reads)."""
        ids = request_id_list([message.get("request")], self.path, "request") or []
        request = requests.get(ids[0])
        if request is None:
            raise KvauditError(f"request {ids[0]!r} is not in the cache now")
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
            raise KvauditError(
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
        per_block = self._block_bytes
        size = len(blocks) * per_block
        if size > self.max_reply_bytes:
            raise KvauditError(
                f"{len(blocks)} blocks of {per_block} bytes: more than the "
                f"{self.max_reply_bytes} bytes one request may copy"
            )
        return size


def _chosen(
    requests: Mapping[str, RequestBlocks], ids: list[str] | None, limits: Mapping[str, int]
) -> dict[str, RequestBlocks]:
    """The named requests (all when ``ids`` is None), each cut to its token limit."""
    if ids is None:
        ids = list(requests)
    missing = [rid for rid in ids if rid not in requests]
    if missing:
        raise KvauditError(f"request {missing[0]!r} is not in the cache now")
    return {
        rid: RequestBlocks(
            min(requests[rid].num_tokens, limits.get(rid, MAX_TOKENS)), requests[rid].groups
        )
        for rid in ids
    }
