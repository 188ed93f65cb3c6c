"""Python handles as sources: ``py:PATH`` arguments, each one worker of the process that
runs kvaudit (a notebook, a test). ``live:`` always names a running engine's agent, a
socket or a folder of sockets (``kvaudit.sources.socket_source``).

``PATH`` is a Python file (``tools/live.py``) or an importable module (``mypkg.kv_live``)
that defines ``kvaudit_live()``, which returns ``(description, tensors, rank, requests)``:

- ``description``: a ``CacheDescription``, a description dict, or the path of a YAML file;
- ``tensors``: layer name to its cache tensor (or ``(k, v)`` tensors), any strides, on the
  CPU or a GPU;
- ``rank``: a dict with any of ``tp_rank``, ``tp_size``, ``pp_rank``, ``pp_size``, ``role``,
  ``engine``, ``num_blocks``;
- ``requests``: request id to a ``RequestBlocks``, or to a dict
  ``{"num_tokens": n, "groups": {group_id: [start, [block ids]]}}`` as in a dump's metadata.

The workers' tensors are checksummed in place (or moved to ``--device`` when it is given)
and read in place to locate differences.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.errors import KvauditError
from ..core.files import check_input
from ..core.validation import (
    MAX_TOKENS,
    check_int,
    check_plain,
    check_positions,
    check_worker,
    short,
)
from ..description import CacheDescription, parse_description
from ..records import Record, WorkerInfo
from ..views.inputs import RequestBlocks, is_tensor, plain_requests
from .base import RecordQuery
from .raw import RawKVSource, TensorWorker, checksum_each, one_line, one_line_errors
from .registry import OpenOptions
from .sniffing import PY_PREFIX

LIVE_FUNCTION = "kvaudit_live"
_RANK_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "role", "engine", "num_blocks")


class HandleSource(RawKVSource):
    """Workers of a running process, each from its ``py:PATH`` handle."""

    kind = "live"
    workers: list[TensorWorker]

    def __init__(self, workers: Sequence[TensorWorker], device_given: bool) -> None:
        super().__init__([worker.name for worker in workers], workers)
        self.device_given = device_given

    def checksum(self, query: RecordQuery) -> Record:
        placement = query.runtime if self.device_given else None
        workers = ((live.checksummer(placement), live.requests) for live in self.workers)
        return checksum_each(workers, query)

    def trimmed(self, num_tokens: Mapping[str, int]) -> HandleSource:
        return HandleSource(self.trimmed_workers(num_tokens), self.device_given)


def open_handles(
    names: Sequence[str], handles: Sequence[str], options: OpenOptions
) -> HandleSource:
    """The Python-handle kind's opener: every argument a handle."""
    if len(handles) != len(names):
        raise KvauditError("live: handles cannot be mixed with dumps or records")
    workers = [_load_live(name, options.config) for name in names]
    return HandleSource(workers, options.device_given)


def _load_live(name: str, config: CacheDescription | None) -> TensorWorker:
    """Import a ``py:PATH`` handle and call its ``kvaudit_live()``."""
    target = name[len(PY_PREFIX) :]
    if not target:
        raise KvauditError(f"expected {PY_PREFIX}PATH, a Python file or module", name)
    module = _import_live(name, target)
    function = getattr(module, LIVE_FUNCTION, None)
    if not callable(function):
        raise KvauditError(f"defines no {LIVE_FUNCTION}() function", name)
    try:
        result = function()
    except KvauditError:
        raise
    except SystemExit as error:
        raise KvauditError(
            f"{LIVE_FUNCTION}() called SystemExit({short(error.code)}) instead of returning",
            name,
        ) from None
    except Exception as error:
        raise KvauditError(f"{LIVE_FUNCTION}() raised {one_line(error)}", name) from None
    if not isinstance(result, (tuple, list)) or len(result) != 4:
        raise KvauditError(
            f"{LIVE_FUNCTION}() must return (description, tensors, rank, requests)", name
        )
    description, tensors, rank, requests = result
    if config is not None:
        description = config
    elif isinstance(description, (str, os.PathLike)):
        from ..description.loader import load_description  # YAML only for live handles

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
    _check_tensors(name, tensors)
    if not isinstance(rank, Mapping) or any(key not in _RANK_KEYS for key in rank):
        raise KvauditError(
            f"{LIVE_FUNCTION}(): rank must be a dict with keys among {', '.join(_RANK_KEYS)}",
            name,
        )
    listed = _live_requests(name, requests, description)
    num_blocks = rank.get("num_blocks")
    if num_blocks is not None:
        check_int(num_blocks, name, f"{LIVE_FUNCTION}(): rank num_blocks", 1)
    return TensorWorker(
        name=name,
        description=description,
        tensors=tensors,
        worker=_live_worker_info(name, rank),
        # Without a count given, each group holds its block space (its own num_blocks).
        num_rows=description.group_rows() if num_blocks is None else num_blocks,
        requests=listed,
    )


def _live_worker_info(name: str, rank: Mapping[str, Any]) -> WorkerInfo:
    """The worker a handle's ``rank`` dict describes (a consumer by default).

    Raises:
        KvauditError: An unknown role, or a rank outside its size; the message names the
            handle.

    """
    engine = rank.get("engine", "")
    if not isinstance(engine, str):
        raise KvauditError(f"{LIVE_FUNCTION}(): rank engine must be a string", name)
    check_plain(engine, name, f"{LIVE_FUNCTION}(): rank engine")
    worker = WorkerInfo(
        tp_rank=rank.get("tp_rank", 0),
        tp_size=rank.get("tp_size", 1),
        pp_rank=rank.get("pp_rank", 0),
        pp_size=rank.get("pp_size", 1),
        role=rank.get("role", "consumer"),
        engine=engine,
        source=name,
    )
    # A Checksummer's checks, made here too: inspect builds none, yet must reject what
    # checksum rejects.
    with one_line_errors(name):
        check_worker(worker, worker.role, name)
    return worker


def _import_live(name: str, target: str) -> Any:
    """The module of a live handle: a file path, or an importable module name."""
    try:
        if target.endswith(".py") or os.path.sep in target or os.path.isfile(target):
            check_input(target)
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
    except SystemExit as error:
        raise KvauditError(
            f"called SystemExit({short(error.code)}) while being imported", name
        ) from None
    except Exception as error:
        raise KvauditError(f"cannot import: {one_line(error)}", name) from None


def _check_tensors(name: str, tensors: Mapping[Any, Any]) -> None:
    """Every layer's cache a torch tensor, or a pair of them (K and V)."""
    for layer, tensor in tensors.items():
        parts = tensor if isinstance(tensor, (tuple, list)) else (tensor,)
        if (
            not isinstance(layer, str)
            or not 1 <= len(parts) <= 2
            or not all(is_tensor(part) for part in parts)
        ):
            raise KvauditError(
                f"{LIVE_FUNCTION}(): tensors[{short(layer)}]: expected a torch tensor or a "
                f"(k, v) pair of them, got {type(tensor).__name__}",
                name,
            )


def _live_requests(
    name: str, requests: object, description: CacheDescription
) -> dict[str, RequestBlocks]:
    """``kvaudit_live()``'s requests as ``RequestBlocks``, each group's start checked
    against the request's tokens."""
    if not isinstance(requests, Mapping):
        raise KvauditError(f"{LIVE_FUNCTION}(): requests must be a dict", name)
    result = {}
    for request_id, blocks in requests.items():
        if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise KvauditError(
                f"{LIVE_FUNCTION}(): request id {short(request_id)} is not a string", name
            )
        where = f"{LIVE_FUNCTION}(): request {short(request_id)}"
        check_plain(str(request_id), name, where)
        if isinstance(blocks, RequestBlocks):
            listed = blocks
        else:
            try:
                groups = {
                    int(gid): (start, list(block_ids))
                    for gid, (start, block_ids) in blocks["groups"].items()
                }
                listed = RequestBlocks(blocks["num_tokens"], groups)
            except (KeyError, TypeError, ValueError, AttributeError):
                raise KvauditError(
                    f"{where}: expected "
                    '{"num_tokens": n, "groups": {id: [start, [block ids]]}}',
                    name,
                ) from None
        _check_listed(name, where, plain_requests({"": listed}, name)[""], description)
        result[str(request_id)] = listed
    return result


def _check_listed(
    name: str, where: str, listed: RequestBlocks, description: CacheDescription
) -> None:
    """A request's token count and each group's start, integers and consistent."""
    num_tokens = check_int(listed.num_tokens, name, f"{where}: num_tokens", 0, MAX_TOKENS)
    block_sizes = {group.id: group.block_size for group in description.groups}
    for group_id, (start, block_ids) in listed.groups.items():
        group_where = f"{where} group {group_id}"
        first = check_int(start, name, f"{group_where}: start", 0, MAX_TOKENS)
        if group_id in block_sizes:
            check_positions(
                name, group_where, num_tokens, block_sizes[group_id], first, len(block_ids)
            )
