"""The agent's socket side: a private unix socket, and a thread that accepts
connections, reads one bounded request from each and sends its reply, never blocking the
engine.

Each connection carries one request frame (JSON, no payload) and gets one reply frame;
a client may half-close its end after the request. A connection that sends more than
``MAX_REQUEST_JSON`` bytes, a payload, or does not finish within the timeout gets an
error reply (when it can still be sent) and is closed. Reply payloads are streamed from
their files to the socket (``sendfile``), never held in memory.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import selectors
import socket
import stat
import threading
import time
from collections.abc import Mapping
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
    {"ok": False, "error": f"busy: {MAX_CONNECTIONS} connections are open, try again later"}
)


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
    is dropped with it, never computed); ``reply`` sends the answer.

    Every connection has a deadline: ``timeout`` seconds to send its request, then
    ``wait_timeout`` seconds in the queue for the engine's safe point (past it the
    server itself answers with an error), then ``timeout`` seconds to take its reply.
    ``held_bytes`` says how many bytes of replies wait for their clients.
    """

    def __init__(self, path: str, timeout: float, wait_timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.wait_timeout = wait_timeout
        self._arrived: queue.Queue[int] = queue.Queue()
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
        self._replies: dict[int, Reply] = {}
        self._requests: dict[int, dict[str, Any]] = {}
        self._connections: dict[int, _Connection] = {}
        self._held = 0
        self._next = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvaudit-agent-io", daemon=True)
        self._thread.start()

    def next_request(self, wait: float = 0.0) -> tuple[int, dict[str, Any]] | None:
        """The next request of a client still connected, ``(connection, message)``,
        waiting up to ``wait`` seconds for one; None when none came."""
        while True:
            try:
                connection = self._arrived.get(timeout=wait) if wait else self._arrived.get_nowait()
            except queue.Empty:
                return None
            with self._lock:
                message = self._requests.pop(connection, None)
            if message is not None:
                return connection, message

    def waiting(self) -> int:
        """How many requests of clients still connected wait for an answer."""
        with self._lock:
            return len(self._requests)

    def held_bytes(self) -> int:
        """The bytes of replies given to ``reply`` that their clients have not yet taken
        (in memory and in their payload files)."""
        with self._lock:
            return self._held

    def reply(self, connection: int, reply: Reply) -> None:
        """Queue a reply for the connection (dropped if it has gone) and wake the thread."""
        with self._lock:
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
        conn.waiting = True
        conn.inbox = bytearray()
        conn.deadline = time.monotonic() + self.wait_timeout
        with self._lock:
            self._requests[cid] = message
        self._arrived.put(cid)

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
            if cid in self._connections:
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
        """Close connections past their deadline; a queued request past its own gets an
        error reply instead of waiting for ever for an engine that does not poll, and a
        half-closed client that has gone since takes its request with it."""
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
                if queued:
                    text = (
                        f"the engine reached no safe point within {self.wait_timeout:g} s "
                        "(it does not poll the agent, or its steps are this long)"
                    )
                    self._send(selector, cid, Reply({"ok": False, "error": text}))
                # Else the engine is computing its reply now: it comes.

    def _release(self, reply: Reply) -> None:
        with self._lock:
            self._held -= reply.size
        reply.close()

    def _drop(self, selector: selectors.BaseSelector, cid: int) -> None:
        conn = self._connections.pop(cid, None)
        if conn is None:
            return
        with self._lock:
            # A request not taken yet goes with its client: nobody would read the answer.
            self._requests.pop(cid, None)
        if conn.reply is not None:
            self._release(conn.reply)
        if conn.registered:
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn.sock)
        conn.sock.close()
