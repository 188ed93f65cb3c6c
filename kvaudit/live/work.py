"""The agent's answers as work in units, so that no step boundary pays for a whole answer.

A ``Job`` is one client's request; each ``step`` does one unit of it at a safe point,
sized to the seconds the agent may still take there (``Pace`` learns what a block
position costs), and returns the reply once the job is done:

- a ``list`` copies the block tables at one safe point (one unit: the listing is of one
  moment), then writes the listing's JSON a few requests at a time;
- a ``checksum`` reads the KV: each unit checksums whole requests at one safe point (a
  request's checksums are of one step), and a request too large for one unit is read a
  slice of positions at a time, each slice only while the request still holds the same
  blocks there;
- a ``fetch`` or ``dump`` copies its blocks at one safe point (``OnceJob``): what one
  copies is bounded by bytes (the agent's ``max_reply_bytes`` and ``max_poll_bytes``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import KvauditError
from ..core.validation import MAX_TOKENS, short
from ..records import GroupChecksums, RequestChecksums
from ..records.encoding import request_to_json, worker_record_head
from ..views.inputs import RequestBlocks, block_id_list, plain_requests
from .messages import (
    json_member,
    listing_entry,
    object_with_members,
)
from .protocol import request_id_list, token_limits
from .server import Reply

if TYPE_CHECKING:
    from ..checksum.checksummer import Checksummer

BlockTables = Callable[[], Mapping[str, RequestBlocks]]
"""Returns the requests in the cache now: request id to its blocks (engine block ids)."""
MIN_WHOLE_BLOCKS = 256
"""A request of at most this many block positions is always checksummed at one safe
point, whatever a unit's size: its checksums are of one step."""
MAX_UNIT_BLOCKS = 1 << 16
"""The most block positions one unit takes, whatever the pace says."""


class Busy(KvauditError):
    """A request refused for now (its error reply says ``"busy": true``): the client
    may try again later."""


class Pace:
    """What one block position costs each kind of unit (seconds, learnt as units run),
    and so how many positions fit in the seconds a safe point has left."""

    def __init__(self) -> None:
        # A first guess on the slow side: the first units are small, then fit.
        self.seconds = {"checksum": 2e-5, "list": 2e-6}

    def blocks(self, kind: str, seconds: float) -> int:
        """How many block positions a unit of ``kind`` may take in ``seconds`` (at least
        one, at most ``MAX_UNIT_BLOCKS``)."""
        return max(1, min(int(seconds / self.seconds[kind]), MAX_UNIT_BLOCKS))

    def learn(self, kind: str, blocks: int, seconds: float) -> None:
        """A unit of ``kind`` took ``seconds`` for ``blocks`` positions."""
        if kind in self.seconds and blocks > 0:
            self.seconds[kind] = 0.5 * self.seconds[kind] + 0.5 * max(seconds / blocks, 1e-9)


class SafePoint:
    """One safe point's block tables: the engine's ``block_tables()`` called at most
    once, when a unit first needs them."""

    def __init__(self, read: BlockTables, source: str) -> None:
        self._read = read
        self._source = source
        self._tables: Mapping[str, RequestBlocks] | None = None
        self._error: Exception | None = None

    def tables(self) -> Mapping[str, RequestBlocks]:
        """The requests in the cache now.

        Raises:
            KvauditError: ``block_tables()`` gave no mapping (or what it raised).

        """
        if self._error is not None:
            raise self._error
        if self._tables is None:
            try:
                tables = self._read()
                if not isinstance(tables, Mapping):
                    raise KvauditError(
                        f"block_tables() returned {type(tables).__name__}, expected a mapping "
                        "of request ids to RequestBlocks",
                        self._source,
                    )
            except Exception as error:
                self._error = error
                raise
            self._tables = tables
        return self._tables


class Job(ABC):
    """One client's request, done in units (``step``); ``blocks`` is what the last unit
    took (for ``Pace``), ``held`` the reply bytes written so far."""

    kind = ""

    def __init__(self, connection: int) -> None:
        self.connection = connection
        self.blocks = 0
        self.held = 0
        self._parts: list[bytes] = []

    @abstractmethod
    def step(self, point: SafePoint, seconds: float) -> Reply | None:
        """Do one unit at this safe point, sized to ``seconds``; the reply once done.

        Raises:
            KvauditError: The request cannot be answered (an error reply).

        """

    def _add(self, part: bytes) -> None:
        self._parts.append(part)
        self.held += len(part)

    def _reply(self, head: Mapping[str, Any], key: str, depth: int = 1) -> Reply:
        """The reply: ``head`` whose last object ``depth`` levels in gains a last member
        ``key``, the object of the parts written (``"id":value`` each)."""
        parts, self._parts, self.held = self._parts, [], 0
        return Reply.of_json(object_with_members(head, key, parts, depth))


class OnceJob(Job):
    """A request answered in one unit (a copy, whose cost is bounded by its bytes)."""

    def __init__(self, connection: int, answer: Callable[[SafePoint], Reply]) -> None:
        super().__init__(connection)
        self._answer = answer

    def step(self, point: SafePoint, seconds: float) -> Reply | None:
        return self._answer(point)


class ListJob(Job):
    """``list``: the block tables copied at one safe point, then their JSON written a
    few requests a unit."""

    kind = "list"

    def __init__(self, connection: int, source: str, pace: Pace, polls: Callable[[], int]) -> None:
        super().__init__(connection)
        self._source, self._pace, self._polls = source, pace, polls
        self._left: deque[tuple[str, RequestBlocks]] | None = None

    def step(self, point: SafePoint, seconds: float) -> Reply | None:
        self.blocks = 0
        if self._left is None:
            # The listing is of one moment: copied now, written over the next units.
            self._left = deque((rid, _copy(request)) for rid, request in point.tables().items())
            return None
        budget = self._pace.blocks(self.kind, seconds)
        while self._left:
            rid, request = self._left[0]
            size = _positions(request) + 1
            if self.blocks and self.blocks + size > budget:
                break
            self._left.popleft()
            plain = plain_requests({rid: request}, self._source)[rid]
            self._add(json_member(rid, listing_entry(plain)))
            self.blocks += size
        if self._left:
            return None
        return self._reply({"ok": True, "polls": self._polls()}, "requests")


class ChecksumJob(Job):
    """``checksum``: whole requests a unit, each read at one safe point; a request larger
    than a unit may take, a slice of positions a unit (``_Slices``)."""

    kind = "checksum"

    def __init__(
        self,
        connection: int,
        message: Mapping[str, Any],
        summer: Checksummer,
        pace: Pace,
        polls: Callable[[], int],
        whole_seconds: float,
    ) -> None:
        super().__init__(connection)
        self._message, self._summer, self._pace, self._polls = message, summer, pace, polls
        self._whole_seconds = whole_seconds
        self._source = summer.worker.source
        self._named: list[str] | None = None
        self._limits: dict[str, int] = {}
        self._positions = "request"
        self._left: deque[str] | None = None
        self._large: _Slices | None = None

    def step(self, point: SafePoint, seconds: float) -> Reply | None:
        self.blocks = 0
        tables = point.tables()
        if self._left is None:
            self._begin(tables)
            return None
        budget = self._pace.blocks(self.kind, seconds)
        if self._large is None:
            self._whole_requests(tables, budget)
        if self._large is not None:
            self._slice(tables, budget)
        if self._left or self._large is not None:
            return None
        record = self._summer.checksum({}, self._positions)  # ranks, fingerprints, coverage
        head = {"ok": True, "polls": self._polls(), "record": worker_record_head(record)}
        return self._reply(head, "requests", depth=2)  # the record's requests, in "record"

    def _begin(self, tables: Mapping[str, RequestBlocks]) -> None:
        """Read the request's arguments and which requests it covers."""
        message = self._message
        self._named = request_id_list(message.get("requests"), self._source)
        self._limits = token_limits(message.get("num_tokens"), self._source)
        positions = message.get("positions", "request")
        if positions not in ("request", "block"):
            raise KvauditError(f"positions: expected request or block, got {short(positions)}")
        self._positions = positions
        if self._named is not None:
            for rid in self._named:
                if rid not in tables:
                    raise KvauditError(f"request {rid!r} is not in the cache now")
        self._left = deque(self._named if self._named is not None else tables)

    def _current(self, tables: Mapping[str, RequestBlocks], rid: str) -> RequestBlocks | None:
        """The request as the block tables hold it now, cut to its token limit; None for
        one that has left the cache since the job began, unless named (an error)."""
        request = tables.get(rid)
        if request is None:
            if self._named is not None:
                raise KvauditError(f"request {rid!r} is not in the cache now")
            return None  # "every request": it left before its turn
        limit = self._limits.get(rid, MAX_TOKENS)
        return RequestBlocks(min(request.num_tokens, limit), request.groups)

    def _whole_requests(self, tables: Mapping[str, RequestBlocks], budget: int) -> None:
        """Checksum the next requests that fit in ``budget`` positions (at least one),
        or start slicing one too large for a unit."""
        assert self._left is not None
        whole = max(MIN_WHOLE_BLOCKS, self._pace.blocks(self.kind, self._whole_seconds))
        batch: dict[str, RequestBlocks] = {}
        while self._left:
            rid = self._left[0]
            request = self._current(tables, rid)
            if request is None:
                self._left.popleft()
                continue
            size = _positions(request)
            if batch and self.blocks + size > budget:
                break
            if size > whole:
                if batch:
                    break
                self._left.popleft()
                self._large = _Slices(self._summer, rid, request, self._positions)
                return
            self._left.popleft()
            batch[rid] = request
            self.blocks += size
        if batch:
            record = self._summer.checksum(batch, self._positions)
            for rid, checksums in record.requests.items():
                self._add(json_member(rid, request_to_json(checksums)))

    def _slice(self, tables: Mapping[str, RequestBlocks], budget: int) -> None:
        """The next slice of the large request; its JSON once its last slice is done."""
        large = self._large
        assert large is not None
        current = tables.get(large.rid)
        if current is None and self._named is None:
            self._large = None  # it left the cache: "every request" no longer holds it
            return
        self.blocks += large.step(current, budget)
        if large.done:
            self._large = None
            self._add(json_member(large.rid, request_to_json(large.result())))


class _Slices:
    """A request too large for one unit, checksummed a slice of positions at a time. Its
    blocks are copied when it begins; each slice is read only while the request still
    holds those blocks at those positions (written KV does not change between steps)."""

    def __init__(
        self, summer: Checksummer, rid: str, request: RequestBlocks, positions: str
    ) -> None:
        self.rid = rid
        self._summer = summer
        self._positions = positions
        source = summer.worker.source
        self._request = plain_requests({rid: request}, source)[rid]
        empty = {gid: (start, []) for gid, (start, _) in self._request.groups.items()}
        # Token count, groups and starts checked now, block ids slice by slice.
        skeleton = summer.checksum({rid: RequestBlocks(self._request.num_tokens, empty)}, positions)
        self._result: RequestChecksums = skeleton.requests[rid]
        self._values: dict[int, list[np.ndarray]] = {gid: [] for gid in self._result.groups}
        # Each slice's strong lane (None: a slice without it, so the group has none).
        self._strong: dict[int, list[np.ndarray | None]] = {gid: [] for gid in self._result.groups}
        for gid, (_, ids) in self._request.groups.items():
            if len(set(ids)) != len(ids):
                raise KvauditError(f"request {rid} group {gid}: a block is listed at two positions")
        self._offsets: deque[tuple[int, int]] = deque(
            (gid, 0) for gid in sorted(self._values) if self._request.groups[gid][1]
        )

    @property
    def done(self) -> bool:
        """Whether every position has been read."""
        return not self._offsets

    def step(self, current: RequestBlocks | None, budget: int) -> int:
        """Checksum up to ``budget`` positions of one group; the positions read.

        Raises:
            KvauditError: The request left the cache, or holds other blocks there now.

        """
        gid, offset = self._offsets.popleft()
        start, ids = self._request.groups[gid]
        count = min(budget, len(ids) - offset)
        piece = ids[offset : offset + count]
        if current is None or _held_ids(current, gid, start + offset, count) != piece:
            raise KvauditError(
                f"request {self.rid!r} changed its blocks while its checksums were computed "
                "(it left the cache, or its blocks moved); ask again"
            )
        blocks = {self.rid: RequestBlocks(self._request.num_tokens, {gid: (start + offset, piece)})}
        record = self._summer.checksum(blocks, self._positions)  # type: ignore[arg-type]
        computed = record.requests[self.rid].groups[gid]
        self._values[gid].append(computed.values)
        self._strong[gid].append(computed.strong)
        if offset + count < len(ids):
            self._offsets.appendleft((gid, offset + count))
        return count

    def result(self) -> RequestChecksums:
        """The request's checksums, every slice joined."""
        groups: dict[int, GroupChecksums] = {}
        for gid, group in self._result.groups.items():
            parts = self._values[gid]
            values = np.concatenate(parts) if parts else group.values
            lanes = self._strong[gid]
            if not lanes:
                strong = group.strong
            elif any(lane is None for lane in lanes):
                strong = None
            else:
                strong = np.concatenate(lanes)  # type: ignore[arg-type]
            groups[gid] = GroupChecksums(
                group.block_size,
                group.start,
                group.replica_keys,
                values,
                group.fingerprint,
                strong=strong,
            )
        return RequestChecksums(self._result.num_tokens, groups)


def _positions(request: RequestBlocks) -> int:
    """The block positions a request lists, over its groups."""
    return sum(len(ids) for _, ids in request.groups.values())


def _copy(request: RequestBlocks) -> RequestBlocks:
    """A request's blocks copied (lists, arrays, tensors): the engine may change its own
    after this safe point."""
    groups = {}
    for gid, (start, ids) in request.groups.items():
        if hasattr(ids, "clone"):
            ids = ids.detach().clone()
        elif isinstance(ids, np.ndarray):
            ids = ids.copy()
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        groups[gid] = (start, ids)
    return RequestBlocks(request.num_tokens, groups)


def _held_ids(request: RequestBlocks, gid: int, lo: int, count: int) -> list[Any] | None:
    """The block ids a request holds now at positions ``lo .. lo + count - 1`` of a group;
    None where it holds none of some."""
    if gid not in request.groups:
        return None
    start, ids = request.groups[gid]
    first = lo - int(start)
    if first < 0 or first + count > len(ids):
        return None
    return block_id_list(ids[first : first + count], f"request group {gid}")
