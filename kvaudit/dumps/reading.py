"""Reading one dump strictly: its metadata parsed and every tensor checked against the
cache description (each problem one line naming the file), its tensors memory-mapped.

The worker and the embedded description are read here; the block lists in
``block_ids``, the requests in ``dump_requests``, the tensors in ``dump_tensors``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from ..core.errors import KvauditError
from ..core.files import check_input
from ..core.validation import Checker, fail, is_int, join, load_json, short
from ..description import CacheDescription
from ..description import parse_description as _parse_description
from ..records import WorkerInfo
from ..views import LayerTensor
from .block_ids import parse_blocks, row_spaces
from .dump import (
    FORMAT,
    META_BLOCKS,
    META_CACHE,
    META_FORMAT,
    META_KEYS,
    META_WORKER,
    Dump,
    TorchViews,
)
from .dump_requests import parse_requests
from .dump_tensors import check_whole_cache_rows, dump_tensors
from .hints import own_description_option
from .safetensors_io import array_view, map_file, read_header

_WORKER_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "role", "engine")


def _parse_worker(metadata: Mapping[str, str], source: str) -> WorkerInfo:
    if META_WORKER not in metadata:
        fail(source, f"no {META_WORKER} in the metadata")
    data = load_json(metadata[META_WORKER], source, META_WORKER)
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
    data = load_json(metadata[META_CACHE], source, META_CACHE)
    return _parse_description(data, f"{source} ({META_CACHE})")


def check_metadata(metadata: Mapping[str, str], source: str) -> None:
    """Read a dump's metadata back as ``open_dump`` reads it (its worker, description,
    rows and requests), for a writer: what a reader would refuse is refused before
    anything is written."""
    worker = _parse_worker(metadata, source)
    description = _embedded_description(metadata, source)
    blocks = parse_blocks(metadata, description, source, worker, given=False)
    _, _, holds = row_spaces(description, blocks)
    parse_requests(metadata, description, holds, source)


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

    Example:
        >>> import pathlib, tempfile, numpy as np, torch
        >>> from kvaudit import RequestBlocks, WorkerInfo
        >>> from kvaudit.description import parse_description
        >>> from kvaudit.dumps import open_dump, write_dump
        >>> cache = torch.arange(4 * 8 * 2 * 2 * 4, dtype=torch.float32).reshape(2, 4, 2, 8, 4)
        >>> description = parse_description({"kvaudit": 1, "num_blocks": 4, "groups": [{"spec": {
        ...     "type": "full_attention", "block_size": 8, "num_kv_heads": 2, "head_size": 4,
        ...     "dtype": "float32", "layout": "KNHTD"}, "layers": ["model.layers.0.attn"]}]}, "d")
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "consumer.safetensors"
        >>> write_dump(path, description, {"model.layers.0.attn": cache},
        ...            {"r": RequestBlocks(8, {0: (0, [2])})}, worker=WorkerInfo(role="consumer"))
        >>> dump = open_dump(path)
        >>> dump.worker.role, list(dump.requests), dump.num_rows
        ('consumer', ['r'], 1)
        >>> kv = dump.arrays["model.layers.0.attn"]  # memory-mapped; the elements' bits
        >>> kv.shape  # KNHTD: [K and V, rows, heads, tokens, head size]
        (2, 1, 2, 8, 4)
        >>> np.array_equal(kv[:, 0].view(np.float32), cache[:, 2].numpy())
        True

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
    blocks = parse_blocks(metadata, description, source, worker, config is not None)
    if META_BLOCKS not in metadata and config is not None:
        check_whole_cache_rows(source, header, config, worker)
    num_rows, block_ids, holds = row_spaces(description, blocks)
    requests = parse_requests(metadata, description, holds, source)
    try:
        entries, stored_entry = dump_tensors(source, header, description, num_rows)
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
