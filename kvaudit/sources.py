"""SOURCE arguments of the command line: dump files, directories of dumps, records and
live handles, resolved into one thing to inspect, checksum or diff.

A source also says each request's token count. Dumps and live workers can besides be cut
to fewer tokens (so that two sides are checksummed over the tokens both hold) and hand
over their raw KV as a dump set for locating differences; a record can do neither. In
Python, ``ChecksummerSource`` wraps an engine's live ``Checksummer`` objects
(``kvaudit.testing.LiveSide``).

A command's SOURCEs are one of:

- dump files and directories of dump files (``*.safetensors``): together, one dump set;
- one record, the JSON ``kvaudit checksum --format json`` writes (a ``.json`` file, or any
  file whose content starts with ``{``);
- live handles ``live:PATH``: ``PATH`` is a Python file (``tools/live.py``) or an importable
  module (``mypkg.kv_live``) that defines ``kvaudit_live()``; each handle is one worker.

``kvaudit_live()`` returns ``(description, tensors, rank, requests)``:

- ``description``: a ``CacheDescription``, a description dict, or the path of a YAML file;
- ``tensors``: layer name to its cache tensor (or ``(k, v)`` tensors), any strides, on the
  CPU or a GPU;
- ``rank``: a dict with any of ``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``, ``role``,
  ``engine``, ``num_blocks``;
- ``requests``: request id to a ``RequestBlocks``, or to a dict
  ``{"num_tokens": n, "groups": {group_id: [start, [block ids]]}}`` as in a dump's metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from .checksummer import Checksummer, RequestBlocks
from .description import CacheDescription, load_description, parse_description
from .dumps import Dump, DumpRequest, DumpSet, checksum_dump_set, open_dump_set, total_bytes
from .errors import KvauditError
from .records import Record, WorkerInfo, WorkerRecord, combine_workers
from .validation import check_worker
from .views import GroupViews, LayerTensor

LIVE_PREFIX = "live:"
DUMP_SUFFIX = ".safetensors"
RECORD_SUFFIX = ".json"
LIVE_FUNCTION = "kvaudit_live"
_RANK_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "role", "engine", "num_blocks")

Progress = Callable[[int], None]
"""Called with the bytes checksummed since its last call."""


_Listed = TypeVar("_Listed", DumpRequest, RequestBlocks)
"""A request as dumps (``DumpRequest``) or live workers (``RequestBlocks``) list it."""


@dataclass(frozen=True)
class GroupInfo:
    """One group on one worker: its spec, size, coverage and fingerprint.

    Fields a record does not keep (type, layout, layers, bytes) are None for a record;
    ``bytes`` is None for checksummers handed over in Python too.
    """

    id: int
    fingerprint: int
    covered: bool
    reason: str | None = None
    type: str | None = None
    block_size: int | None = None
    kernel_block_size: int | None = None
    layout: str | None = None
    layers: int | None = None
    bytes: int | None = None


@dataclass(frozen=True)
class WorkerInventory:
    """One worker of a source: who it is, how many block rows it holds, its groups."""

    worker: WorkerInfo
    rows: int | None
    groups: list[GroupInfo]


@dataclass
class RequestInventory:
    """One request across a source's workers: its token count and, per group, the block
    positions some worker holds."""

    num_tokens: int
    positions: dict[int, set[int]] = field(default_factory=dict)


@dataclass
class Inventory:
    """What a source holds, for ``kvaudit inspect``."""

    kind: str
    sources: list[str]
    workers: list[WorkerInventory]
    complete: bool
    missing_workers: list[tuple[int, int]]
    requests: dict[str, RequestInventory]


@dataclass(frozen=True)
class Runtime:
    """Where checksums are computed: the backend and device ``--device`` resolves to."""

    backend: str
    device: str


def resolve_device(choice: str) -> Runtime:
    """The runtime of a ``--device`` choice; ``auto`` is CUDA with the Triton kernel where
    available, else the CPU torch path.

    Raises:
        KvauditError: ``cuda`` without a CUDA device, or an unknown choice.

    """
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise KvauditError("--device cuda: no CUDA device is available")
        return Runtime("auto", "cuda")
    if choice == "cpu":
        return Runtime("torch", "cpu")
    raise KvauditError(f"--device {choice}: expected auto, cpu or cuda")


class Source(ABC):
    """Resolved SOURCE arguments: something to inspect and checksum."""

    kind: str = ""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)

    @property
    @abstractmethod
    def request_ids(self) -> list[str]:
        """The requests the source holds, in order."""

    @abstractmethod
    def inventory(self) -> Inventory:
        """What the source holds."""

    def work(self, request_ids: Sequence[str] | None) -> int:
        """Bytes a checksum of the requests reads (0: not worth a progress bar)."""
        return 0

    @abstractmethod
    def checksum(
        self,
        request_ids: Sequence[str] | None,
        positions: str | None,
        runtime: Runtime,
        progress: Progress | None = None,
    ) -> Record:
        """The record of the requests (all when ``request_ids`` is None), summed over the
        source's workers; ``positions`` None means the source's own or ``request``."""

    @abstractmethod
    def token_counts(self) -> dict[str, int]:
        """Each request's token count, as the source holds it."""

    def trimmed(self, num_tokens: Mapping[str, int]) -> Source | None:
        """The same source with the given requests cut to at most ``num_tokens[id]``
        tokens, so that its checksums cover only those; None when the source cannot be
        checksummed again (a record)."""
        return None

    def raw_kv(self) -> DumpSet | None:
        """The source's KV as a dump set (memory-mapped dumps, or live tensors wrapped as
        dumps) for locating differences; None when it holds only checksums."""
        return None

    def describe(self) -> str:
        """The source in a report's title: its names, its kind and, where its dumps or
        record state it, the engine's TP x PP layout."""
        worker = self._stated_worker()
        layout = f", TP {worker.tp_size} x PP {worker.pp_size}" if worker is not None else ""
        return f"{', '.join(self.names)} ({self.kind}{layout})"

    def _stated_worker(self) -> WorkerInfo | None:
        """A worker as the source's files state it, for ``describe``; None for live ones."""
        return None

    def check_request_ids(self, request_ids: Sequence[str]) -> None:
        """Reject a request id the source does not hold."""
        known = self.request_ids
        for request_id in request_ids:
            if request_id not in known:
                held = ", ".join(known) if known else "none"
                raise KvauditError(
                    f"unknown request {request_id!r} in {', '.join(self.names)} (it holds: {held})"
                )


class DumpSource(Source):
    """Dump files and directories of dumps: one engine's dump set."""

    kind = "dumps"

    def __init__(self, names: Sequence[str], dump_set: DumpSet) -> None:
        super().__init__(names)
        self.dump_set = dump_set

    @property
    def request_ids(self) -> list[str]:
        return list(self.dump_set.request_ids)

    def inventory(self) -> Inventory:
        dumps = self.dump_set.dumps
        return Inventory(
            self.kind,
            self.names,
            [_dump_inventory(dump) for dump in dumps],
            self.dump_set.complete,
            list(self.dump_set.missing),
            _request_inventory(dump.requests for dump in dumps),
        )

    def work(self, request_ids: Sequence[str] | None) -> int:
        ids = self.request_ids if request_ids is None else list(request_ids)
        return total_bytes(self.dump_set, ids)

    def token_counts(self) -> dict[str, int]:
        return _token_counts(dump.requests for dump in self.dump_set.dumps)

    def trimmed(self, num_tokens: Mapping[str, int]) -> DumpSource:
        dumps = [
            dataclasses.replace(dump, requests=_trim(dump.requests, num_tokens))
            for dump in self.dump_set.dumps
        ]
        trimmed = DumpSet(dumps, self.dump_set.complete, list(self.dump_set.missing))
        return DumpSource(self.names, trimmed)

    def raw_kv(self) -> DumpSet:
        return self.dump_set

    def _stated_worker(self) -> WorkerInfo | None:
        return self.dump_set.dumps[0].worker if self.dump_set.dumps else None

    def checksum(
        self,
        request_ids: Sequence[str] | None,
        positions: str | None,
        runtime: Runtime,
        progress: Progress | None = None,
    ) -> Record:
        return checksum_dump_set(
            self.dump_set,
            request_ids=None if request_ids is None else list(request_ids),
            positions=positions or "request",
            backend=runtime.backend,
            device=runtime.device,
            progress=progress,
        )


class RecordSource(Source):
    """A record saved by ``kvaudit checksum --format json``."""

    kind = "record"

    def __init__(self, name: str, record: Record) -> None:
        super().__init__([name])
        self.record = record

    @property
    def request_ids(self) -> list[str]:
        return list(self.record.requests)

    def token_counts(self) -> dict[str, int]:
        return {rid: request.num_tokens for rid, request in self.record.requests.items()}

    def inventory(self) -> Inventory:
        block_sizes: dict[int, int] = {}
        requests: dict[str, RequestInventory] = {}
        for request_id, request in self.record.requests.items():
            held = {}
            for gid, group in request.groups.items():
                block_sizes.setdefault(gid, group.block_size)
                held[gid] = (group.start, range(group.count))
            _add_request(requests, request_id, request.num_tokens, held)
        workers = []
        for summary in self.record.workers:
            gids = sorted(set(summary.fingerprints) | set(summary.not_covered))
            groups = [
                GroupInfo(
                    id=gid,
                    fingerprint=summary.fingerprints.get(gid, 0),
                    covered=gid not in summary.not_covered,
                    reason=summary.not_covered.get(gid),
                    block_size=block_sizes.get(gid),
                )
                for gid in gids
            ]
            workers.append(WorkerInventory(summary.worker, None, groups))
        return Inventory(
            self.kind,
            self.names,
            workers,
            self.record.complete,
            list(self.record.missing_workers),
            requests,
        )

    def _stated_worker(self) -> WorkerInfo | None:
        return self.record.workers[0].worker if self.record.workers else None

    def checksum(
        self,
        request_ids: Sequence[str] | None,
        positions: str | None,
        runtime: Runtime,
        progress: Progress | None = None,
    ) -> Record:
        record = self.record
        if positions is not None and positions != record.positions:
            raise KvauditError(
                f"the record numbers positions by {record.positions}, not {positions}; "
                "checksum the dumps again to renumber them",
                self.names[0],
            )
        if request_ids is None:
            return record
        return Record(
            record.positions,
            record.workers,
            record.complete,
            {request_id: record.requests[request_id] for request_id in request_ids},
            list(record.missing_workers),
        )


@dataclass
class LiveWorker:
    """One worker handed over by a ``kvaudit_live()`` function: its cache (``num_blocks``
    blocks, engine block ids), who it is, and its requests' blocks."""

    name: str
    description: CacheDescription
    tensors: Mapping[str, LayerTensor]
    worker: WorkerInfo
    num_blocks: int
    requests: dict[str, RequestBlocks]

    def checksummer(self, runtime: Runtime | None = None) -> Checksummer:
        """A checksummer of the worker's tensors: moved to ``runtime``'s device first, or
        where they are (the backend that suits their device) when ``runtime`` is None."""
        tensors = self.tensors
        if runtime is not None:
            tensors = {name: _to_device(tensor, runtime.device) for name, tensor in tensors.items()}
        worker = self.worker
        with _live_errors(self.name):
            return Checksummer(
                self.description,
                tensors,
                tp_rank=worker.tp_rank,
                tp_size=worker.tp_size,
                pp_rank=worker.pp_rank,
                pp_size=worker.pp_size,
                role=worker.role,
                backend="auto" if runtime is None else runtime.backend,
                num_blocks=self.num_blocks,
                engine=worker.engine,
                source=self.name,
            )

    def as_dump(self) -> Dump:
        """The worker's tensors as an in-memory dump of its whole cache (for locating)."""
        return live_dump(
            self.name, self.worker, self.description, self.tensors, self.num_blocks, self.requests
        )


class LiveSource(Source):
    """Workers of a running process, each from its ``live:PATH`` handle."""

    kind = "live"

    def __init__(self, workers: Sequence[LiveWorker], device_given: bool) -> None:
        super().__init__([worker.name for worker in workers])
        self.workers = list(workers)
        self.device_given = device_given

    @property
    def request_ids(self) -> list[str]:
        return _request_ids(worker.requests for worker in self.workers)

    def inventory(self) -> Inventory:
        workers = []
        for live in self.workers:
            with _live_errors(live.name):
                workers.append(_dump_inventory(live.as_dump()))
        layout = _layout([live.worker for live in self.workers])
        return Inventory(
            self.kind,
            self.names,
            workers,
            layout.complete,
            layout.missing_workers,
            _request_inventory(live.requests for live in self.workers),
        )

    def checksum(
        self,
        request_ids: Sequence[str] | None,
        positions: str | None,
        runtime: Runtime,
        progress: Progress | None = None,
    ) -> Record:
        placement = runtime if self.device_given else None
        workers = ((live.checksummer(placement), live.requests) for live in self.workers)
        return _checksum_workers(workers, request_ids, positions)

    def token_counts(self) -> dict[str, int]:
        return _token_counts(worker.requests for worker in self.workers)

    def trimmed(self, num_tokens: Mapping[str, int]) -> LiveSource:
        workers = [
            dataclasses.replace(worker, requests=_trim(worker.requests, num_tokens))
            for worker in self.workers
        ]
        return LiveSource(workers, self.device_given)

    def raw_kv(self) -> DumpSet:
        return _live_set([worker.as_dump() for worker in self.workers])


class ChecksummerSource(Source):
    """One engine's workers handed over in Python as ``Checksummer`` objects, with the
    requests' blocks of each worker and, optionally, the tensors each checksummer was built
    over (with them, differences can be located)."""

    kind = "live"

    def __init__(
        self,
        checksummers: Sequence[Checksummer],
        requests: Sequence[Mapping[str, RequestBlocks]],
        tensors: Sequence[Mapping[str, LayerTensor]] | None = None,
        name: str = "live",
    ) -> None:
        if not checksummers:
            raise KvauditError("no checksummers given", name)
        if len(requests) != len(checksummers):
            raise KvauditError(
                f"{len(checksummers)} checksummers but {len(requests)} request mappings", name
            )
        if tensors is not None and len(tensors) != len(checksummers):
            raise KvauditError(
                f"{len(checksummers)} checksummers but {len(tensors)} tensor mappings", name
            )
        super().__init__([name])
        self.checksummers = list(checksummers)
        self.requests = [dict(mapping) for mapping in requests]
        self.tensors = None if tensors is None else list(tensors)

    @property
    def request_ids(self) -> list[str]:
        return _request_ids(self.requests)

    def inventory(self) -> Inventory:
        workers = [
            WorkerInventory(
                summer.worker,
                summer.num_blocks,
                [_group_info(views, None) for _, views in sorted(summer.groups.items())],
            )
            for summer in self.checksummers
        ]
        layout = _layout([summer.worker for summer in self.checksummers])
        return Inventory(
            self.kind,
            self.names,
            workers,
            layout.complete,
            layout.missing_workers,
            _request_inventory(self.requests),
        )

    def checksum(
        self,
        request_ids: Sequence[str] | None,
        positions: str | None,
        runtime: Runtime,
        progress: Progress | None = None,
    ) -> Record:
        workers = zip(self.checksummers, self.requests, strict=True)
        return _checksum_workers(workers, request_ids, positions)

    def token_counts(self) -> dict[str, int]:
        return _token_counts(self.requests)

    def trimmed(self, num_tokens: Mapping[str, int]) -> ChecksummerSource:
        requests = [_trim(mapping, num_tokens) for mapping in self.requests]
        return ChecksummerSource(self.checksummers, requests, self.tensors, self.names[0])

    def raw_kv(self) -> DumpSet | None:
        if self.tensors is None:
            return None
        dumps = []
        for summer, mapping, tensors in zip(
            self.checksummers, self.requests, self.tensors, strict=True
        ):
            name = summer.worker.source or (
                f"{self.names[0]} pp{summer.worker.pp_rank} tp{summer.worker.tp_rank}"
            )
            worker = dataclasses.replace(summer.worker, source=name)
            dumps.append(
                live_dump(name, worker, summer.description, tensors, summer.num_blocks, mapping)
            )
        return _live_set(dumps)


def live_dump(
    name: str,
    worker: WorkerInfo,
    description: CacheDescription,
    tensors: Mapping[str, LayerTensor],
    num_blocks: int,
    requests: Mapping[str, RequestBlocks],
) -> Dump:
    """Live tensors of a whole cache (``num_blocks`` blocks, engine block ids) wrapped as
    a ``Dump``, so that what reads dumps (locating differences) reads them in place."""
    listed = {
        request_id: DumpRequest(
            blocks.num_tokens,
            {
                int(gid): (int(start), [int(b) for b in ids])
                for gid, (start, ids) in blocks.groups.items()
            },
        )
        for request_id, blocks in requests.items()
    }
    return Dump(
        path=name,
        worker=worker,
        description=description,
        tensors=dict(tensors),
        num_rows=num_blocks,
        block_ids=None,
        requests=listed,
    )


def _layout(workers: Sequence[WorkerInfo]) -> Record:
    """An empty record of one engine's workers: it raises where their ranks clash or
    disagree on the TP and PP sizes, and says which workers are missing."""
    return combine_workers([WorkerRecord(worker, "request", {}, {}, {}) for worker in workers])


def _live_set(dumps: list[Dump]) -> DumpSet:
    """Live workers' dumps as one set, sorted and with its missing workers."""
    layout = _layout([dump.worker for dump in dumps])
    dumps = sorted(dumps, key=lambda dump: (dump.worker.pp_rank, dump.worker.tp_rank))
    return DumpSet(dumps, layout.complete, layout.missing_workers)


def _checksum_workers(
    workers: Iterable[tuple[Checksummer, Mapping[str, RequestBlocks]]],
    request_ids: Sequence[str] | None,
    positions: str | None,
) -> Record:
    """Each worker's checksums of those of its requests asked for (all when
    ``request_ids`` is None), summed into one record."""
    records = []
    for summer, requests in workers:
        if request_ids is not None:
            requests = {rid: requests[rid] for rid in request_ids if rid in requests}
        records.append(summer.checksum(requests, positions or "request"))
    return combine_workers(records)


def _request_ids(mappings: Iterable[Mapping[str, object]]) -> list[str]:
    """The request ids of the workers' mappings, each once, in order of appearance."""
    return list(dict.fromkeys(rid for mapping in mappings for rid in mapping))


def _token_counts(mappings: Iterable[Mapping[str, DumpRequest | RequestBlocks]]) -> dict[str, int]:
    """Each request's token count, from the first worker that lists it."""
    counts: dict[str, int] = {}
    for mapping in mappings:
        for request_id, request in mapping.items():
            counts.setdefault(request_id, request.num_tokens)
    return counts


def _trim(requests: Mapping[str, _Listed], num_tokens: Mapping[str, int]) -> dict[str, _Listed]:
    """The requests with each one in ``num_tokens`` cut to at most that many tokens."""
    return {
        rid: (
            dataclasses.replace(request, num_tokens=min(request.num_tokens, num_tokens[rid]))
            if rid in num_tokens
            else request
        )
        for rid, request in requests.items()
    }


def open_source(
    names: Sequence[str], config: CacheDescription | None = None, *, device_given: bool = False
) -> Source:
    """Resolve a command's SOURCE arguments (see the module's docstring).

    ``config`` supplies or overrides the dumps' and live workers' description.
    ``device_given``: live tensors move to ``--device`` when it was given, else they are
    checksummed where they are.

    Raises:
        KvauditError: A source that does not exist or cannot be read, or a mix of kinds.

    """
    if not names:
        raise KvauditError("no SOURCE given")
    live = [name for name in names if name.startswith(LIVE_PREFIX)]
    if live:
        if len(live) != len(names):
            raise KvauditError("live: handles cannot be mixed with dumps or records")
        workers = [_load_live(name, config) for name in names]
        return LiveSource(workers, device_given)
    records = [name for name in names if _is_record(name)]
    if records:
        if len(names) != 1:
            raise KvauditError(
                f"{records[0]}: a record stands alone; give one record, or dumps without records"
            )
        return RecordSource(records[0], load_record(records[0]))
    return DumpSource(names, open_dump_set(names, config))


def load_record(path: str) -> Record:
    """Read a record JSON file.

    Raises:
        KvauditError: The file is missing, not JSON, or not a record; the message names it.

    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvauditError("no such file", path) from None
    except UnicodeDecodeError:
        raise KvauditError("not a UTF-8 text file, expected a record (JSON)", path) from None
    except OSError as error:
        raise KvauditError(f"cannot read: {error.strerror}", path) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise KvauditError(
            f"line {error.lineno}: not valid JSON ({error.msg}), expected a record", path
        ) from None
    return Record.from_json(data, path)


def _is_record(name: str) -> bool:
    """A record: a ``.json`` file, or a file whose first non-blank byte is ``{``."""
    if name.lower().endswith(RECORD_SUFFIX):
        return True
    if name.lower().endswith(DUMP_SUFFIX) or not os.path.isfile(name):
        return False
    try:
        with open(name, "rb") as handle:
            head = handle.read(64)
    except OSError:
        return False
    # A safetensors file starts with an 8-byte header length, never with "{".
    return head.lstrip()[:1] == b"{"


def _load_live(name: str, config: CacheDescription | None) -> LiveWorker:
    """Import a ``live:PATH`` handle and call its ``kvaudit_live()``."""
    target = name[len(LIVE_PREFIX) :]
    if not target:
        raise KvauditError("expected live:PATH, a Python file or module", name)
    module = _import_live(name, target)
    function = getattr(module, LIVE_FUNCTION, None)
    if not callable(function):
        raise KvauditError(f"defines no {LIVE_FUNCTION}() function", name)
    try:
        result = function()
    except KvauditError:
        raise
    except Exception as error:
        raise KvauditError(f"{LIVE_FUNCTION}() raised {_one_line(error)}", name) from None
    if not isinstance(result, (tuple, list)) or len(result) != 4:
        raise KvauditError(
            f"{LIVE_FUNCTION}() must return (description, tensors, rank, requests)", name
        )
    description, tensors, rank, requests = result
    if config is not None:
        description = config
    elif isinstance(description, (str, os.PathLike)):
        description = load_description(description)
    elif isinstance(description, Mapping):
        description = parse_description(description, name)
    elif not isinstance(description, CacheDescription):
        raise KvauditError(
            f"{LIVE_FUNCTION}(): the description must be a CacheDescription, a dict or a "
            f"YAML path, got {type(description).__name__}",
            name,
        )
    if not isinstance(tensors, Mapping):
        raise KvauditError(f"{LIVE_FUNCTION}(): tensors must be a dict of layer tensors", name)
    if not isinstance(rank, Mapping) or any(key not in _RANK_KEYS for key in rank):
        raise KvauditError(
            f"{LIVE_FUNCTION}(): rank must be a dict with keys among {', '.join(_RANK_KEYS)}",
            name,
        )
    listed = _live_requests(name, requests)
    num_blocks = rank.get("num_blocks")
    return LiveWorker(
        name,
        description,
        tensors,
        _live_worker_info(name, rank),
        description.num_blocks if num_blocks is None else num_blocks,
        listed,
    )


def _live_worker_info(name: str, rank: Mapping[str, Any]) -> WorkerInfo:
    """The worker a handle's ``rank`` dict describes (a consumer by default).

    Raises:
        KvauditError: An unknown role, or a rank outside its size; the message names the
            handle.

    """
    worker = WorkerInfo(
        tp_rank=rank.get("tp_rank", 0),
        tp_size=rank.get("tp_size", 1),
        pp_rank=rank.get("pp_rank", 0),
        pp_size=rank.get("pp_size", 1),
        role=rank.get("role", "consumer"),
        engine=rank.get("engine", ""),
        source=name,
    )
    # A Checksummer's checks, made here too: inspect builds none, yet must reject what
    # checksum rejects.
    with _live_errors(name):
        check_worker(worker, worker.role, name)
    return worker


def _import_live(name: str, target: str) -> Any:
    """The module of a live handle: a file path, or an importable module name."""
    try:
        if target.endswith(".py") or os.path.sep in target or os.path.isfile(target):
            if not os.path.isfile(target):
                raise KvauditError("no such Python file", name)
            # One module name per file: two handles' files may share a file name.
            digest = hashlib.sha256(os.path.abspath(target).encode()).hexdigest()[:16]
            module_name = f"kvaudit_live_{digest}"
            spec = importlib.util.spec_from_file_location(module_name, target)
            if spec is None or spec.loader is None:
                raise KvauditError("cannot load as a Python file", name)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # dataclasses look their module up
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
            return module
        return importlib.import_module(target)
    except KvauditError:
        raise
    except Exception as error:
        raise KvauditError(f"cannot import: {_one_line(error)}", name) from None


def _live_requests(name: str, requests: object) -> dict[str, RequestBlocks]:
    """``kvaudit_live()``'s requests as ``RequestBlocks``."""
    if not isinstance(requests, Mapping):
        raise KvauditError(f"{LIVE_FUNCTION}(): requests must be a dict", name)
    result = {}
    for request_id, blocks in requests.items():
        if isinstance(blocks, RequestBlocks):
            result[str(request_id)] = blocks
            continue
        try:
            groups = {
                int(gid): (start, list(block_ids))
                for gid, (start, block_ids) in blocks["groups"].items()
            }
            result[str(request_id)] = RequestBlocks(blocks["num_tokens"], groups)
        except (KeyError, TypeError, ValueError):
            raise KvauditError(
                f"{LIVE_FUNCTION}(): request {request_id!r}: expected "
                '{"num_tokens": n, "groups": {id: [start, [block ids]]}}',
                name,
            ) from None
    return result


@contextmanager
def _live_errors(name: str) -> Iterator[None]:
    """Report what a live worker's tensors or ranks make the library raise as one line
    naming its handle."""
    try:
        yield
    except KvauditError:
        raise
    except (ValueError, TypeError, RuntimeError) as error:
        raise KvauditError(_one_line(error), name) from None


def _to_device(tensor: LayerTensor, device: str) -> LayerTensor:
    """A layer's tensor (or K and V tensors) on ``device``."""
    if isinstance(tensor, tuple):
        return tuple(part.to(device) for part in tensor)
    return tensor.to(device)


def _one_line(error: BaseException) -> str:
    """An exception as ``Type: message`` on one line."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _tensor_bytes(tensor: LayerTensor | None) -> int:
    """The bytes of a layer's tensor (or K and V tensors); 0 for none."""
    if tensor is None:
        return 0
    if isinstance(tensor, tuple):
        return sum(part.numel() * part.element_size() for part in tensor)
    return tensor.numel() * tensor.element_size()


def _dump_inventory(dump: Dump) -> WorkerInventory:
    """One dump's worker, rows and groups (from its views, built once per dump)."""
    groups = [_group_info(views, dump.tensors) for views in dump.group_views.values()]
    return WorkerInventory(dump.worker, dump.num_rows, groups)


def _group_info(views: GroupViews, tensors: Mapping[str, LayerTensor] | None) -> GroupInfo:
    """A group's spec, coverage and fingerprint on one worker, and the bytes of the layer
    tensors it owns in ``tensors`` (None without tensors)."""
    group = views.group
    spec = group.spec
    size = None
    if tensors is not None:
        owned = [layer.name for layer in group.layers if layer.shares is None]
        size = sum(_tensor_bytes(tensors.get(name)) for name in owned)
    return GroupInfo(
        id=group.id,
        fingerprint=views.fingerprint,
        covered=views.covered,
        reason=views.reason,
        type=spec.type,
        block_size=spec.block_size,
        kernel_block_size=spec.kernel_block_size,
        layout="state" if spec.is_state else spec.layout,
        layers=len(group.layers),
        bytes=size,
    )


def _request_inventory(
    mappings: Iterable[Mapping[str, DumpRequest | RequestBlocks]],
) -> dict[str, RequestInventory]:
    """Each request the workers' mappings list, with the positions some worker holds."""
    requests: dict[str, RequestInventory] = {}
    for mapping in mappings:
        for request_id, request in mapping.items():
            _add_request(requests, request_id, request.num_tokens, request.groups)
    return requests


def _add_request(
    requests: dict[str, RequestInventory],
    request_id: str,
    num_tokens: int,
    groups: Mapping[int, tuple[int, Sequence[int]]],
) -> None:
    """Add one worker's listing of a request: per group, its first position and blocks."""
    entry = requests.setdefault(request_id, RequestInventory(num_tokens))
    for gid, (start, block_ids) in groups.items():
        entry.positions.setdefault(int(gid), set()).update(range(start, start + len(block_ids)))


__all__ = [
    "ChecksummerSource",
    "DumpSource",
    "GroupInfo",
    "Inventory",
    "LiveSource",
    "Progress",
    "RecordSource",
    "RequestInventory",
    "Runtime",
    "Source",
    "WorkerInventory",
    "live_dump",
    "load_record",
    "open_source",
    "resolve_device",
]
