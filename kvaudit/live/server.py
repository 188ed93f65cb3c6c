"""The agent's socket side: a private unix socket, and a thread that accepts
connections, reads one bounded request from each and sends its reply, never blocking the
engine.

Each connection carries one request frame (JSON, no payload) and gets one reply frame;
a client may half-close its end after the request. A connection that sends more than
``MAX_REQUEST_JSON`` bytes, a payload, or does not finish within the timeout gets an
error reply (when it can still be sent) and is closed. Reply payloads are streamed from
their files to the socket (``sendfile``), never held in memory. A request that needs
nothing of the engine (``instant``) is answered on this thread; the others wait for the
agent, which takes them at the engine's safe points, within a deadline.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ..core.errors import KvauditError
from .protocol import (
    HEADER,
    MAX_REQUEST_JSON,
    decode_json,
    encode_frame,
    encode_header,
    frame_sizes,
)

MAX_CONNECTIONS = 64
"""The most connections open at once; more get an error reply and are closed at once."""
_PIECE = 1 << 22
"""The most bytes one write hands the socket."""
_BUSY = encode_frame(
    {
        "ok": False,
        "busy": True,
        "error": f"busy: {MAX_CONNECTIONS} connections are open, try again later",
    }
)
Instant = Callable[[dict[str, Any]], "Reply | None"]
"""Answers a request on the I/O thread when it needs nothing of the engine; else None."""


def check_private_folder(folder: str) -> None:
    """Create ``folder`` (mode 0700) if missing, and refuse one the user does not own or
    that others may write to.

    Raises:
        KvauditError: The folder is someone else's or group/world-writable.

    """
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.stat(folder)
    if info.st_uid != os.getuid():
        raise KvauditError("the socket's folder belongs to another user", folder)
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KvauditError("the socket's folder is writable by others (expected 0700)", folder)


def _remove_stale(path: str) -> None:
    """Remove a socket file left by a dead agent; refuse a live one or another file."""
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise KvauditError("exists and is not a socket", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise KvauditError("another agent is listening on this socket", path)


class Reply:
    """One reply frame on its way to a client: the header and JSON in memory, then the
    payload streamed from a file (a dump written for the reply, never read whole)."""

    def __init__(self, message: Mapping[str, Any], payload: BinaryIO | None = None) -> None:
        self.payload = payload
        self.payload_size = os.fstat(payload.fileno()).st_size if payload is not None else 0
        self.head = encode_header(message, self.payload_size)

    @classmethod
    def of_json(cls, text: bytes | list[bytes]) -> Reply:
        """A reply of JSON text already encoded (compact, UTF-8; or its pieces, joined
        here in one copy), without a payload."""
        pieces = [text] if isinstance(text, bytes) else text
        reply = cls.__new__(cls)
        reply.payload, reply.payload_size = None, 0
        reply.head = b"".join([HEADER.pack(sum(map(len, pieces)), 0), *pieces])
        return reply

    @property
    def size(self) -> int:
        """The frame's bytes: header, JSON and payload."""
        return len(self.head) + self.payload_size

    def close(self) -> None:
        """Release the payload's file (an unnamed temporary file: its bytes go with it)."""
        if self.payload is not None:
            self.payload.close()


@dataclass
class _Connection:
    """One client's connection and where it stands: reading its request, waiting for
    the engine's answer (``waiting``), or receiving the reply (``reply``)."""

    sock: socket.socket
    deadline: float
    arrived: float = 0.0
    inbox: bytearray = field(default_factory=bytearray)
    reply: Reply | None = None
    sent: int = 0
    waiting: bool = False
    half_closed: bool = False
    registered: bool = True


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer has closed its end entirely (not only half-closed its writing)."""
    probe = select.poll()
    probe.register(sock, select.POLLOUT)
    return any(events & (select.POLLHUP | select.POLLERR) for _, events in probe.poll(0))


class Server:
    """Listens on ``path`` (mode 0600, in a private folder) on a thread of its own;
    ``next_request`` gives each complete request in turn (a request whose client has gone
    is dropped with it, never computed); ``reply`` sends the answer. ``instant``, when
    given, answers on this thread the requests that need nothing of the engine.

    Every connection has a deadline: ``timeout`` seconds to send its request, then
    ``wait_timeout`` seconds for its answer, queued or being computed over the engine's
    safe points (past it the server itself answers with an error, and ``wanted`` tells
    the agent to drop the work), then ``timeout`` seconds to take its reply.
    ``held_bytes`` says how many bytes of replies wait for their clients.
    """

    def __init__(
        self, path: str, timeout: float, wait_timeout: float, instant: Instant | None = None
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.wait_timeout = wait_timeout
        self._instant = instant
        self._arrived: deque[int] = deque()
        check_private_folder(os.path.dirname(os.path.abspath(path)))
        _remove_stale(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # No umask change (it is the whole process's, other threads create files): the
            # folder is private, so nobody else reaches the socket before its chmod.
            self.listener.bind(path)
            os.chmod(path, 0o600)
        except OSError as error:
            self.listener.close()
            raise KvauditError(f"cannot listen: {error.strerror or error}", path) from None
        self.listener.listen(MAX_CONNECTIONS)
        self.listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._replies: dict[int, Reply] = {}
        self._requests: dict[int, dict[str, Any]] = {}
        # Requests the agent took and has not answered yet, while their clients wait.
        self._taken: set[int] = set()
        self._safe_point = float("-inf")
        self._connections: dict[int, _Connection] = {}
        self._held = 0
        self._next = 0
        self.refused = 0
        """Connections refused as busy (``MAX_CONNECTIONS`` open) so far."""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvaudit-agent-io", daemon=True)
        self._thread.start()

    def next_request(self, wait: float = 0.0) -> tuple[int, dict[str, Any]] | None:
        """The next request of a client still connected, ``(connection, message)``,
        waiting up to ``wait`` seconds for one; None when none came. The request is the
        caller's to answer (``reply``) while ``wanted`` says so."""
        with self._queued:
            if wait and not self._arrived:
                self._queued.wait(wait)
            while self._arrived:
                connection = self._arrived.popleft()
                message = self._requests.pop(connection, None)
                if message is not None:
                    self._taken.add(connection)
                    return connection, message
            return None

    def has_request(self, wait: float = 0.0) -> bool:
        """Whether a request is queued, waiting up to ``wait`` seconds for one."""
        with self._queued:
            if wait and not self._requests:
                self._queued.wait(wait)
            return bool(self._requests)

    def wanted(self, connection: int) -> bool:
        """Whether a request taken with ``next_request`` still wants its answer: its
        client is connected and its deadline has not passed."""
        with self._lock:
            return connection in self._taken

    def safe_point(self) -> None:
        """Note that the agent reached a safe point (for the message of a request that
        waits past its deadline)."""
        self._safe_point = time.monotonic()

    def waiting(self) -> int:
        """How many requests of clients still connected wait in the queue."""
        with self._lock:
            return len(self._requests)

    def held_bytes(self) -> int:
        """The bytes of replies given to ``reply`` that their clients have not yet taken
        (in memory and in their payload files)."""
        with self._lock:
            return self._held

    def reply(self, connection: int, reply: Reply) -> None:
        """Queue a reply for the connection (dropped if it has gone or was answered past
        its deadline) and wake the thread."""
        with self._lock:
            if connection not in self._taken:
                reply.close()
                return
            self._taken.discard(connection)
            self._replies[connection] = reply
            self._held += reply.size
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def close(self) -> None:
        """Stop the thread, close every socket and remove the socket file."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._thread.join(timeout=5)
        for conn in self._connections.values():
            conn.sock.close()
            if conn.reply is not None:
                conn.reply.close()
        with self._lock:
            for reply in self._replies.values():
                reply.close()
            self._replies.clear()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, "listen")
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        while not self._closed:
            for key, events in selector.select(timeout=0.2):
                if key.data == "listen":
                    self._accept(selector)
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                elif events & selectors.EVENT_READ:
                    self._read(selector, key.data)
                if isinstance(key.data, int) and events & selectors.EVENT_WRITE:
                    self._write(selector, key.data)
            self._take_replies(selector)
            self._expire(selector)
        selector.close()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return
            if len(self._connections) >= MAX_CONNECTIONS:
                self.refused += 1
                # One short frame fits the socket's buffer: the client learns why.
                with contextlib.suppress(OSError):
                    sock.setblocking(False)
                    sock.send(_BUSY)
                sock.close()
                continue
            sock.setblocking(False)
            self._next += 1
            self._connections[self._next] = _Connection(sock, time.monotonic() + self.timeout)
            selector.register(sock, selectors.EVENT_READ, self._next)

    def _read(self, selector: selectors.BaseSelector, cid: int) -> None:
        conn = self._connections.get(cid)
        if conn is None:
            return
        try:
            data = conn.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            self._drop(selector, cid)
            return
        if not data:
            self._end_of_request(selector, cid, conn)
            return
        if conn.waiting or conn.reply is not None:
            # Bytes after its one request: the connection is done.
            self._drop(selector, cid)
            return
        conn.inbox += data
        if len(conn.inbox) < HEADER.size:
            return
        try:
            size, _ = frame_sizes(bytes(conn.inbox[: HEADER.size]), MAX_REQUEST_JSON, 0, "request")
            end = HEADER.size + size
            if len(conn.inbox) > end:
                raise KvauditError("request: bytes after the frame", "request")
            if len(conn.inbox) < end:
                return
            message = decode_json(bytes(conn.inbox[HEADER.size : end]), "request")
        except KvauditError as error:
            self._send(selector, cid, Reply({"ok": False, "error": error.message}))
            return
        conn.inbox = bytearray()
        instant = self._answer_instantly(message)
        if instant is not None:
            self._send(selector, cid, instant)
            return
        conn.waiting = True
        conn.arrived = time.monotonic()
        conn.deadline = conn.arrived + self.wait_timeout
        with self._queued:
            self._requests[cid] = message
            self._arrived.append(cid)
            self._queued.notify()

    def _answer_instantly(self, message: dict[str, Any]) -> Reply | None:
        """``instant``'s reply, or its failure as an error reply; None when the request
        waits for the agent."""
        if self._instant is None:
            return None
        try:
            return self._instant(message)
        except KvauditError as error:
            return Reply({"ok": False, "error": error.message})
        except Exception as error:  # this thread must keep serving whatever happens
            text = " ".join(str(error).split())
            return Reply({"ok": False, "error": f"{type(error).__name__}: {text}"})

    def _end_of_request(
        self, selector: selectors.BaseSelector, cid: int, conn: _Connection
    ) -> None:
        """The client stopped writing: gone (its request goes with it), or half-closed,
        which still gets its reply (and an error reply for a request cut short)."""
        if _hung_up(conn.sock) or conn.half_closed:
            self._drop(selector, cid)
            return
        conn.half_closed = True
        # Its end of the stream stays readable for ever: stop watching it until a reply
        # is to be written.
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn.sock)
        conn.registered = False
        if not conn.waiting and conn.reply is None:
            got = len(conn.inbox)
            self._send(
                selector,
                cid,
                Reply({"ok": False, "error": f"request: closed after {got} bytes, mid-frame"}),
            )

    def _take_replies(self, selector: selectors.BaseSelector) -> None:
        with self._lock:
            replies, self._replies = self._replies, {}
        for cid, reply in replies.items():
            conn = self._connections.get(cid)
            if conn is not None and conn.waiting:
                self._send(selector, cid, reply, held=True)
            else:
                self._release(reply)

    def _send(
        self, selector: selectors.BaseSelector, cid: int, reply: Reply, held: bool = False
    ) -> None:
        """Start writing ``reply`` (``held``: already counted in ``held_bytes``)."""
        if not held:
            with self._lock:
                self._held += reply.size
        conn = self._connections[cid]
        conn.reply, conn.sent, conn.waiting = reply, 0, False
        conn.deadline = time.monotonic() + self.timeout
        if conn.registered:
            selector.modify(conn.sock, selectors.EVENT_WRITE, cid)
        else:
            selector.register(conn.sock, selectors.EVENT_WRITE, cid)
            conn.registered = True

    def _write(self, selector: selectors.BaseSelector, cid: int) -> None:
        conn = self._connections.get(cid)
        if conn is None or conn.reply is None:
            return
        reply = conn.reply
        try:
            if conn.sent < len(reply.head):
                sent = conn.sock.send(memoryview(reply.head)[conn.sent : conn.sent + _PIECE])
            else:
                assert reply.payload is not None
                offset = conn.sent - len(reply.head)
                count = min(reply.payload_size - offset, _PIECE)
                sent = os.sendfile(conn.sock.fileno(), reply.payload.fileno(), offset, count)
                if not sent:
                    raise OSError("the reply's payload file ended early")
        except BlockingIOError:
            return
        except OSError:
            self._drop(selector, cid)
            return
        conn.sent += sent
        if conn.sent >= reply.size:
            self._drop(selector, cid)

    def _expire(self, selector: selectors.BaseSelector) -> None:
        """Close connections past their deadline; a request past its own gets an error
        reply instead of waiting for ever (for an engine that does not poll, or for an
        answer that needs more of the engine's time than it had), and a half-closed
        client that has gone since takes its request with it."""
        now = time.monotonic()
        for cid, conn in list(self._connections.items()):
            if conn.waiting and conn.half_closed and _hung_up(conn.sock):
                self._drop(selector, cid)
            elif now <= conn.deadline:
                continue
            elif not conn.waiting:
                self._drop(selector, cid)
            else:
                with self._lock:
                    queued = self._requests.pop(cid, None) is not None
                    taken = cid in self._taken
                    self._taken.discard(cid)
                if queued or taken:
                    text = self._late(queued, conn.arrived)
                    self._send(selector, cid, Reply({"ok": False, "error": text}))
                # Else the agent has just answered: its reply comes.

    def _late(self, queued: bool, arrived: float) -> str:
        """Why a request got no answer within ``wait_timeout``."""
        within = f"within {self.wait_timeout:g} s"
        if not queued:
            return (
                f"no answer {within}: the agent computes answers in its share of the "
                "engine's time, and this one needed more; ask about fewer requests"
            )
        if self._safe_point < arrived:
            return (
                f"the engine reached no safe point {within} "
                "(it does not poll the agent, or its steps are this long)"
            )
        return (
            f"no answer {within}: the requests before it took the agent's share of the "
            "engine's time; try again later"
        )

    def _release(self, reply: Reply) -> None:
        with self._lock:
            self._held -= reply.size
        reply.close()

    def _drop(self, selector: selectors.BaseSelector, cid: int) -> None:
        conn = self._connections.pop(cid, None)
        if conn is None:
            return
        with self._lock:
            # A request not answered yet goes with its client: nobody would read the answer.
            self._requests.pop(cid, None)
            self._taken.discard(cid)
        if conn.reply is not None:
            self._release(conn.reply)
        if conn.registered:
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn.sock)
        conn.sock.close()
