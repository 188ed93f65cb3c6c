"""The agent's socket side: a private unix socket, and a thread that accepts
connections, reads one bounded request from each and sends its reply, never blocking the
engine.

Each connection carries one request frame (JSON, no payload) and gets one reply frame.
A connection that sends more than ``MAX_REQUEST_JSON`` bytes, a payload, or does not
finish within the timeout gets an error reply (when it can still be sent) and is closed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import socket
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import KvauditError
from .protocol import HEADER, MAX_REQUEST_JSON, decode_json, encode_frame, frame_sizes

MAX_CONNECTIONS = 64
"""The most connections open at once; more get an error reply and are closed at once."""
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


@dataclass
class _Connection:
    sock: socket.socket
    deadline: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytes = b""
    sent: int = 0
    waiting: bool = False


class Server:
    """Listens on ``path`` (mode 0600, in a private folder) on a thread of its own;
    ``next_request`` gives each complete request in turn (a request whose client has gone
    is dropped with it, never computed); ``reply`` sends the answer."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
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
        self.listener.listen(16)
        self.listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._lock = threading.Lock()
        self._replies: dict[int, bytes] = {}
        self._requests: dict[int, dict[str, Any]] = {}
        self._connections: dict[int, _Connection] = {}
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

    def reply(self, connection: int, message: Mapping[str, Any], payload: bytes = b"") -> None:
        """Queue a reply for the connection (dropped if it has gone) and wake the thread."""
        frame = encode_frame(message, payload)
        with self._lock:
            self._replies[connection] = frame
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
            data = b""
        if not data or conn.waiting or conn.outbox:
            # Gone, or bytes after its one request: either way the connection is done.
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
            self._send(selector, cid, encode_frame({"ok": False, "error": error.message}))
            return
        conn.waiting = True
        conn.inbox = bytearray()
        with self._lock:
            self._requests[cid] = message
        self._arrived.put(cid)

    def _take_replies(self, selector: selectors.BaseSelector) -> None:
        with self._lock:
            replies, self._replies = self._replies, {}
        for cid, frame in replies.items():
            if cid in self._connections:
                self._send(selector, cid, frame)

    def _send(self, selector: selectors.BaseSelector, cid: int, frame: bytes) -> None:
        conn = self._connections[cid]
        conn.outbox, conn.sent, conn.waiting = frame, 0, False
        conn.deadline = time.monotonic() + self.timeout
        selector.modify(conn.sock, selectors.EVENT_WRITE, cid)

    def _write(self, selector: selectors.BaseSelector, cid: int) -> None:
        conn = self._connections.get(cid)
        if conn is None or not conn.outbox:
            return
        try:
            conn.sent += conn.sock.send(memoryview(conn.outbox)[conn.sent : conn.sent + (1 << 22)])
        except BlockingIOError:
            return
        except OSError:
            self._drop(selector, cid)
            return
        if conn.sent >= len(conn.outbox):
            self._drop(selector, cid)

    def _expire(self, selector: selectors.BaseSelector) -> None:
        """Close connections past their deadline (a request waiting for the engine's safe
        point has none: the client's own timeout bounds that)."""
        now = time.monotonic()
        for cid, conn in list(self._connections.items()):
            if not conn.waiting and now > conn.deadline:
                self._drop(selector, cid)

    def _drop(self, selector: selectors.BaseSelector, cid: int) -> None:
        conn = self._connections.pop(cid, None)
        if conn is None:
            return
        with self._lock:
            # A request not taken yet goes with its client: nobody would read the answer.
            self._requests.pop(cid, None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn.sock)
        conn.sock.close()
