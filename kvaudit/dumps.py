"""KV cache dumps: what one worker held for some requests, as one safetensors file.

``open_dump`` and ``open_dump_set`` read dumps strictly (every problem is one line naming
the file) and memory-map their tensors, so nothing is loaded whole; ``checksum_dump_set``
checksums a set in batches of rows with bounded memory; ``write_dump`` writes a worker's
live tensors atomically, every tensor 64-byte aligned (docs/dump-format.md).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import itertools
import json
import math
import mmap
import os
import secrets
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import numpy as np
import torch

from .checksummer import ROLES, Checksummer, RequestBlocks
from .description import CacheDescription, LayerEntry, LayerSpec, description_to_dict
from .description import parse_description as _parse_description
from .dtypes import dtype_name, dtype_size, parse_dtype, safetensors_dtype_name
from .errors import KvauditError
from .records import (
    POSITION_NUMBERINGS,
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    combine_workers,
)
from .views import LayerTensor

FORMAT = "1"
"""The dump format version a dump's ``kvaudit.format`` gives."""

STORED_CHECKSUMS = "kvaudit/stored_checksums"
PAD_PREFIX = "kvaudit/pad/"
"""Names of the U8 tensors a writer inserts so that every tensor starts 64-byte aligned."""

ALIGNMENT = 64
BATCH_BYTES = 64 << 20
"""Dumped bytes ``checksum_dump_set`` reads per batch before dropping the mapped pages."""

COPY_BYTES = 64 << 20
"""Bytes per copy when writing a dump or moving its tensors to a device."""

EXAMPLE_CONNECTOR_TENSOR = "kv_cache"

_META_FORMAT = "kvaudit.format"
_META_WORKER = "kvaudit.worker"
_META_CACHE = "kvaudit.cache"
_META_REQUESTS = "kvaudit.requests"
_META_BLOCKS = "kvaudit.blocks"
_META_KEYS = (_META_FORMAT, _META_WORKER, _META_CACHE, _META_REQUESTS, _META_BLOCKS)
_WORKER_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "role", "engine")
_REQUEST_KEYS = ("num_tokens", "groups", "block_hashes", "received")
_LENGTH = struct.Struct("<Q")
_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# Dumps.


@dataclass
class DumpRequest:
    """One request as a dump lists it: its token count and, per group, the position of
    the first listed block and the ENGINE block ids of consecutive positions; the
    block hashes of the leading listed blocks and the producer's wire bytes, if given."""

    num_tokens: int
    groups: dict[int, tuple[int, list[int]]]
    block_hashes: dict[int, list[bytes]] = field(default_factory=dict)
    received: bytes | None = None


@dataclass
class Dump:
    """One worker's dump, opened and checked, its tensors memory-mapped (read-only).

    ``tensors`` holds each layer's cache (K and V tensors for layouts that keep them
    apart) whose ``N`` axis (state layers: first axis) is the dumped rows' kernel blocks;
    row ``i`` is engine block ``block_ids[i]``, or block ``i`` when ``block_ids`` is None
    (the whole cache). The tensors view the file's pages: never write to them.
    """

    path: str
    worker: WorkerInfo
    description: CacheDescription
    tensors: dict[str, LayerTensor]
    num_rows: int
    block_ids: list[int] | None
    requests: dict[str, DumpRequest]
    stored_checksums: np.ndarray | None = None
    # The file mappings the tensors view (kept open as long as the dump is).
    maps: list[mmap.mmap] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rows: dict[int, int] | None = None
        if self.block_ids is not None:
            self._rows = {block_id: row for row, block_id in enumerate(self.block_ids)}

    def holds(self, block_id: int) -> bool:
        """Whether the dump holds a row of this engine block."""
        if self._rows is not None:
            return block_id in self._rows
        return 0 <= block_id < self.num_rows

    def row_of(self, block_id: int) -> int:
        """The row that holds an engine block.

        Raises:
            KvauditError: The dump does not hold the block.

        """
        if not self.holds(block_id):
            raise KvauditError(f"the dump does not hold block {block_id}", source=self.path)
        return self._rows[block_id] if self._rows is not None else block_id

    def request_blocks(self, request_ids: Iterable[str] | None = None) -> dict[str, RequestBlocks]:
        """The requests' blocks as rows of this dump (all requests by default), for a
        ``Checksummer`` over ``tensors``.

        Raises:
            KvauditError: A request the dump does not list.

        """
        ids = list(self.requests) if request_ids is None else list(dict.fromkeys(request_ids))
        result = {}
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                raise KvauditError(f"no request {request_id!r} in this dump", source=self.path)
            result[request_id] = RequestBlocks(
                request.num_tokens,
                {
                    group_id: (start, [self.row_of(block_id) for block_id in block_ids])
                    for group_id, (start, block_ids) in request.groups.items()
                },
            )
        return result

    def row_bytes(self) -> dict[int, int]:
        """Per group, the bytes of one dumped row its checksummed layers read."""
        result = {}
        for group in self.description.groups:
            total = 0
            for entry in group.layers:
                if entry.shares is not None or entry.name in self.description.draft_layers:
                    continue
                tensor = self.tensors.get(entry.name)
                if tensor is not None:
                    total += sum(_nbytes(part) for part in _parts(tensor))
            result[group.id] = total // self.num_rows if self.num_rows else 0
        return result

    def drop_pages(self) -> None:
        """Drop the mapped pages this process holds resident; they are read again from the
        file (or the page cache) when next touched."""
        for mapped in self.maps:
            mapped.madvise(mmap.MADV_DONTNEED)

    def checksummer(
        self, *, backend: str = "auto", device: str | torch.device = "cpu"
    ) -> Checksummer:
        """A ``Checksummer`` over the dump's rows, with the dump's ranks and role; for a
        device other than the CPU, the tensors are copied there in bounded pieces first."""
        target = torch.device(device)
        tensors = self.tensors
        if target.type != "cpu":
            tensors = {name: self._to_device(tensor, target) for name, tensor in tensors.items()}
        return Checksummer(
            self.description,
            tensors,
            tp_rank=self.worker.tp_rank,
            tp_size=self.worker.tp_size,
            pp_rank=self.worker.pp_rank,
            pp_size=self.worker.pp_size,
            role=self.worker.role,
            backend=backend,
            num_blocks=self.num_rows,
            engine=self.worker.engine,
            source=self.path,
        )

    def _to_device(self, tensor: LayerTensor, target: torch.device) -> LayerTensor:
        if isinstance(tensor, tuple):
            return (self._to_device(tensor[0], target), self._to_device(tensor[1], target))
        if not tensor.is_contiguous():
            return tensor.to(target)
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=target)
        source, dest = _as_integers(tensor.reshape(-1)), _as_integers(out.view(-1))
        step = max(1, COPY_BYTES // tensor.element_size())
        for start in range(0, source.numel(), step):
            dest[start : start + step].copy_(source[start : start + step])
            self.drop_pages()
        return out


@dataclass
class DumpSet:
    """One engine's dumps, sorted by ``(pp_rank, tp_rank)``; ``missing`` lists the
    ``(pp_rank, tp_rank)`` of its layout that no dump holds."""

    dumps: list[Dump]
    complete: bool
    missing: list[tuple[int, int]] = field(default_factory=list)

    @property
    def request_ids(self) -> list[str]:
        """Every request some dump lists, sorted."""
        return sorted({request_id for dump in self.dumps for request_id in dump.requests})


# Reading safetensors.


@dataclass(frozen=True)
class _Entry:
    """A tensor of a safetensors file: its dtype, shape and absolute byte range."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass
class _Header:
    """A safetensors file's tensors and string metadata."""

    tensors: dict[str, _Entry]
    metadata: dict[str, str]


def _fail(source: str, message: str) -> NoReturn:
    raise KvauditError(message, source=source)


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict, str)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _read_header(path: str) -> _Header:
    """Parse a safetensors header and check that every tensor's bytes lie in the file."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(8)
            if len(head) < 8:
                _fail(path, f"not a safetensors file: {size} bytes, less than the 8-byte length")
            (length,) = _LENGTH.unpack(head)
            if length > size - 8:
                _fail(
                    path,
                    f"not a safetensors file or truncated: its header length is {length} "
                    f"bytes, only {size - 8} follow",
                )
            raw = file.read(length)
    except FileNotFoundError:
        _fail(path, "no such file")
    except IsADirectoryError:
        _fail(path, "is a directory, expected a safetensors file")
    except OSError as error:
        _fail(path, f"cannot read: {error.strerror}")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        _fail(path, "not a safetensors file: its header is not JSON")
    if not isinstance(header, dict):
        _fail(path, "not a safetensors file: its header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        _fail(path, "invalid safetensors header: __metadata__ must map strings to strings")
    data_start = 8 + length
    entries = {
        name: _header_entry(path, name, info, data_start, size) for name, info in header.items()
    }
    ranges = sorted(entries.values(), key=lambda entry: (entry.start, entry.nbytes))
    for before, after in itertools.pairwise(ranges):
        if after.start < before.start + before.nbytes:
            _fail(
                path, f"invalid safetensors header: tensors {before.name} and {after.name} overlap"
            )
    return _Header(entries, metadata)


def _header_entry(path: str, name: str, info: object, data_start: int, size: int) -> _Entry:
    where = f"invalid safetensors header: tensor {name}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        _fail(path, f"{where}: expected dtype, shape and data_offsets")
    type_name = info["dtype"]
    try:
        dtype = parse_dtype(type_name)
        if safetensors_dtype_name(dtype) != type_name:
            raise ValueError
    except ValueError:
        _fail(path, f"{where}: unknown dtype {_short(type_name)}")
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        _fail(path, f"{where}: shape {_short(shape)} is not a list of sizes")
    offsets = info["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(n) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        _fail(path, f"{where}: data_offsets {_short(offsets)} is not [begin, end]")
    nbytes = math.prod(shape) * dtype_size(dtype)
    if offsets[1] - offsets[0] != nbytes:
        _fail(
            path,
            f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its "
            f"shape and dtype need {nbytes}",
        )
    if data_start + offsets[1] > size:
        _fail(
            path,
            f"truncated: tensor {name} ends at byte {data_start + offsets[1]}, the file has "
            f"{size} bytes",
        )
    return _Entry(name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _map(path: str) -> mmap.mmap:
    try:
        with open(path, "rb") as file:
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        _fail(path, f"cannot map: {error.strerror}")


def _view(mapped: mmap.mmap, entry: _Entry) -> torch.Tensor:
    """A tensor over a mapped file's bytes (no copy)."""
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    with warnings.catch_warnings():
        # The mapping is read-only and torch has no read-only tensors; nothing writes it.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=entry.start)
    return raw.view(entry.dtype).reshape(entry.shape)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# Metadata.


def _json(metadata: Mapping[str, str], key: str, source: str) -> Any:
    try:
        return json.loads(metadata[key])
    except ValueError as error:
        _fail(source, f"{key}: not valid JSON ({error})")


def _parse_worker(metadata: Mapping[str, str], source: str) -> WorkerInfo:
    if _META_WORKER not in metadata:
        _fail(source, f"no {_META_WORKER} in the metadata")
    data = _json(metadata, _META_WORKER, source)
    where = _META_WORKER
    if not isinstance(data, dict):
        _fail(source, f"{where}: expected a JSON object, got {_short(data)}")
    for key in data:
        if key not in _WORKER_KEYS:
            _fail(source, f"{where}.{key}: unknown key; expected {', '.join(_WORKER_KEYS)}")
    values = {}
    for key in ("tp_size", "pp_size", "tp_rank", "pp_rank"):
        value = data.get(key)
        minimum = 1 if key.endswith("size") else 0
        if not _is_int(value) or value < minimum:
            kind = "a positive" if minimum else "a non-negative"
            _fail(source, f"{where}.{key}: expected {kind} integer, got {_short(value)}")
        values[key] = int(value)
    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
        if values[rank] >= values[size]:
            _fail(source, f"{where}.{rank}: {values[rank]} is not below {size} {values[size]}")
    role = data.get("role")
    if role not in ROLES:
        _fail(source, f"{where}.role: expected one of {', '.join(ROLES)}, got {_short(role)}")
    engine = data.get("engine", "")
    if not isinstance(engine, str):
        _fail(source, f"{where}.engine: expected a string, got {_short(engine)}")
    return WorkerInfo(role=role, engine=engine, source=source, **values)


def _embedded_description(metadata: Mapping[str, str], source: str) -> CacheDescription:
    if _META_CACHE not in metadata:
        _fail(
            source, f"no cache description: the dump has no {_META_CACHE} and no --config was given"
        )
    data = _json(metadata, _META_CACHE, source)
    return _parse_description(data, f"{source} ({_META_CACHE})")


def _parse_blocks(
    metadata: Mapping[str, str], description: CacheDescription, source: str
) -> list[int] | None:
    if _META_BLOCKS not in metadata:
        return None
    data = _json(metadata, _META_BLOCKS, source)
    if not isinstance(data, list):
        _fail(source, f"{_META_BLOCKS}: expected a list of block ids, got {_short(data)}")
    seen: set[int] = set()
    for index, block_id in enumerate(data):
        if not _is_int(block_id) or not 0 <= block_id < description.num_blocks:
            _fail(
                source,
                f"{_META_BLOCKS}[{index}]: expected a block id from 0 to "
                f"{description.num_blocks - 1}, got {_short(block_id)}",
            )
        if block_id in seen:
            _fail(source, f"{_META_BLOCKS}[{index}]: block {block_id} is listed twice")
        seen.add(block_id)
    return [int(block_id) for block_id in data]


def _check_group_blocks(
    source: str,
    where: str,
    start: object,
    block_ids: object,
    holds: Callable[[int], bool],
    not_held: str,
) -> None:
    """A group entry's start position and block ids: integers, held, none listed twice."""
    if not _is_int(start) or start < 0:
        _fail(
            source, f"{where}: start position must be a non-negative integer, got {_short(start)}"
        )
    if not isinstance(block_ids, (list, tuple)):
        _fail(source, f"{where}: expected a list of block ids, got {_short(block_ids)}")
    seen: set[int] = set()
    for block_id in block_ids:
        if not _is_int(block_id):
            _fail(source, f"{where}: block id {_short(block_id)} is not an integer")
        if not holds(block_id):
            _fail(source, f"{where}: block {block_id} {not_held}")
        if block_id in seen:
            _fail(source, f"{where}: block {block_id} is listed at two positions")
        seen.add(block_id)


def _group_key(source: str, where: str, key: object, group_ids: set[int]) -> int:
    if not isinstance(key, str) or not key.isdigit() or str(int(key)) != key:
        _fail(source, f"{where}: group key {_short(key)} is not a decimal group id")
    group_id = int(key)
    if group_id not in group_ids:
        _fail(source, f"{where}: group {group_id} is not a group of the cache description")
    return group_id


def _parse_requests(
    metadata: Mapping[str, str],
    description: CacheDescription,
    holds: Callable[[int], bool],
    source: str,
) -> dict[str, DumpRequest]:
    if _META_REQUESTS not in metadata:
        _fail(source, f"no {_META_REQUESTS} in the metadata")
    data = _json(metadata, _META_REQUESTS, source)
    if not isinstance(data, dict):
        _fail(source, f"{_META_REQUESTS}: expected a JSON object, got {_short(data)}")
    group_ids = {group.id for group in description.groups}
    requests = {}
    for request_id, item in data.items():
        where = f"{_META_REQUESTS}: request {request_id!r}"
        if not isinstance(item, dict):
            _fail(source, f"{where}: expected a JSON object, got {_short(item)}")
        for key in item:
            if key not in _REQUEST_KEYS:
                _fail(source, f"{where}: unknown key {key!r}; expected {', '.join(_REQUEST_KEYS)}")
        for key in ("num_tokens", "groups"):
            if key not in item:
                _fail(source, f"{where}: no {key}")
        num_tokens = item["num_tokens"]
        if not _is_int(num_tokens) or num_tokens < 0:
            _fail(
                source,
                f"{where}: num_tokens must be a non-negative integer, got {_short(num_tokens)}",
            )
        groups_data = item["groups"]
        if not isinstance(groups_data, dict):
            _fail(source, f"{where}: groups: expected a JSON object, got {_short(groups_data)}")
        groups: dict[int, tuple[int, list[int]]] = {}
        for key, entry in groups_data.items():
            group_id = _group_key(source, f"{where} groups", key, group_ids)
            group_where = f"{where} group {group_id}"
            if not isinstance(entry, list) or len(entry) != 2:
                _fail(source, f"{group_where}: expected [start, [block ids]], got {_short(entry)}")
            _check_group_blocks(
                source, group_where, entry[0], entry[1], holds, "is not held by the dump"
            )
            groups[group_id] = (int(entry[0]), [int(block_id) for block_id in entry[1]])
        hashes = _parse_hashes(source, where, item.get("block_hashes", {}), groups, group_ids)
        received = item.get("received")
        if received is not None:
            if not isinstance(received, str):
                _fail(source, f"{where}: received: expected base64 text, got {_short(received)}")
            try:
                received = base64.b64decode(received, validate=True)
            except (binascii.Error, ValueError):
                _fail(source, f"{where}: received: not valid base64")
        requests[request_id] = DumpRequest(int(num_tokens), groups, hashes, received)
    return requests


def _parse_hashes(
    source: str,
    where: str,
    data: object,
    groups: Mapping[int, tuple[int, list[int]]],
    group_ids: set[int],
) -> dict[int, list[bytes]]:
    if not isinstance(data, dict):
        _fail(source, f"{where}: block_hashes: expected a JSON object, got {_short(data)}")
    hashes: dict[int, list[bytes]] = {}
    for key, items in data.items():
        group_id = _group_key(source, f"{where} block_hashes", key, group_ids)
        hash_where = f"{where} block_hashes {group_id}"
        listed = len(groups[group_id][1]) if group_id in groups else 0
        if not isinstance(items, list) or len(items) > listed:
            _fail(
                source,
                f"{hash_where}: expected a list of at most {listed} hex hashes, one per "
                "listed block",
            )
        values = []
        for item in items:
            try:
                if not isinstance(item, str) or not item:
                    raise ValueError
                values.append(bytes.fromhex(item))
            except ValueError:
                _fail(source, f"{hash_where}: {_short(item)} is not a hex hash")
        hashes[group_id] = values
    return hashes


# Layer tensors.


def _kernel_blocks(spec: LayerSpec) -> int:
    return spec.block_size // spec.kernel_block_size


def _attention_shapes(spec: LayerSpec, kernel_blocks: int) -> list[tuple[int, ...]]:
    """The expected shapes of an attention layer's tensor (K and V where kept apart)."""
    sizes = {
        "N": kernel_blocks,
        "T": spec.kernel_block_size,
        "H": spec.num_kv_heads,
        "K": 2,
        "D": spec.head_size,
        "C": spec.head_size + spec.head_size_v,
    }
    if _kv_apart(spec):
        return [
            tuple({**sizes, "D": size}[letter] for letter in spec.layout)
            for size in (spec.head_size, spec.head_size_v)
        ]
    return [tuple(sizes[letter] for letter in spec.layout)]


def _kv_apart(spec: LayerSpec) -> bool:
    return "D" in spec.layout and "K" not in spec.layout


def _states_bytes(spec: LayerSpec) -> int:
    return sum(
        math.prod(shape) * dtype_size(dtype)
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )


def _tensor_names(entry: LayerEntry) -> list[str]:
    if not entry.spec.is_state and _kv_apart(entry.spec):
        return [f"{entry.name}/k", f"{entry.name}/v"]
    return [entry.name]


def _owners(description: CacheDescription) -> list[LayerEntry]:
    """The layers that own a cache tensor (every layer but those that share one)."""
    return [entry for group in description.groups for entry in group.layers if entry.shares is None]


def _check_layer(
    source: str,
    entry: LayerEntry,
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    names: Sequence[str],
    rows: int,
    what: str,
) -> None:
    """A layer's tensors against its description: shape and dtype, or a state layer's
    rows and page size."""
    spec = entry.spec
    if spec.is_state:
        shape, dtype = shapes[0], dtypes[0]
        if len(shape) < 1 or shape[0] != rows:
            _fail(
                source,
                f"layer {entry.name}: expected a state tensor of {rows} {what} on its first "
                f"axis, got shape {shape}",
            )
        page = math.prod(shape[1:]) * dtype_size(dtype)
        if page < _states_bytes(spec):
            _fail(
                source,
                f"layer {entry.name}: its pages of {page} bytes (shape {shape}, "
                f"{dtype_name(dtype)}) are smaller than its {_states_bytes(spec)} bytes of states",
            )
        return
    expected = _attention_shapes(spec, rows * _kernel_blocks(spec))
    for name, shape, dtype, want in zip(names, shapes, dtypes, expected, strict=True):
        if tuple(shape) != want:
            _fail(
                source,
                f"tensor {name}: expected shape {want} (layout {spec.layout}, {rows} {what}), "
                f"got {tuple(shape)}",
            )
        if dtype != spec.dtype:
            _fail(
                source,
                f"tensor {name}: expected dtype {dtype_name(spec.dtype)}, got {dtype_name(dtype)}",
            )


def _dump_tensors(
    source: str, header: _Header, description: CacheDescription, rows: int
) -> tuple[dict[str, _Entry | tuple[_Entry, _Entry]], _Entry | None]:
    """Every layer's tensor entries, checked against the description, and the stored
    checksums' entry."""
    found: dict[str, _Entry | tuple[_Entry, _Entry]] = {}
    used: set[str] = set()
    for entry in _owners(description):
        names = _tensor_names(entry)
        present = [name for name in names if name in header.tensors]
        if len(present) < len(names):
            if entry.name in description.draft_layers and not present:
                continue
            expected = " and ".join(names)
            alone = entry.name in header.tensors and len(names) == 2
            hint = f" (layout {entry.spec.layout} keeps K and V apart)" if alone else ""
            _fail(source, f"layer {entry.name} has no tensor: expected {expected}{hint}")
        parts = [header.tensors[name] for name in names]
        _check_layer(
            source,
            entry,
            [part.shape for part in parts],
            [part.dtype for part in parts],
            names,
            rows,
            "rows",
        )
        found[entry.name] = (parts[0], parts[1]) if len(parts) == 2 else parts[0]
        used.update(names)
    stored = header.tensors.get(STORED_CHECKSUMS)
    if stored is not None:
        if stored.dtype != torch.int64 or stored.shape != (rows,):
            _fail(
                source,
                f"tensor {STORED_CHECKSUMS}: expected int64 of shape ({rows},), got "
                f"{dtype_name(stored.dtype)} of shape {stored.shape}",
            )
        used.add(STORED_CHECKSUMS)
    for name, item in header.tensors.items():
        if name in used:
            continue
        if name.startswith(PAD_PREFIX) and item.dtype == torch.uint8 and len(item.shape) == 1:
            continue
        _fail(source, f"tensor {name} is not a layer of the cache description")
    return found, stored


def open_dump(path: str | os.PathLike[str], config: CacheDescription | None = None) -> Dump:
    """Open one worker's dump (or a vLLM ExampleConnector folder), checking it strictly.

    ``config`` overrides the description the dump embeds (and is required by a dump
    without one, and by an ExampleConnector folder).

    Raises:
        KvauditError: One line naming the file and what is wrong (docs/dump-format.md,
            "Reading is strict").
        DescriptionError: The embedded description is invalid (source ``PATH
            (kvaudit.cache)``, with the key path).

    """
    source = os.fspath(path)
    if os.path.isdir(source):
        return _open_example_connector(source, config)
    header = _read_header(source)
    metadata = header.metadata
    version = metadata.get(_META_FORMAT)
    if version is None:
        _fail(source, f"not a kvaudit dump: no {_META_FORMAT} in its metadata")
    if version != FORMAT:
        _fail(source, f"unknown {_META_FORMAT} {version!r}, expected {FORMAT!r}")
    for key in metadata:
        if key.startswith("kvaudit.") and key not in _META_KEYS:
            _fail(source, f"unknown metadata key {key}; expected {', '.join(_META_KEYS)}")
    worker = _parse_worker(metadata, source)
    description = config if config is not None else _embedded_description(metadata, source)
    block_ids = _parse_blocks(metadata, description, source)
    num_rows = len(block_ids) if block_ids is not None else description.num_blocks
    held = set(block_ids) if block_ids is not None else None

    def holds(block_id: int) -> bool:
        return block_id in held if held is not None else 0 <= block_id < num_rows

    requests = _parse_requests(metadata, description, holds, source)
    entries, stored_entry = _dump_tensors(source, header, description, num_rows)

    mapped = _map(source)
    tensors: dict[str, LayerTensor] = {}
    for name, item in entries.items():
        if isinstance(item, tuple):
            tensors[name] = (_view(mapped, item[0]), _view(mapped, item[1]))
        else:
            tensors[name] = _view(mapped, item)
    stored = None
    if stored_entry is not None:
        stored = _view(mapped, stored_entry).numpy().view(np.uint64).copy()
    return Dump(
        path=source,
        worker=worker,
        description=description,
        tensors=tensors,
        num_rows=num_rows,
        block_ids=block_ids,
        requests=requests,
        stored_checksums=stored,
        maps=[mapped],
    )


# ExampleConnector folders.


def _safetensors_files(folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError as error:
        _fail(folder, f"cannot list: {error.strerror}")
    return [
        os.path.join(folder, name)
        for name in names
        if name.endswith(".safetensors") and os.path.isfile(os.path.join(folder, name))
    ]


def _is_example_connector(folder: str) -> bool:
    """Whether a folder holds ExampleConnector files: one ``kv_cache`` tensor per file and
    no kvaudit metadata."""
    files = _safetensors_files(folder)
    if not files:
        return False
    for file in files:
        try:
            header = _read_header(file)
        except KvauditError:
            return False
        if _META_FORMAT in header.metadata or set(header.tensors) != {EXAMPLE_CONNECTOR_TENSOR}:
            return False
    return True


def _open_example_connector(folder: str, config: CacheDescription | None) -> Dump:
    """One request's prompt KV saved by vLLM's ExampleConnector, token-major, as a
    one-request dump whose rows are the request's block positions."""
    if not _is_example_connector(folder):
        _fail(
            folder,
            "is a directory but not an ExampleConnector folder (<layer_name>.safetensors "
            "files, one kv_cache tensor each)",
        )
    if config is None:
        _fail(folder, "an ExampleConnector folder embeds no cache description: give one (--config)")
    files = {
        Path(file).name.removesuffix(".safetensors"): file for file in _safetensors_files(folder)
    }
    layers = [
        entry
        for entry in _owners(config)
        if entry.name in files or entry.name not in config.draft_layers
    ]
    num_tokens: int | None = None
    loaded: dict[str, tuple[LayerEntry, torch.Tensor, str]] = {}
    maps = []
    for entry in layers:
        spec = entry.spec
        file = files.get(entry.name)
        if file is None:
            _fail(folder, f"layer {entry.name} has no file {entry.name}.safetensors")
        if spec.is_state or _kv_apart(spec):
            kind = "a state layer" if spec.is_state else f"layout {spec.layout} keeps K and V apart"
            _fail(
                file, f"layer {entry.name}: {kind}; ExampleConnector saves one kv_cache per layer"
            )
        header = _read_header(file)
        item = header.tensors[EXAMPLE_CONNECTOR_TENSOR]
        layout = spec.layout.replace("N", "")
        tokens = _example_tokens(file, entry, item, layout)
        if num_tokens is not None and tokens != num_tokens:
            _fail(file, f"holds {tokens} tokens, the folder's other layers hold {num_tokens}")
        num_tokens = tokens
        mapped = _map(file)
        maps.append(mapped)
        sizes = _layout_sizes(spec, tokens)
        loaded[entry.name] = (entry, _view(mapped, item).reshape(sizes), layout)
    owners = {entry.name for entry in _owners(config)}
    sharing = {entry.name: entry.shares for group in config.groups for entry in group.layers}
    for name, file in files.items():
        if name in owners:
            continue
        if name in sharing:
            _fail(file, f"layer {name} shares the cache of {sharing[name]}: it has no file")
        _fail(file, f"layer {name} is not a layer of the cache description")
    num_tokens = num_tokens or 0
    rows = {-(-num_tokens // group.block_size) for group in config.groups}
    if len(rows) > 1:
        _fail(folder, "the description's groups have different block sizes; a folder holds one")
    num_rows = rows.pop()
    tensors = {
        name: _blocked(tensor, layout, entry.spec, num_rows)
        for name, (entry, tensor, layout) in loaded.items()
    }
    request = DumpRequest(
        num_tokens, {group.id: (0, list(range(num_rows))) for group in config.groups}
    )
    return Dump(
        path=folder,
        worker=WorkerInfo(0, 1, 0, 1, "producer", "vllm ExampleConnector", folder),
        description=config,
        tensors=tensors,
        num_rows=num_rows,
        block_ids=list(range(num_rows)),
        requests={Path(os.path.abspath(folder)).name: request},
        maps=maps,
    )


def _layout_sizes(spec: LayerSpec, tokens: int) -> tuple[int, ...]:
    """A token-major tensor's shape: the layout without ``N``, ``T`` spanning every token."""
    sizes = {
        "T": tokens,
        "H": spec.num_kv_heads,
        "K": 2,
        "D": spec.head_size,
        "C": spec.head_size + spec.head_size_v,
    }
    return tuple(sizes[letter] for letter in spec.layout.replace("N", ""))


def _example_tokens(file: str, entry: LayerEntry, item: _Entry, layout: str) -> int:
    """The token count of an ExampleConnector tensor, checked against the layout (the
    axes after ``T`` may be merged into one, as vLLM saves them)."""
    spec = entry.spec
    axis = layout.index("T")
    shape = item.shape
    if len(shape) > axis:
        tokens = shape[axis]
        full = _layout_sizes(spec, tokens)
        merged = (*full[: axis + 1], math.prod(full[axis + 1 :]))
        if shape in (full, merged) and item.dtype == spec.dtype:
            return tokens
    want = _layout_sizes(spec, 0)
    expected = "x".join("T" if i == axis else str(n) for i, n in enumerate(want))
    _fail(
        file,
        f"layer {entry.name}: expected kv_cache of shape [{expected}] ({layout}, "
        f"{dtype_name(spec.dtype)}), got {list(shape)} {dtype_name(item.dtype)}",
    )


def _blocked(tensor: torch.Tensor, layout: str, spec: LayerSpec, num_rows: int) -> torch.Tensor:
    """A token-major tensor as the description's layout, with ``N`` kernel blocks (a view;
    a copy padded with zeros only when the tokens do not fill the last block)."""
    axis = layout.index("T")
    tokens = num_rows * spec.block_size
    if tensor.shape[axis] != tokens:
        padded = torch.zeros(
            (*tensor.shape[:axis], tokens, *tensor.shape[axis + 1 :]), dtype=tensor.dtype
        )
        padded.narrow(axis, 0, tensor.shape[axis]).copy_(tensor)
        tensor = padded
    kernel = spec.kernel_block_size
    blocked = tensor.unflatten(axis, (tokens // kernel, kernel))
    letters = layout[:axis] + "NT" + layout[axis + 1 :]
    return blocked.permute([letters.index(letter) for letter in spec.layout])


# Dump sets.


def _expand(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Dump files and ExampleConnector folders: each path, or a directory's files."""
    result = []
    for path in paths:
        source = os.fspath(path)
        if os.path.isdir(source):
            if _is_example_connector(source):
                result.append(source)
                continue
            files = _safetensors_files(source)
            if not files:
                _fail(source, "no .safetensors files in this directory")
            result.extend(files)
        elif os.path.exists(source):
            result.append(source)
        else:
            _fail(source, "no such file or directory")
    return result


def open_dump_set(
    paths: Sequence[str | os.PathLike[str]], config: CacheDescription | None = None
) -> DumpSet:
    """Open one engine's dumps: files, directories of ``*.safetensors`` dumps, or
    ExampleConnector folders; ``config`` overrides each dump's description.

    A worker missing from the TP x PP layout is not an error: the set is incomplete.

    Raises:
        KvauditError: A bad dump, two dumps of one worker, or dumps that disagree on
            ``tp_size`` or ``pp_size``.

    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = _expand(paths)
    if not files:
        raise KvauditError("no dumps given")
    dumps = [open_dump(file, config) for file in files]
    first = dumps[0].worker
    seen: dict[tuple[int, int], Dump] = {}
    for dump in dumps:
        worker = dump.worker
        for name in ("tp_size", "pp_size"):
            if getattr(worker, name) != getattr(first, name):
                _fail(
                    dump.path,
                    f"{name} {getattr(worker, name)}, but {dumps[0].path} has {name} "
                    f"{getattr(first, name)}: the dumps of one set come from one engine",
                )
        ranks = (worker.pp_rank, worker.tp_rank)
        if ranks in seen:
            _fail(
                dump.path,
                f"same worker (pp_rank {ranks[0]}, tp_rank {ranks[1]}) as {seen[ranks].path}",
            )
        seen[ranks] = dump
    dumps.sort(key=lambda dump: (dump.worker.pp_rank, dump.worker.tp_rank))
    missing = [
        (pp, tp)
        for pp in range(first.pp_size)
        for tp in range(first.tp_size)
        if (pp, tp) not in seen
    ]
    return DumpSet(dumps, not missing, missing)


def _set_source(dump_set: DumpSet) -> str:
    paths = [dump.path for dump in dump_set.dumps]
    if len(paths) == 1:
        return paths[0]
    try:
        return os.path.commonpath(paths) or "dump set"
    except ValueError:
        return "dump set"


def _selected(dump_set: DumpSet, request_ids: Sequence[str] | None) -> list[str]:
    if request_ids is None:
        return dump_set.request_ids
    ids = list(dict.fromkeys(request_ids))
    for request_id in ids:
        if not any(request_id in dump.requests for dump in dump_set.dumps):
            _fail(_set_source(dump_set), f"no dump of the set holds request {request_id!r}")
    return ids


def total_bytes(dump_set: DumpSet, request_ids: Sequence[str] | None = None) -> int:
    """The dumped bytes ``checksum_dump_set`` goes through for the requests (each listed
    block row of each group, every worker): the total of its ``progress`` calls."""
    ids = _selected(dump_set, request_ids)
    total = 0
    for dump in dump_set.dumps:
        row_bytes = dump.row_bytes()
        for request_id in ids:
            request = dump.requests.get(request_id)
            if request is None:
                continue
            for group_id, (_, block_ids) in request.groups.items():
                total += len(block_ids) * row_bytes[group_id]
    return total


def checksum_dump_set(
    dump_set: DumpSet,
    *,
    request_ids: Sequence[str] | None = None,
    positions: str = "request",
    backend: str = "auto",
    device: str | torch.device = "cpu",
    progress: Callable[[int], None] | None = None,
    batch_bytes: int = BATCH_BYTES,
) -> Record:
    """Every worker's checksums of the requests (default: all), summed into a ``Record``.

    Each dump is read in batches of consecutive rows, about ``batch_bytes`` of them:
    copied from the mapping into fixed buffers (on ``device``), the mapping's pages dropped
    right after, then every requested block position whose row the batch holds is
    checksummed. Memory stays bounded whatever the dump's size, and the file is read once,
    in order. ``progress(n)`` is called with the bytes each step covered (an increment;
    ``total_bytes`` gives their sum). An incomplete set gives a record with ``complete``
    False and its missing workers.

    Raises:
        KvauditError: A request no dump holds, an unknown position numbering, or workers
            whose records cannot be summed.

    """
    if positions not in POSITION_NUMBERINGS:
        raise KvauditError(f"unknown position numbering {positions!r}, expected request or block")
    ids = _selected(dump_set, request_ids)
    records = []
    for dump in dump_set.dumps:
        held = [request_id for request_id in ids if request_id in dump.requests]
        batches = _DumpBatches(dump, torch.device(device), backend, batch_bytes)
        records.append(batches.checksum(held, positions, progress))
    return combine_workers(records)


class _DumpBatches:
    """One dump checksummed batch by batch: buffers of ``rows`` consecutive rows of every
    layer tensor, and one ``Checksummer`` over them."""

    def __init__(self, dump: Dump, device: torch.device, backend: str, batch_bytes: int) -> None:
        self.dump = dump
        axes = {
            entry.name: _row_axis(entry)
            for entry in _owners(dump.description)
            if entry.name in dump.tensors
        }
        self.axes = axes
        total = sum(_nbytes(part) for tensor in dump.tensors.values() for part in _parts(tensor))
        row_bytes = total // dump.num_rows if dump.num_rows else 0
        self.rows = max(1, min(dump.num_rows, batch_bytes // max(row_bytes, 1)))
        self.buffers: dict[str, LayerTensor] = {}
        for name, tensor in dump.tensors.items():
            axis, per_row = axes[name]
            buffers = tuple(
                torch.empty(
                    (*part.shape[:axis], self.rows * per_row, *part.shape[axis + 1 :]),
                    dtype=part.dtype,
                    device=device,
                )
                for part in _parts(tensor)
            )
            self.buffers[name] = buffers if isinstance(tensor, tuple) else buffers[0]
        worker = dump.worker
        self.checksummer = Checksummer(
            dump.description,
            self.buffers,
            tp_rank=worker.tp_rank,
            tp_size=worker.tp_size,
            pp_rank=worker.pp_rank,
            pp_size=worker.pp_size,
            role=worker.role,
            backend=backend,
            num_blocks=self.rows,
            engine=worker.engine,
            source=dump.path,
        )

    def load(self, first: int, count: int) -> None:
        """Copy rows ``first .. first + count - 1`` of every tensor into the buffers,
        dropping the mapped pages after each tensor."""
        for name, tensor in self.dump.tensors.items():
            axis, per_row = self.axes[name]
            for part, buffer in zip(_parts(tensor), _parts(self.buffers[name]), strict=True):
                _as_integers(buffer.narrow(axis, 0, count * per_row)).copy_(
                    _as_integers(part.narrow(axis, first * per_row, count * per_row))
                )
                self.dump.drop_pages()

    def checksum(
        self,
        request_ids: Sequence[str],
        positions: str,
        progress: Callable[[int], None] | None,
    ) -> WorkerRecord:
        """The worker's record of the requests."""
        checksummer = self.checksummer
        blocks = self.dump.request_blocks(request_ids)
        group_bytes = self.dump.row_bytes()
        record = checksummer.checksum({}, positions)
        # Every listed position of a covered group: its (request, group) key, its index
        # in the group's list and its row.
        keys: list[tuple[str, int, int]] = []
        values: list[np.ndarray] = []
        rows: list[int] = []
        key_of: list[int] = []
        index_of: list[int] = []
        for request_id, request in blocks.items():
            record.requests[request_id] = RequestChecksums(request.num_tokens)
            for group_id, (start, group_rows) in request.groups.items():
                plan = checksummer.plans.get(group_id)
                if plan is None:
                    if progress is not None and group_rows and group_bytes[group_id]:
                        progress(len(group_rows) * group_bytes[group_id])
                    continue
                key = len(keys)
                keys.append((request_id, group_id, start))
                values.append(np.zeros((len(group_rows), len(plan.replica_keys)), np.uint64))
                rows.extend(group_rows)
                key_of.extend([key] * len(group_rows))
                index_of.extend(range(len(group_rows)))
        row_array = np.asarray(rows, dtype=np.int64)
        order = np.argsort(row_array, kind="stable")
        sorted_rows = row_array[order]
        done = 0
        while done < len(order):
            first = int(sorted_rows[done])
            end = int(np.searchsorted(sorted_rows, first + self.rows, side="left"))
            self.load(first, int(sorted_rows[end - 1]) - first + 1)
            batch = sorted(order[done:end].tolist(), key=lambda n: (key_of[n], index_of[n]))
            runs = _runs(batch, key_of, index_of)
            requests = {}
            for number, (key, index, members) in enumerate(runs):
                request_id, group_id, start = keys[key]
                requests[str(number)] = RequestBlocks(
                    blocks[request_id].num_tokens,
                    {group_id: (start + index, [rows[n] - first for n in members])},
                )
            result = checksummer.checksum(requests, positions)
            covered = 0
            for number, (key, index, members) in enumerate(runs):
                group_id = keys[key][1]
                group = result.requests[str(number)].groups[group_id]
                values[key][index : index + len(members)] = group.values
                covered += len(members) * group_bytes[group_id]
            if progress is not None and covered:
                progress(covered)
            done = end
        for key, (request_id, group_id, start) in enumerate(keys):
            views = checksummer.groups[group_id]
            record.requests[request_id].groups[group_id] = GroupChecksums(
                block_size=views.group.block_size,
                start=start,
                replica_keys=list(checksummer.plans[group_id].replica_keys),
                values=values[key],
                fingerprint=views.fingerprint,
            )
        return record


def _runs(
    batch: Sequence[int], key_of: Sequence[int], index_of: Sequence[int]
) -> list[tuple[int, int, list[int]]]:
    """Entries sorted by key and index, cut into runs of consecutive positions of one key:
    ``(key, first index, entries)``."""
    runs: list[tuple[int, int, list[int]]] = []
    for n in batch:
        if runs:
            key, index, members = runs[-1]
            if key == key_of[n] and index + len(members) == index_of[n]:
                members.append(n)
                continue
        runs.append((key_of[n], index_of[n], [n]))
    return runs


def _as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the element's size (a view): copies and gathers then
    work for every dtype on every device (fp8 included)."""
    return tensor.view(_INTEGERS[tensor.element_size()])


def _parts(tensor: LayerTensor) -> tuple[torch.Tensor, ...]:
    return tensor if isinstance(tensor, tuple) else (tensor,)


def _row_axis(entry: LayerEntry) -> tuple[int, int]:
    """The axis of a layer's tensor that holds the rows, and its entries per row."""
    if entry.spec.is_state:
        return 0, 1
    return entry.spec.layout.index("N"), _kernel_blocks(entry.spec)


# Writing.


@dataclass
class _Output:
    """One tensor of a dump being written: its header entry and how to write its bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    write: Callable[[BinaryIO], None]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


def _write_rows(file: BinaryIO, tensor: torch.Tensor, axis: int, index: torch.Tensor) -> None:
    """The tensor's ``index`` entries along ``axis``, contiguous in its axis order, a
    bounded piece at a time (any strides, any device)."""
    tensor = _as_integers(tensor)
    index = index.to(tensor.device)
    inner = math.prod(tensor.shape[axis + 1 :]) * tensor.element_size()
    step = max(1, COPY_BYTES // max(inner, 1))
    for lead in itertools.product(*(range(n) for n in tensor.shape[:axis])):
        sub = tensor[lead]
        for start in range(0, len(index), step):
            piece = sub.index_select(0, index[start : start + step]).contiguous().cpu()
            file.write(memoryview(piece.reshape(-1).view(torch.uint8).numpy()))


def _write_bytes(data: bytes) -> Callable[[BinaryIO], None]:
    return lambda file: file.write(data)


def _identity(tensor: LayerTensor) -> tuple:
    """What makes two layers' tensors one storage."""
    return tuple(
        (part.device, part.data_ptr(), tuple(part.shape), part.stride()) for part in _parts(tensor)
    )


def _alias_shared_storage(
    description: CacheDescription, tensors: Mapping[str, LayerTensor]
) -> CacheDescription:
    """The description with ``shares`` set on layers whose tensor is the storage of an
    earlier layer's, so that the dump holds each cache once and counts it once."""
    owner_of: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for entry in _owners(description):
        tensor = tensors.get(entry.name)
        if tensor is None:
            continue
        key = _identity(tensor)
        if key in owner_of:
            aliases[entry.name] = owner_of[key]
        else:
            owner_of[key] = entry.name
    if not aliases:
        return description
    groups = []
    for group in description.groups:
        layers = []
        for entry in group.layers:
            target = aliases.get(entry.name) or aliases.get(entry.shares or "", entry.shares)
            layers.append(dataclasses.replace(entry, shares=target))
        groups.append(dataclasses.replace(group, layers=tuple(layers)))
    return dataclasses.replace(description, groups=tuple(groups))


def _layer_outputs(
    target: str,
    description: CacheDescription,
    tensors: Mapping[str, LayerTensor],
    rows: torch.Tensor,
) -> list[_Output]:
    """The tensors of every layer's dumped rows, checked against the description."""
    outputs = []
    for entry in _owners(description):
        tensor = tensors.get(entry.name)
        if tensor is None:
            if entry.name in description.draft_layers:
                continue
            _fail(target, f"layer {entry.name} has no tensor in the tensors given")
        spec = entry.spec
        names = _tensor_names(entry)
        parts = tensor if isinstance(tensor, tuple) else (tensor,)
        if len(parts) != len(names):
            given = "a K/V pair" if isinstance(tensor, tuple) else "one tensor"
            needs = "one tensor" if len(names) == 1 else "a K/V pair"
            kind = "a state layer" if spec.is_state else f"layout {spec.layout}"
            _fail(target, f"layer {entry.name}: {kind} needs {needs}, got {given}")
        _check_layer(
            target,
            entry,
            [tuple(part.shape) for part in parts],
            [part.dtype for part in parts],
            names,
            description.num_blocks,
            "blocks",
        )
        if spec.is_state:
            axis, index = 0, rows
        else:
            axis = spec.layout.index("N")
            r = _kernel_blocks(spec)
            index = (rows[:, None] * r + torch.arange(r)).reshape(-1)
        for name, part in zip(names, parts, strict=True):
            try:
                safetensors_dtype_name(part.dtype)
            except ValueError as error:
                _fail(target, f"tensor {name}: {error}")
            shape = list(part.shape)
            shape[axis] = len(index)
            outputs.append(
                _Output(
                    name,
                    part.dtype,
                    tuple(shape),
                    lambda file, part=part, axis=axis, index=index: _write_rows(
                        file, part, axis, index
                    ),
                )
            )
    return outputs


def _request_metadata(
    target: str,
    description: CacheDescription,
    requests: Mapping[str, RequestBlocks],
    block_hashes: Mapping[str, Mapping[int, Sequence[bytes]]],
    received: Mapping[str, bytes],
) -> dict[str, Any]:
    """``kvaudit.requests``, each request checked as a reader checks it."""
    group_ids = {group.id for group in description.groups}

    def holds(block_id: int) -> bool:
        return 0 <= block_id < description.num_blocks

    not_held = f"is not in the cache (0..{description.num_blocks - 1})"
    out: dict[str, Any] = {}
    for request_id, request in requests.items():
        where = f"request {request_id!r}"
        if not isinstance(request_id, str):
            _fail(target, f"request id {_short(request_id)} is not a string")
        num_tokens = request.num_tokens
        if not _is_int(num_tokens) or num_tokens < 0:
            _fail(
                target,
                f"{where}: num_tokens must be a non-negative integer, got {_short(num_tokens)}",
            )
        groups = {}
        for group_id, (start, block_ids) in request.groups.items():
            if group_id not in group_ids:
                _fail(target, f"{where}: group {group_id} is not a group of the cache description")
            group_where = f"{where} group {group_id}"
            _check_group_blocks(target, group_where, start, list(block_ids), holds, not_held)
            groups[str(group_id)] = [int(start), [int(block_id) for block_id in block_ids]]
        item: dict[str, Any] = {"num_tokens": int(num_tokens), "groups": groups}
        hashes = block_hashes.get(request_id)
        if hashes:
            item["block_hashes"] = {}
            for group_id, values in hashes.items():
                listed = len(request.groups[group_id][1]) if group_id in request.groups else 0
                if len(values) > listed:
                    _fail(
                        target,
                        f"{where} block_hashes {group_id}: {len(values)} hashes for {listed} "
                        "listed blocks",
                    )
                item["block_hashes"][str(group_id)] = [bytes(value).hex() for value in values]
        if request_id in received:
            item["received"] = base64.b64encode(bytes(received[request_id])).decode("ascii")
        out[request_id] = item
    for name, mapping in (("block_hashes", block_hashes), ("received", received)):
        for request_id in mapping:
            if request_id not in requests:
                _fail(target, f"{name} given for request {request_id!r}, which is not dumped")
    return out


def _stored_output(
    target: str, stored: torch.Tensor | np.ndarray, num_blocks: int, rows: torch.Tensor
) -> _Output:
    values = (
        stored.detach().cpu().numpy() if isinstance(stored, torch.Tensor) else np.asarray(stored)
    )
    if values.shape != (num_blocks,) or values.dtype not in (np.int64, np.uint64):
        _fail(
            target,
            f"stored_checksums: expected int64 or uint64 of shape ({num_blocks},), got "
            f"{values.dtype} of shape {values.shape}",
        )
    data = np.ascontiguousarray(values.view(np.int64)[rows.numpy()]).astype("<i8").tobytes()
    return _Output(STORED_CHECKSUMS, torch.int64, (len(rows),), _write_bytes(data))


def _with_padding(outputs: list[_Output]) -> list[tuple[_Output, int]]:
    """The outputs with their data offsets, a U8 pad tensor before any that would not
    start 64-byte aligned."""
    placed = []
    offset = 0
    for output in outputs:
        if offset % ALIGNMENT:
            pad = ALIGNMENT - offset % ALIGNMENT
            filler = _Output(
                f"{PAD_PREFIX}{len(placed)}", torch.uint8, (pad,), _write_bytes(bytes(pad))
            )
            placed.append((filler, offset))
            offset += pad
        placed.append((output, offset))
        offset += output.nbytes
    return placed


def _header_bytes(metadata: Mapping[str, str], placed: list[tuple[_Output, int]]) -> bytes:
    """The JSON header, padded with spaces so that the data starts 64-byte aligned."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    for output, offset in placed:
        header[output.name] = {
            "dtype": safetensors_dtype_name(output.dtype),
            "shape": list(output.shape),
            "data_offsets": [offset, offset + output.nbytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    pad = -(8 + len(text)) % ALIGNMENT
    return text + b" " * pad


def write_dump(
    path: str | os.PathLike[str],
    description: CacheDescription,
    tensors: Mapping[str, LayerTensor],
    requests: Mapping[str, RequestBlocks],
    *,
    worker: WorkerInfo,
    block_hashes: Mapping[str, Mapping[int, Sequence[bytes]]] | None = None,
    received: Mapping[str, bytes] | None = None,
    stored_checksums: torch.Tensor | np.ndarray | None = None,
    whole_cache: bool = False,
) -> None:
    """Write one worker's dump of the requests' blocks (``requests`` in ENGINE block ids).

    ``tensors`` are the live whole caches (``N`` = ``num_blocks`` times the kernel blocks
    per block; any strides, any device). Only the requests' blocks are dumped, rows in
    ascending block id order (``kvaudit.blocks``), unless ``whole_cache``.
    ``stored_checksums`` holds one entry per engine block. The file is written to a
    temporary file in the same directory, synced and renamed over ``path``: on any error
    nothing is left and an existing file at ``path`` is untouched.

    Raises:
        KvauditError: A tensor missing or not matching the description, a bad request,
            bad ranks or role, or a file that cannot be written.

    """
    target = os.fspath(path)
    if worker.role not in ROLES:
        _fail(target, f"worker role {worker.role!r} is not one of {', '.join(ROLES)}")
    if not (0 <= worker.tp_rank < worker.tp_size and 0 <= worker.pp_rank < worker.pp_size):
        _fail(
            target,
            f"worker ranks tp {worker.tp_rank}/{worker.tp_size}, pp "
            f"{worker.pp_rank}/{worker.pp_size} are out of range",
        )
    description = _alias_shared_storage(description, tensors)
    request_items = _request_metadata(
        target, description, requests, block_hashes or {}, received or {}
    )
    if whole_cache:
        row_ids = list(range(description.num_blocks))
    else:
        row_ids = sorted(
            {
                int(block_id)
                for request in requests.values()
                for _, block_ids in request.groups.values()
                for block_id in block_ids
            }
        )
    rows = torch.tensor(row_ids, dtype=torch.int64)
    outputs = _layer_outputs(target, description, tensors, rows)
    if stored_checksums is not None:
        outputs.append(_stored_output(target, stored_checksums, description.num_blocks, rows))

    compact = {"separators": (",", ":")}
    metadata = {
        _META_FORMAT: FORMAT,
        _META_WORKER: json.dumps(
            {
                "tp_rank": worker.tp_rank,
                "tp_size": worker.tp_size,
                "pp_rank": worker.pp_rank,
                "pp_size": worker.pp_size,
                "role": worker.role,
                "engine": worker.engine,
            },
            **compact,
        ),
        _META_CACHE: json.dumps(description_to_dict(description), **compact),
        _META_REQUESTS: json.dumps(request_items, **compact),
    }
    if not whole_cache:
        metadata[_META_BLOCKS] = json.dumps(row_ids, **compact)
    placed = _with_padding(outputs)
    header = _header_bytes(metadata, placed)
    _write_atomically(target, header, placed)


def _write_atomically(target: str, header: bytes, placed: list[tuple[_Output, int]]) -> None:
    directory = os.path.dirname(os.path.abspath(target))
    temporary = os.path.join(directory, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        _fail(target, f"cannot write: {error.strerror}")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(_LENGTH.pack(len(header)))
            file.write(header)
            data_start = 8 + len(header)
            for output, offset in placed:
                output.write(file)
                if file.tell() != data_start + offset + output.nbytes:
                    raise RuntimeError(f"tensor {output.name} wrote the wrong number of bytes")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        if isinstance(error, OSError) and not isinstance(error, KvauditError):
            raise KvauditError(f"cannot write: {error.strerror or error}", source=target) from error
        raise
    _sync_directory(directory)


def _sync_directory(directory: str) -> None:
    """Make the rename durable where the platform allows it."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
