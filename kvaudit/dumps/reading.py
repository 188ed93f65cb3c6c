"""Reading one dump strictly: its metadata parsed and every tensor checked against the
cache description (each problem one line naming the file), its tensors memory-mapped.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..core.dtypes import INT64, UINT8, dtype_name
from ..core.errors import KvauditError
from ..core.files import check_input
from ..core.validation import (
    MAX_TOKENS,
    Checker,
    check_positions,
    fail,
    is_int,
    join,
    load_json,
    short,
)
from ..description import CacheDescription, LayerEntry
from ..description import parse_description as _parse_description
from ..records import WorkerInfo
from ..views import LayerTensor
from .dump import (
    FORMAT,
    META_BLOCKS,
    META_CACHE,
    META_FORMAT,
    META_KEYS,
    META_REQUESTS,
    META_WORKER,
    STORED_CHECKSUMS,
    Dump,
    DumpRequest,
    TorchViews,
)
from .hints import other_engine_hint, own_description_option
from .layers import (
    check_layer,
    kernel_blocks_per_block,
    layer_groups,
    owner_layers,
    rows_of_layer,
    tensor_names,
)
from .safetensors_io import PAD_PREFIX, Entry, Header, array_view, map_file, read_header

_WORKER_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "role", "engine")
_REQUEST_KEYS = ("num_tokens", "groups", "block_hashes", "received")


# Metadata.


def _json(metadata: Mapping[str, str], key: str, source: str) -> Any:
    return load_json(metadata[key], source, key)


def _parse_worker(metadata: Mapping[str, str], source: str) -> WorkerInfo:
    if META_WORKER not in metadata:
        fail(source, f"no {META_WORKER} in the metadata")
    data = _json(metadata, META_WORKER, source)
    where = META_WORKER
    if not isinstance(data, dict):
        fail(source, f"{where}: expected a JSON object, got {short(data)}")
    for key in data:
        if key not in _WORKER_KEYS:
            fail(source, f"{where}.{key}: unknown key; expected {', '.join(_WORKER_KEYS)}")
    values = {}
    for key in ("tp_size", "pp_size", "tp_rank", "pp_rank"):
        value = data.get(key)
        minimum = 1 if key.endswith("size") else 0
        if not is_int(value) or value < minimum:
            kind = "a positive" if minimum else "a non-negative"
            fail(source, f"{where}.{key}: expected {kind} integer, got {short(value)}")
        values[key] = int(value)
    engine = data.get("engine", "")
    if not isinstance(engine, str):
        fail(source, f"{where}.engine: expected a string, got {short(engine)}")
    checker = Checker(source)
    role = checker.role(data.get("role"), join(where, "role"))
    worker = WorkerInfo(role=role, engine=engine, source=source, **values)
    checker.ranks(worker, where)
    return worker


def _embedded_description(metadata: Mapping[str, str], source: str) -> CacheDescription:
    if META_CACHE not in metadata:
        fail(
            source, f"no cache description: the dump has no {META_CACHE} and no --config was given"
        )
    data = _json(metadata, META_CACHE, source)
    return _parse_description(data, f"{source} ({META_CACHE})")


GroupBlocks = dict[int, list[int] | None]
"""``kvaudit.blocks`` per group: each group's listed block ids, None for its whole space."""


def _parse_blocks(
    metadata: Mapping[str, str],
    description: CacheDescription,
    source: str,
    worker: WorkerInfo,
    given: bool,
) -> list[int] | GroupBlocks | None:
    """``kvaudit.blocks``: None (absent: the whole cache), one list for every group, or
    (an object) a list per group; where some group has a block space of its own, an
    absent key reads as every group's whole space."""
    if META_BLOCKS not in metadata:
        if description.has_group_spaces:
            return {group.id: None for group in description.groups}
        return None
    data = _json(metadata, META_BLOCKS, source)
    if isinstance(data, dict):
        return _parse_group_blocks(data, description, source, worker, given)
    if not isinstance(data, list):
        fail(
            source,
            f"{META_BLOCKS}: expected a list of block ids or an object of lists by group id, "
            f"got {short(data)}",
        )
    if description.has_group_spaces:
        # One list for groups of different spaces: each id must be in every space.
        smallest = min(description.groups, key=lambda group: description.blocks_of(group.id))
        space = description.blocks_of(smallest.id)
        label = f" (group {smallest.id}'s block space)"
    else:
        space, label = description.num_blocks, ""
    return _block_list(data, META_BLOCKS, space, label, source, worker, given)


def _block_list(
    data: list[Any],
    where: str,
    space: int,
    label: str,
    source: str,
    worker: WorkerInfo,
    given: bool,
) -> list[int]:
    """One list of block ids in a space of ``space`` blocks: integers in it, none twice."""
    seen: set[int] = set()
    for index, block_id in enumerate(data):
        if given and is_int(block_id) and block_id >= space:
            fail(
                source,
                f"{where}[{index}]: block id {block_id} is past the last block "
                f"{space - 1}{label}; " + other_engine_hint(worker.role, space),
            )
        if not is_int(block_id) or not 0 <= block_id < space:
            fail(
                source,
                f"{where}[{index}]: expected a block id from 0 to {space - 1}{label}, got "
                f"{short(block_id)}",
            )
        if block_id in seen:
            fail(source, f"{where}[{index}]: block {block_id} is listed twice")
        seen.add(block_id)
    return [int(block_id) for block_id in data]


def _parse_group_blocks(
    data: dict[Any, Any],
    description: CacheDescription,
    source: str,
    worker: WorkerInfo,
    given: bool,
) -> GroupBlocks:
    """``kvaudit.blocks`` as an object: each named group's list, the others whole."""
    group_ids = {group.id for group in description.groups}
    result: GroupBlocks = {group.id: None for group in description.groups}
    for key, items in data.items():
        group_id = _group_key(source, META_BLOCKS, key, group_ids)
        where = f"{META_BLOCKS}.{group_id}"
        if not isinstance(items, list):
            fail(source, f"{where}: expected a list of block ids, got {short(items)}")
        space = description.blocks_of(group_id)
        if len(items) > space:
            fail(
                source,
                f"{where}: {len(items)} block ids, more than the {space} blocks of group "
                f"{group_id}'s space",
            )
        result[group_id] = _block_list(items, where, space, "", source, worker, given)
    return result


def check_group_blocks(
    source: str,
    where: str,
    start: object,
    block_ids: object,
    holds: Callable[[int], bool],
    not_held: str,
) -> None:
    """A group entry's start position and block ids: integers, held, none listed twice."""
    if not is_int(start) or start < 0:
        fail(source, f"{where}: start position must be a non-negative integer, got {short(start)}")
    if not isinstance(block_ids, (list, tuple)):
        fail(source, f"{where}: expected a list of block ids, got {short(block_ids)}")
    # Python ints, each held, none twice, checked at C speed (``holds`` is a set's or a
    # range's ``__contains__`` when read); any doubt falls to the loop, which names the block.
    if (
        set(map(type, block_ids)) <= {int}
        and all(map(holds, block_ids))
        and len(set(block_ids)) == len(block_ids)
    ):
        return
    seen: set[int] = set()
    for block_id in block_ids:
        if not is_int(block_id):
            fail(source, f"{where}: block id {short(block_id)} is not an integer")
        if not holds(block_id):
            fail(source, f"{where}: block {block_id} {not_held}")
        if block_id in seen:
            fail(source, f"{where}: block {block_id} is listed at two positions")
        seen.add(block_id)


def _group_key(source: str, where: str, key: object, group_ids: set[int]) -> int:
    if not isinstance(key, str) or not (key.isascii() and key.isdigit()) or str(int(key)) != key:
        fail(source, f"{where}: group key {short(key)} is not a decimal group id")
    group_id = int(key)
    if group_id not in group_ids:
        fail(source, f"{where}: group {group_id} is not a group of the cache description")
    return group_id


def _parse_requests(
    metadata: Mapping[str, str],
    description: CacheDescription,
    holds: Mapping[int, Callable[[int], bool]],
    source: str,
) -> dict[str, DumpRequest]:
    if META_REQUESTS not in metadata:
        fail(source, f"no {META_REQUESTS} in the metadata")
    data = _json(metadata, META_REQUESTS, source)
    if not isinstance(data, dict):
        fail(source, f"{META_REQUESTS}: expected a JSON object, got {short(data)}")
    group_ids = {group.id for group in description.groups}
    requests = {}
    for request_id, item in data.items():
        where = f"{META_REQUESTS}: request {request_id!r}"
        if not isinstance(item, dict):
            fail(source, f"{where}: expected a JSON object, got {short(item)}")
        for key in item:
            if key not in _REQUEST_KEYS:
                fail(source, f"{where}: unknown key {key!r}; expected {', '.join(_REQUEST_KEYS)}")
        for key in ("num_tokens", "groups"):
            if key not in item:
                fail(source, f"{where}: no {key}")
        num_tokens = item["num_tokens"]
        if not is_int(num_tokens) or not 0 <= num_tokens <= MAX_TOKENS:
            fail(
                source,
                f"{where}: num_tokens must be an integer from 0 to {MAX_TOKENS}, got "
                f"{short(num_tokens)}",
            )
        groups_data = item["groups"]
        if not isinstance(groups_data, dict):
            fail(source, f"{where}: groups: expected a JSON object, got {short(groups_data)}")
        groups: dict[int, tuple[int, list[int]]] = {}
        for key, entry in groups_data.items():
            group_id = _group_key(source, f"{where} groups", key, group_ids)
            group_where = f"{where} group {group_id}"
            if not isinstance(entry, list) or len(entry) != 2:
                fail(source, f"{group_where}: expected [start, [block ids]], got {short(entry)}")
            check_group_blocks(
                source, group_where, entry[0], entry[1], holds[group_id], "is not held by the dump"
            )
            block_size = description.group(group_id).block_size
            check_positions(
                source, group_where, int(num_tokens), block_size, int(entry[0]), len(entry[1])
            )
            groups[group_id] = (int(entry[0]), [int(block_id) for block_id in entry[1]])
        hashes = _parse_hashes(source, where, item.get("block_hashes", {}), groups, group_ids)
        received = item.get("received")
        if received is not None:
            if not isinstance(received, str):
                fail(source, f"{where}: received: expected base64 text, got {short(received)}")
            try:
                received = base64.b64decode(received, validate=True)
            except (binascii.Error, ValueError):
                fail(source, f"{where}: received: not valid base64")
        requests[request_id] = DumpRequest(int(num_tokens), groups, hashes, received)
    return requests


def check_metadata(metadata: Mapping[str, str], source: str) -> None:
    """Read a dump's metadata back as ``open_dump`` reads it (its worker, description,
    rows and requests), for a writer: what a reader would refuse is refused before
    anything is written."""
    worker = _parse_worker(metadata, source)
    description = _embedded_description(metadata, source)
    blocks = _parse_blocks(metadata, description, source, worker, given=False)
    _, _, holds = _row_spaces(description, blocks)
    _parse_requests(metadata, description, holds, source)


def _row_spaces(
    description: CacheDescription, blocks: list[int] | GroupBlocks | None
) -> tuple[int | dict[int, int], list[int] | GroupBlocks | None, dict[int, Callable[[int], bool]]]:
    """A dump's rows (one count, or per group), its block ids as ``Dump`` keeps them, and
    per group what says whether it holds a block."""
    if isinstance(blocks, dict):
        rows = {
            group_id: description.blocks_of(group_id) if ids is None else len(ids)
            for group_id, ids in blocks.items()
        }
        # Called once per listed block: a C method, not a Python function.
        holds = {
            group_id: (range(rows[group_id]) if ids is None else set(ids)).__contains__
            for group_id, ids in blocks.items()
        }
        return rows, blocks, holds
    num_rows = len(blocks) if blocks is not None else description.num_blocks
    shared = (set(blocks) if blocks is not None else range(num_rows)).__contains__
    return num_rows, blocks, {group.id: shared for group in description.groups}


def _parse_hashes(
    source: str,
    where: str,
    data: object,
    groups: Mapping[int, tuple[int, list[int]]],
    group_ids: set[int],
) -> dict[int, list[bytes]]:
    if not isinstance(data, dict):
        fail(source, f"{where}: block_hashes: expected a JSON object, got {short(data)}")
    hashes: dict[int, list[bytes]] = {}
    for key, items in data.items():
        group_id = _group_key(source, f"{where} block_hashes", key, group_ids)
        hash_where = f"{where} block_hashes {group_id}"
        listed = len(groups[group_id][1]) if group_id in groups else 0
        if not isinstance(items, list) or len(items) > listed:
            fail(
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
                fail(source, f"{hash_where}: {short(item)} is not a hex hash")
        hashes[group_id] = values
    return hashes


# Tensors.


def _dump_tensors(
    source: str, header: Header, description: CacheDescription, num_rows: int | dict[int, int]
) -> tuple[dict[str, Entry | tuple[Entry, Entry]], Entry | None]:
    """Every layer's tensor entries, checked against the description (each layer's rows:
    ``num_rows``, or its group's entry), and the stored checksums' entry."""
    found: dict[str, Entry | tuple[Entry, Entry]] = {}
    used: set[str] = set()
    groups = layer_groups(description)
    for entry in owner_layers(description):
        rows = rows_of_layer(num_rows, groups[entry.name])
        what = "rows" if isinstance(num_rows, int) else f"rows of group {groups[entry.name]}"
        names = tensor_names(entry)
        present = [name for name in names if name in header.tensors]
        if len(present) < len(names):
            if entry.name in description.draft_layers and not present:
                continue
            expected = " and ".join(names)
            alone = entry.name in header.tensors and len(names) == 2
            hint = f" (layout {entry.spec.layout} keeps K and V apart)" if alone else ""
            fail(source, f"layer {entry.name} has no tensor: expected {expected}{hint}")
        parts = [header.tensors[name] for name in names]
        check_layer(
            source,
            entry,
            [part.shape for part in parts],
            [part.dtype for part in parts],
            names,
            rows,
            what,
        )
        found[entry.name] = (parts[0], parts[1]) if len(parts) == 2 else parts[0]
        used.update(names)
    stored = header.tensors.get(STORED_CHECKSUMS)
    if stored is not None and not isinstance(num_rows, int):
        fail(
            source,
            f"tensor {STORED_CHECKSUMS}: stored checksums need one {META_BLOCKS} list for "
            "every group, not a list per group",
        )
    if stored is not None:
        rows = num_rows
        if stored.dtype != INT64 or stored.shape != (rows,):
            fail(
                source,
                f"tensor {STORED_CHECKSUMS}: expected int64 of shape ({rows},), got "
                f"{dtype_name(stored.dtype)} of shape {stored.shape}",
            )
        used.add(STORED_CHECKSUMS)
    for name, item in header.tensors.items():
        if name in used:
            continue
        if name.startswith(PAD_PREFIX) and item.dtype == UINT8 and len(item.shape) == 1:
            continue
        sharing = _sharing_layers(description).get(name.removesuffix("/k").removesuffix("/v"))
        if sharing is not None:
            fail(
                source,
                f"tensor {name}: layer {sharing.name} shares the cache of {sharing.shares} "
                "(shares:) and has no tensor of its own",
            )
        fail(source, f"tensor {name} is not a layer of the cache description")
    return found, stored


def _sharing_layers(description: CacheDescription) -> dict[str, LayerEntry]:
    """The layers that share another layer's cache, by name."""
    return {
        entry.name: entry
        for group in description.groups
        for entry in group.layers
        if entry.shares is not None
    }


def _check_whole_cache_rows(
    source: str, header: Header, description: CacheDescription, worker: WorkerInfo
) -> None:
    """A whole-cache dump read under a given description: a layer whose tensor matches
    its description but for the rows means the description is probably the other
    engine's (one check, on the first such layer)."""
    groups = layer_groups(description)
    for entry in owner_layers(description):
        spec = entry.spec
        space = description.blocks_of(groups[entry.name])
        item = header.tensors.get(tensor_names(entry)[0])
        if item is None or spec.is_state or "N" not in spec.layout:
            continue
        axis = spec.layout.index("N")
        per_row = kernel_blocks_per_block(spec)
        sizes = {**spec.axis_sizes(kernel_blocks=0), "D": spec.head_size}
        others = [sizes[letter] for letter in spec.layout if letter != "N"]
        shape = list(item.shape)
        if len(shape) != len(spec.layout) or shape[:axis] + shape[axis + 1 :] != others:
            return
        if shape[axis] != space * per_row:
            fail(
                source,
                f"layer {entry.name} holds {shape[axis] // per_row} blocks (the whole cache); "
                + other_engine_hint(worker.role, space),
            )
        return


def open_dump(path: str | os.PathLike[str], config: CacheDescription | None = None) -> Dump:
    """Open one worker's dump file, checking it strictly.

    ``config`` overrides the description the dump embeds (and is required by a dump
    without one). A file that is no dump is named with the reader's error; which other
    input it looks like (a description, a record) is said where SOURCE arguments are
    recognised (``kvaudit.sources.sniffing.with_hint``). A vLLM ExampleConnector folder is
    read by ``kvaudit.dumps.example_connector.open_example_connectors``.

    Args:
        path: A dump file.
        config: A description that overrides the dump's; None to use the embedded one.

    Returns:
        The dump, its tensors memory-mapped read-only.

    Raises:
        KvauditError: One line naming the file and what is wrong (docs/dump-format.md,
            "Reading is strict").
        DescriptionError: The embedded description is invalid (source ``PATH
            (kvaudit.cache)``, with the key path).

    """
    source = os.fspath(path)
    check_input(source)  # a FIFO or a device would block or never end
    header = read_header(source)
    metadata = header.metadata
    version = metadata.get(META_FORMAT)
    if version is None:
        fail(source, f"not a kvaudit dump: no {META_FORMAT} in its metadata")
    if version != FORMAT:
        fail(source, f"unknown {META_FORMAT} {version!r}, expected {FORMAT!r}")
    for key in metadata:
        if key.startswith("kvaudit.") and key not in META_KEYS:
            fail(source, f"unknown metadata key {key}; expected {', '.join(META_KEYS)}")
    worker = _parse_worker(metadata, source)
    description = config if config is not None else _embedded_description(metadata, source)
    blocks = _parse_blocks(metadata, description, source, worker, config is not None)
    if META_BLOCKS not in metadata and config is not None:
        _check_whole_cache_rows(source, header, config, worker)
    num_rows, block_ids, holds = _row_spaces(description, blocks)
    requests = _parse_requests(metadata, description, holds, source)
    try:
        entries, stored_entry = _dump_tensors(source, header, description, num_rows)
    except KvauditError as error:
        if config is None or "expected shape" not in error.message:
            raise
        # A description given for both sides (diff -c) is the likeliest cause.
        role = "dump" if worker.role not in ("producer", "consumer") else worker.role
        raise KvauditError(
            f"{error.message}; the cache description was given, not the dump's own: give the "
            f"{role}'s description ({own_description_option(worker.role)})",
            error.source,
        ) from None

    mapped = map_file(source)
    arrays: dict[str, LayerTensor] = {}
    dtypes = {}
    for name, item in entries.items():
        if isinstance(item, tuple):
            arrays[name] = (array_view(mapped, item[0]), array_view(mapped, item[1]))
        else:
            arrays[name] = array_view(mapped, item)
        dtypes[name] = (item[0] if isinstance(item, tuple) else item).dtype
    stored = None
    if stored_entry is not None:
        stored = array_view(mapped, stored_entry).view(np.uint64).copy()
    return Dump(
        path=source,
        worker=worker,
        description=description,
        tensors=TorchViews(arrays, dtypes),
        arrays=arrays,
        num_rows=num_rows,
        block_ids=block_ids,
        requests=requests,
        stored_checksums=stored,
        maps=[mapped],
    )
