"""Running engines as sources: ``live:PATH`` names a live agent's socket, or a folder of
sockets (one engine's workers), served by ``kvaudit.live.Agent`` (docs/live.md).

Opening asks every worker who it is and which requests its cache holds now. Checksums
are computed by the agents, on the engine's own device, at a safe point of the engine;
locating a difference fetches the raw blocks of the differing positions only, as small
dumps read with the dump reader's strict checks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import KvauditError
from ..core.validation import MAX_COUNT, Checker, check_int, check_positions, worker_layout
from ..description import CacheDescription, parse_description
from ..dumps import open_dump
from ..live.client import call, sockets_of
from ..live.protocol import MAX_IDS, PROTOCOL
from ..records import Record, WorkerInfo, WorkerRecord, combine_workers
from ..views.inputs import RequestBlocks
from ..workers import FetchingWorker, RawWorker
from ..workers.inventory import GroupInfo, Inventory, WorkerInventory, request_inventory
from .base import RecordQuery, Source, request_ids_of, token_counts_of, trim
from .registry import OpenOptions
from .sniffing import LIVE_PREFIX as PREFIX
from .sniffing import live_target_error


@dataclass
class _Scratch:
    """A private folder for fetched blocks, removed with the source."""

    path: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="kvaudit-live-"))
    count: int = 0

    def __post_init__(self) -> None:
        weakref.finalize(self, shutil.rmtree, self.path, True)

    def file(self) -> str:
        self.count += 1
        return os.path.join(self.path, f"fetch-{self.count}.safetensors")


@dataclass
class RemoteWorker:
    """One worker behind an agent's socket: who it is, its cache's description and
    groups, and its requests as listed when opened (cut to the tokens compared)."""

    name: str
    worker: WorkerInfo
    description: CacheDescription
    rows: int
    groups: list[GroupInfo]
    requests: dict[str, RequestBlocks]
    scratch: _Scratch

    def fetch(
        self, request_id: str, group_id: int, spans: Sequence[tuple[int, int]]
    ) -> list[RawWorker]:
        """Dumps of the request's blocks of the group at the token spans, one per run of
        consecutive positions the worker holds."""
        request = self.requests.get(request_id)
        if request is None or group_id not in request.groups:
            return []
        start, block_ids = request.groups[group_id]
        group = self.description.group(group_id)
        size = group.block_size
        wanted: set[int] = set()
        for lo, hi in spans:
            if group.spec.is_state:
                wanted.update(range(-(-lo // size), -(-hi // size)))
            else:
                wanted.update(range(lo // size, (hi - 1) // size + 1))
        held = sorted(p for p in wanted if start <= p < start + len(block_ids))
        runs: list[list[int]] = []
        for position in held:
            if runs and position == runs[-1][-1] + 1 and len(runs[-1]) < 1024:
                runs[-1].append(position)
            else:
                runs.append([position])
        dumps: list[RawWorker] = []
        for run in runs:
            message = {
                "op": "fetch",
                "request": request_id,
                "group": group_id,
                "lo": run[0],
                "hi": run[-1] + 1,
                "num_tokens": request.num_tokens,
            }
            path = self.scratch.file()
            with open(path, "xb") as file:
                call(self.name, message, payload_to=file)
            dumps.append(open_dump(path))
        return dumps

    def dump(self, request_ids: Sequence[str]) -> RawWorker:
        """A dump of the requests' blocks (each cut to its listed token count), streamed
        from the agent.

        Raises:
            KvauditError: More requests than one request may name, a request the worker
                no longer holds, or more bytes than the agent copies at once.

        """
        if len(request_ids) > MAX_IDS:
            raise KvauditError(
                f"{len(request_ids)} requests to copy at once, at most {MAX_IDS}: name fewer "
                "with --request",
                self.name,
            )
        message = {
            "op": "dump",
            "requests": list(request_ids),
            "num_tokens": {rid: self.requests[rid].num_tokens for rid in request_ids},
        }
        path = self.scratch.file()
        with open(path, "xb") as file:
            call(self.name, message, payload_to=file)
        return open_dump(path)


class SocketSource(Source):
    """The workers of running engines, each behind a live agent's socket."""

    kind = "live"

    def __init__(self, names: Sequence[str], workers: Sequence[RemoteWorker]) -> None:
        super().__init__(names)
        self.workers = list(workers)
        self.limits: dict[str, int] = {}

    @property
    def request_ids(self) -> list[str]:
        return request_ids_of(worker.requests for worker in self.workers)

    def token_counts(self) -> dict[str, int]:
        return token_counts_of(worker.requests for worker in self.workers)

    def inventory(self) -> Inventory:
        missing = worker_layout([worker.worker for worker in self.workers])
        workers = [WorkerInventory(w.worker, w.rows, w.groups) for w in self.workers]
        requests = request_inventory(worker.requests for worker in self.workers)
        return Inventory(self.kind, self.names, workers, not missing, missing, requests)

    def checksum(self, query: RecordQuery) -> Record:
        request_ids, positions = query.request_ids, query.positions
        records = []
        for remote in self.workers:
            ids = None if request_ids is None else [r for r in request_ids if r in remote.requests]
            wanted = None if ids is None else set(ids)
            limits = {rid: n for rid, n in self.limits.items() if wanted is None or rid in wanted}
            if ids is None and len(limits) <= MAX_IDS:
                batches: list[list[str] | None] = [None]
            else:
                # One request names at most MAX_IDS ids: more are asked in batches.
                named = list(remote.requests) if ids is None else ids
                batches = [named[i : i + MAX_IDS] for i in range(0, len(named), MAX_IDS)]
            parts = [
                self._checksum_batch(remote, batch, positions, limits) for batch in batches or [[]]
            ]
            first = parts[0]
            requests = {rid: sums for part in parts for rid, sums in part.requests.items()}
            records.append(dataclasses.replace(first, requests=requests))
        return combine_workers(records)

    def _checksum_batch(
        self,
        remote: RemoteWorker,
        ids: list[str] | None,
        positions: str | None,
        limits: Mapping[str, int],
    ) -> WorkerRecord:
        """One worker's checksums of the requests (all when None) in one request."""
        wanted = None if ids is None else set(ids)
        message = {
            "op": "checksum",
            "requests": ids,
            "positions": positions or "request",
            "num_tokens": {rid: n for rid, n in limits.items() if wanted is None or rid in wanted},
        }
        reply, _ = call(remote.name, message)
        record = Record.from_json(reply.get("record"), remote.name)
        summary = record.workers[0]
        if _ranks(summary.worker) != _ranks(remote.worker):
            raise KvauditError("the agent's record is of another worker", remote.name)
        return WorkerRecord(
            dataclasses.replace(summary.worker, source=remote.name, engine=remote.worker.engine),
            record.positions,
            summary.fingerprints,
            summary.not_covered,
            record.requests,
            summary.layers,
        )

    def trimmed(self, num_tokens: Mapping[str, int]) -> SocketSource:
        workers = [
            dataclasses.replace(worker, requests=trim(worker.requests, num_tokens))
            for worker in self.workers
        ]
        source = SocketSource(self.names, workers)
        source.limits = {**self.limits, **num_tokens}
        return source

    def raw_kv(self) -> list[RawWorker | FetchingWorker]:
        worker_layout([worker.worker for worker in self.workers])
        return list(self._in_rank_order())

    def value_kv(self, request_ids: Sequence[str] | None) -> list[RawWorker]:
        """Each worker's dump of the requests (all it listed when None), cut to the tokens
        compared, streamed from its agent into the source's scratch folder and read with
        the dump reader's checks: one consistent copy per worker, taken at its safe
        point."""
        workers = []
        for remote in self._in_rank_order():
            ids = [rid for rid in (request_ids or remote.requests) if rid in remote.requests]
            workers.append(remote.dump(ids))
        worker_layout([worker.worker for worker in workers])
        return workers

    def _in_rank_order(self) -> list[RemoteWorker]:
        """The workers by PP stage, then TP rank."""
        return sorted(self.workers, key=lambda w: (w.worker.pp_rank, w.worker.tp_rank))

    def _stated_worker(self) -> WorkerInfo | None:
        return self.workers[0].worker if self.workers else None


def _ranks(worker: WorkerInfo) -> tuple[int, int, int, int]:
    return worker.tp_rank, worker.tp_size, worker.pp_rank, worker.pp_size


def dump_requests(
    path: str, folder: str | os.PathLike[str], request_ids: Sequence[str] | None = None
) -> list[str]:
    """Ask every worker behind ``path`` to dump the requests into ``folder``.

    Args:
        path: A socket or a folder of them, with or without ``live:`` before it.
        folder: An existing folder where the workers write their dumps (made absolute
            for the agents).
        request_ids: The requests dumped; None for all a worker holds.

    Returns:
        The files written, one per worker, in the order of the sockets.

    Raises:
        KvauditError: No socket at ``path``, or a worker that does not answer or answers
            with an error; names the socket.

    """
    target = os.path.abspath(os.fspath(folder))
    written = []
    for sock in sockets_of(path.removeprefix(PREFIX), path):
        reply, _ = call(sock, {"op": "dump", "folder": target, "requests": request_ids})
        written.append(str(reply.get("path")))
    return written


def open_remote(path: str, scratch: _Scratch) -> RemoteWorker:
    """Ask the agent on ``path`` who it is and what its cache holds now.

    Raises:
        KvauditError: No agent answers, or its answers are malformed; names the socket.

    """
    hello, _ = call(path, {"op": "hello"})
    check = Checker(path)
    if hello.get("protocol") != PROTOCOL:
        check.fail("protocol", f"expected {PROTOCOL}, {check.got(hello.get('protocol'))}")
    worker_data = _mapping(check, hello.get("worker"), "worker")
    worker = WorkerInfo(
        tp_rank=check_int(worker_data.get("tp_rank"), path, "worker.tp_rank", 0, 1 << 16),
        tp_size=check_int(worker_data.get("tp_size"), path, "worker.tp_size", 1, 1 << 16),
        pp_rank=check_int(worker_data.get("pp_rank"), path, "worker.pp_rank", 0, 1 << 16),
        pp_size=check_int(worker_data.get("pp_size"), path, "worker.pp_size", 1, 1 << 16),
        role=check.role(worker_data.get("role"), "worker.role"),
        engine=str(worker_data.get("engine", "")),
        source=path,
    )
    check.ranks(worker, "worker")
    description = parse_description(_mapping(check, hello.get("description"), "description"), path)
    rows = check_int(hello.get("rows"), path, "rows", 0, MAX_COUNT)
    groups = [
        _group_info(check, item, f"groups[{i}]")
        for i, item in enumerate(_list(check, hello.get("groups"), "groups"))
    ]
    listing, _ = call(path, {"op": "list"})
    requests = _listing(check, listing.get("requests"), description)
    return RemoteWorker(path, worker, description, rows, groups, requests, scratch)


def _mapping(check: Checker, value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        check.fail(path, f"expected an object, {check.got(value)}")
    return value


def _list(check: Checker, value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        check.fail(path, f"expected a list, {check.got(value)}")
    return value


def _group_info(check: Checker, value: object, path: str) -> GroupInfo:
    data = _mapping(check, value, path)
    source = check.source
    fingerprint = data.get("fingerprint")
    try:
        fp = int(fingerprint, 16) if isinstance(fingerprint, str) and len(fingerprint) == 16 else -1
    except ValueError:
        fp = -1
    if fp < 0:
        check.fail(f"{path}.fingerprint", f"expected 16 hex digits, {check.got(fingerprint)}")
    reason = data.get("reason")
    texts = {key: data.get(key) for key in ("type", "layout")}
    if not all(isinstance(text, str) for text in texts.values()) or not isinstance(
        reason, (str, type(None))
    ):
        check.fail(path, "expected type and layout as text, reason as text or null")
    return GroupInfo(
        id=check_int(data.get("id"), source, f"{path}.id", 0, 1 << 20),
        fingerprint=fp,
        covered=reason is None,
        reason=reason,
        type=texts["type"],
        block_size=check_int(data.get("block_size"), source, f"{path}.block_size", 1, MAX_COUNT),
        kernel_block_size=check_int(
            data.get("kernel_block_size"), source, f"{path}.kernel_block_size", 1, MAX_COUNT
        ),
        layout=texts["layout"],
        layers=check_int(data.get("layers"), source, f"{path}.layers", 0, MAX_COUNT),
        bytes=check_int(data.get("bytes"), source, f"{path}.bytes", 0, 1 << 62),
    )


def _listing(
    check: Checker, value: object, description: CacheDescription
) -> dict[str, RequestBlocks]:
    """The agent's requests: ids, token counts, and per group a start and block ids."""
    source = check.source
    requests = {}
    block_sizes = {group.id: group.block_size for group in description.groups}
    for rid, item in _mapping(check, value, "requests").items():
        where = f"requests.{rid}"
        data = _mapping(check, item, where)
        num_tokens = check_int(data.get("num_tokens"), source, f"{where}.num_tokens", 0, 1 << 40)
        groups = {}
        for key, entry in _mapping(check, data.get("groups"), f"{where}.groups").items():
            gid = check_int(
                int(key) if key.isascii() and key.isdigit() else key,
                source,
                f"{where}.groups",
                0,
                1 << 20,
            )
            if gid not in block_sizes:
                check.fail(f"{where}.groups", f"group {gid} is not in the description")
            pair = _list(check, entry, f"{where}.groups.{key}")
            if len(pair) != 2:
                check.fail(f"{where}.groups.{key}", "expected [start, [block ids]]")
            start = check_int(pair[0], source, f"{where}.groups.{key}[0]", 0, 1 << 40)
            ids = [
                check_int(b, source, f"{where}.groups.{key}[1]", 0, MAX_COUNT)
                for b in _list(check, pair[1], f"{where}.groups.{key}[1]")
            ]
            check_positions(
                source, f"{where} group {gid}", num_tokens, block_sizes[gid], start, len(ids)
            )
            groups[gid] = (start, ids)
        requests[rid] = RequestBlocks(num_tokens, groups)
    return requests


def open_sockets(
    names: Sequence[str], claimed: Sequence[str], options: OpenOptions
) -> SocketSource:
    """The live kind's opener: every argument a socket or a folder of sockets (one that
    names a Python handle is refused with the ``py:`` spelling)."""
    for name in claimed:
        error = live_target_error(name)
        if error is not None:
            raise error
    if len(claimed) != len(names):
        raise KvauditError("live: sockets cannot be mixed with dumps, records or Python handles")
    scratch = _Scratch()
    sockets = [sock for name in names for sock in sockets_of(name[len(PREFIX) :], name)]
    workers = [open_remote(sock, scratch) for sock in dict.fromkeys(sockets)]
    return SocketSource(names, workers)
