"""The client side of the live protocol: find an engine's sockets and ask one worker.

Every failure (nothing listening, no answer in time, a worker gone mid-request, an
error reply, a malformed frame) is a one-line ``KvauditError`` naming the socket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from collections.abc import Mapping
from typing import Any, BinaryIO

from ..core.errors import KvauditError
from .protocol import HEADER, MAX_PAYLOAD, MAX_REPLY_JSON, decode_json, encode_frame, frame_sizes

TIMEOUT_VARIABLE = "KVAUDIT_LIVE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
"""Seconds one request may take, connecting to the last byte of the reply."""
BUSY_RETRY_SECONDS = 10.0
"""How long a client retries a busy agent: its queue of connections full, or a "busy"
reply (too many connections open, too many reply bytes waiting for their clients)."""
_FIRST_BACKOFF = 0.005
_LAST_BACKOFF = 0.25


class _Backoff:
    """A growing pause between tries (5 ms, doubling to 250 ms) for at most
    ``BUSY_RETRY_SECONDS`` and never past the request's deadline."""

    def __init__(self, deadline: float) -> None:
        self.start = time.monotonic()
        self.give_up = min(deadline, self.start + BUSY_RETRY_SECONDS)
        self.pause = _FIRST_BACKOFF
        self.tries = 0

    def wait(self) -> bool:
        """Sleep before the next try; False (no sleep) when it would pass the limit."""
        if time.monotonic() + self.pause > self.give_up:
            return False
        time.sleep(self.pause)
        self.pause = min(self.pause * 2, _LAST_BACKOFF)
        self.tries += 1
        return True

    def waited(self) -> str:
        """How long it retried, for the error message."""
        return f"{time.monotonic() - self.start:.1f} s"


def default_timeout() -> float:
    """The timeout of one request: ``$KVAUDIT_LIVE_TIMEOUT`` seconds, else 60.

    Raises:
        KvauditError: The variable is not a positive number.

    """
    text = os.environ.get(TIMEOUT_VARIABLE)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise KvauditError(f"{TIMEOUT_VARIABLE}={text}: expected a positive number of seconds")
    return value


def is_socket(path: str) -> bool:
    """Whether ``path`` is a unix socket."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def sockets_of(path: str, name: str) -> list[str]:
    """The sockets that ``live:PATH`` names, sorted.

    Args:
        path: The socket itself, or a folder whose ``*.sock`` sockets (one engine's
            workers) are all named.
        name: The argument as given, which errors name.

    Returns:
        The sockets' paths.

    Raises:
        KvauditError: Neither a socket nor a folder holding sockets; names ``name``.

    """
    if is_socket(path):
        return [path]
    if os.path.isdir(path):
        found = sorted(
            os.path.join(path, entry)
            for entry in os.listdir(path)
            if entry.endswith(".sock") and is_socket(os.path.join(path, entry))
        )
        if not found:
            raise KvauditError("a folder without sockets (*.sock) of a live agent", name)
        return found
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise KvauditError("no such socket or folder", name) from None
    kind = next((word for test, word in _KINDS if test(mode)), "not a socket")
    raise KvauditError(f"is {kind}, expected a socket or a folder of sockets", name)


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_owner(path: str) -> None:
    """Refuse a socket, or a folder holding it, owned by another user than this process's
    or root: ``live:PATH`` trusts what answers there, so it must be one's own agent.

    Raises:
        KvauditError: The socket or its folder belongs to another user; names which.

    """
    trusted = {os.getuid(), 0}
    for place, what in (
        (path, "the socket"),
        (os.path.dirname(os.path.abspath(path)), "its folder"),
    ):
        try:
            owner = os.stat(place).st_uid
        except OSError:
            continue  # a missing socket: the connection says so
        if owner not in trusted:
            raise KvauditError(
                f"{what} belongs to another user (uid {owner}): kvaudit talks only to an "
                "agent of its own user or root",
                place,
            )


def call(
    path: str,
    message: Mapping[str, Any],
    timeout: float | None = None,
    payload_to: BinaryIO | None = None,
) -> tuple[dict[str, Any], bytes]:
    """Send one request to the agent on ``path``; its reply and payload.

    Args:
        path: The agent's socket.
        message: The request (docs/live.md, "Protocol").
        timeout: Seconds from connecting to the reply's last byte; None for
            ``default_timeout()``.
        payload_to: A file the payload is written into as it arrives, instead of being
            returned (the returned payload is then empty).

    Returns:
        The reply's JSON and its payload.

    A busy agent (its queue of connections full, or a reply saying ``"busy": true``) is
    asked again after a growing pause, for at most ``BUSY_RETRY_SECONDS``: a busy reply
    means the request was not carried out.

    Raises:
        KvauditError: No agent, no answer within ``timeout`` seconds, an agent that
            stayed busy, the connection closed early, a malformed reply or an error
            reply; names the socket.

    """
    limit = default_timeout() if timeout is None else timeout
    deadline = time.monotonic() + limit
    check_owner(path)
    backoff = _Backoff(deadline)
    while True:
        reply, data = _exchange(path, message, limit, deadline, backoff, payload_to)
        if reply.get("ok") is True:
            return reply, data
        if reply.get("busy") is not True or not backoff.wait():
            break
    error = reply.get("error")
    text = " ".join(error.split()) if isinstance(error, str) else "an error reply"
    if reply.get("busy") is True and backoff.tries:
        text += f" (asked again for {backoff.waited()})"
    raise KvauditError(f"the agent answered: {text[:500]}", path)


def _exchange(
    path: str,
    message: Mapping[str, Any],
    limit: float,
    deadline: float,
    backoff: _Backoff,
    payload_to: BinaryIO | None,
) -> tuple[dict[str, Any], bytes]:
    """One request on a fresh connection: its reply (an error reply too) and payload."""
    sock: socket.socket | None = None
    try:
        try:
            sock = _connect(path, deadline, backoff)
            # Refused before it was read (a busy agent): the reply says why.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(encode_frame(message))
            header = _receive(sock, HEADER.size, deadline, path)
            size, payload = frame_sizes(header, MAX_REPLY_JSON, MAX_PAYLOAD, path)
            reply = decode_json(_receive(sock, size, deadline, path), path)
            if payload_to is None or reply.get("ok") is not True:
                data = _receive(sock, payload, deadline, path)
            else:
                data = b""
                _receive_into(payload_to, sock, payload, deadline, path)
        except TimeoutError:
            raise KvauditError(f"no answer within {limit:g} s ({TIMEOUT_VARIABLE})", path) from None
        except ConnectionRefusedError:
            raise KvauditError("no agent is listening (connection refused)", path) from None
        except FileNotFoundError:
            raise KvauditError("no such socket", path) from None
        except OSError as error:
            raise KvauditError(
                f"cannot talk to the agent: {error.strerror or error}", path
            ) from None
    finally:
        if sock is not None:
            sock.close()
    return reply, data


def _connect(path: str, deadline: float, backoff: _Backoff) -> socket.socket:
    """A socket connected to the agent, retrying with ``backoff``'s pauses while its
    queue of connections is full (a burst of clients).

    Raises:
        KvauditError: The queue stayed full.

    """
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(path)
            return sock
        except BaseException as error:
            sock.close()
            if not isinstance(error, BlockingIOError):
                raise
            # A unix socket's full backlog (EAGAIN): the agent is busy, not gone.
            if not backoff.wait():
                raise KvauditError(
                    "busy: the agent's queue of connections stayed full for "
                    f"{backoff.waited()}, try again later",
                    path,
                ) from None


def _receive_into(
    sink: BinaryIO | bytearray, sock: socket.socket, size: int, deadline: float, path: str
) -> None:
    """Exactly ``size`` bytes into ``sink`` (a file, or a buffer extended), a piece at a
    time, before the deadline."""
    got = 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(min(size - got, 1 << 22))
        if not chunk:
            raise KvauditError(
                f"the worker closed the connection mid-request ({got} of {size} bytes)", path
            )
        if isinstance(sink, bytearray):
            sink += chunk
        else:
            sink.write(chunk)
        got += len(chunk)


def _receive(sock: socket.socket, size: int, deadline: float, path: str) -> bytes:
    """Exactly ``size`` bytes, before the deadline."""
    parts = bytearray()
    _receive_into(parts, sock, size, deadline, path)
    return bytes(parts)
