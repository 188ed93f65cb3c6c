"""Writing one worker's dump: the requests' block rows of its live caches, checked as a
reader checks them, written atomically with every tensor 64-byte aligned.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from ..core.dtypes import safetensors_dtype_name
from ..core.validation import check_worker, fail, is_int, short
from ..description import CacheDescription, description_to_dict
from ..records import WorkerInfo
from ..views import LayerTensor
from ..views.inputs import (
    LayerTensors,
    RequestBlocks,
    description_layer_names,
    plain_requests,
    tensors_by_name,
)
from .block_ids import check_group_blocks
from .dump import (
    COPY_BYTES,
    FORMAT,
    META_BLOCKS,
    META_CACHE,
    META_FORMAT,
    META_REQUESTS,
    META_WORKER,
    STORED_CHECKSUMS,
)
from .layers import (
    check_layer,
    kernel_blocks_per_block,
    layer_groups,
    layer_parts,
    owner_layers,
    tensor_names,
)
from .reading import check_metadata
from .safetensors_io import (
    Output,
    as_integers,
    end_to_end,
    header_bytes,
    write_atomically,
    write_bytes,
    write_safetensors,
)

if TYPE_CHECKING:
    import torch


def _write_rows(file: BinaryIO, tensor: torch.Tensor, axis: int, index: torch.Tensor) -> None:
    """The tensor's ``index`` entries along ``axis``, contiguous in its axis order, a
    bounded piece at a time (any strides, any device)."""
    import torch

    tensor = as_integers(tensor)
    index = index.to(tensor.device)
    inner = math.prod(tensor.shape[axis + 1 :]) * tensor.element_size()
    step = max(1, COPY_BYTES // max(inner, 1))
    for lead in itertools.product(*(range(n) for n in tensor.shape[:axis])):
        sub = tensor[lead]
        for start in range(0, len(index), step):
            piece = sub.index_select(0, index[start : start + step]).contiguous().cpu()
            file.write(memoryview(piece.reshape(-1).view(torch.uint8).numpy()))


def _identity(tensor: LayerTensor) -> tuple:
    """What makes two layers' tensors one storage."""
    return tuple(
        (part.device, part.data_ptr(), tuple(part.shape), part.stride())
        for part in layer_parts(tensor)
    )


def _alias_shared_storage(
    description: CacheDescription, tensors: Mapping[str, LayerTensor]
) -> CacheDescription:
    """The description with ``shares`` set on layers whose tensor is the storage of an
    earlier layer's, so that the dump holds each cache once and counts it once."""
    owner_of: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for entry in owner_layers(description):
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
    group_rows: Mapping[int, torch.Tensor],
) -> list[Output]:
    """The tensors of every layer's dumped rows (its group's), checked against the
    description."""
    import torch

    outputs = []
    groups = layer_groups(description)
    for entry in owner_layers(description):
        rows = group_rows[groups[entry.name]]
        tensor = tensors.get(entry.name)
        if tensor is None:
            if entry.name in description.draft_layers:
                continue
            fail(target, f"layer {entry.name} has no tensor in the tensors given")
        spec = entry.spec
        names = tensor_names(entry)
        parts = tensor if isinstance(tensor, tuple) else (tensor,)
        if len(parts) != len(names):
            given = "a K/V pair" if isinstance(tensor, tuple) else "one tensor"
            needs = "one tensor" if len(names) == 1 else "a K/V pair"
            kind = "a state layer" if spec.is_state else f"layout {spec.layout}"
            fail(target, f"layer {entry.name}: {kind} needs {needs}, got {given}")
        check_layer(
            target,
            entry,
            [tuple(part.shape) for part in parts],
            [part.dtype for part in parts],
            names,
            description.blocks_of(groups[entry.name]),
            "blocks",
        )
        if spec.is_state:
            axis, index = 0, rows
        else:
            axis = spec.layout.index("N")
            r = kernel_blocks_per_block(spec)
            index = (rows[:, None] * r + torch.arange(r)).reshape(-1)
        for name, part in zip(names, parts, strict=True):
            try:
                safetensors_dtype_name(part.dtype)
            except ValueError as error:
                fail(target, f"tensor {name}: {error}")
            shape = list(part.shape)
            shape[axis] = len(index)
            outputs.append(
                Output(
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

    out: dict[str, Any] = {}
    for request_id, request in requests.items():
        where = f"request {request_id!r}"
        if not isinstance(request_id, str):
            fail(target, f"request id {short(request_id)} is not a string")
        num_tokens = request.num_tokens
        if not is_int(num_tokens) or num_tokens < 0:
            fail(
                target,
                f"{where}: num_tokens must be a non-negative integer, got {short(num_tokens)}",
            )
        groups = {}
        for group_id, (start, block_ids) in request.groups.items():
            if group_id not in group_ids:
                fail(target, f"{where}: group {group_id} is not a group of the cache description")
            group_where = f"{where} group {group_id}"
            space = description.blocks_of(group_id)
            not_held = f"is not in the cache (0..{space - 1})"
            holds = range(space).__contains__
            check_group_blocks(target, group_where, start, list(block_ids), holds, not_held)
            groups[str(group_id)] = [int(start), [int(block_id) for block_id in block_ids]]
        item: dict[str, Any] = {"num_tokens": int(num_tokens), "groups": groups}
        hashes = block_hashes.get(request_id)
        if hashes:
            item["block_hashes"] = {}
            for group_id, values in hashes.items():
                listed = len(request.groups[group_id][1]) if group_id in request.groups else 0
                if len(values) > listed:
                    fail(
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
                fail(target, f"{name} given for request {request_id!r}, which is not dumped")
    return out


def _stored_output(
    target: str, stored: torch.Tensor | np.ndarray, num_blocks: int, rows: torch.Tensor
) -> Output:
    import torch

    values = (
        stored.detach().cpu().numpy() if isinstance(stored, torch.Tensor) else np.asarray(stored)
    )
    if values.shape != (num_blocks,) or values.dtype not in (np.int64, np.uint64):
        fail(
            target,
            f"stored_checksums: expected int64 or uint64 of shape ({num_blocks},), got "
            f"{values.dtype} of shape {values.shape}",
        )
    data = np.ascontiguousarray(values.view(np.int64)[rows.numpy()]).astype("<i8").tobytes()
    return Output(STORED_CHECKSUMS, torch.int64, (len(rows),), write_bytes(data))


def dump_bytes(
    description: CacheDescription,
    tensors: Mapping[str, LayerTensor],
    requests: Iterable[RequestBlocks],
) -> int:
    """About the bytes a dump of the requests' blocks holds, known before writing it.

    Each layer's tensor holds its group's block space (``CacheDescription.blocks_of``);
    one list of rows serves every layer unless groups have spaces of their own, where
    each group dumps only its own blocks.

    Args:
        description: The cache the tensors hold.
        tensors: The live whole caches, by layer name.
        requests: The requests whose blocks would be dumped (engine block ids).

    Returns:
        The bytes of the layers' rows (metadata left out).

    """
    groups = layer_groups(description)
    per_block: dict[int, int] = dict.fromkeys(groups.values(), 0)
    for name, tensor in tensors.items():
        group_id = groups.get(name)
        if group_id is None:
            continue
        space = max(1, description.blocks_of(group_id))
        per_block[group_id] += (
            sum(part.numel() * part.element_size() for part in layer_parts(tensor)) // space
        )
    listed: dict[int, set[int]] = {group_id: set() for group_id in per_block}
    for request in requests:
        for group_id, (_, block_ids) in request.groups.items():
            listed.setdefault(group_id, set()).update(int(b) for b in block_ids)
    if not description.has_group_spaces:
        every = set().union(*listed.values())
        return len(every) * sum(per_block.values())
    return sum(len(listed[group_id]) * size for group_id, size in per_block.items())


def write_dump(
    path: str | os.PathLike[str],
    description: CacheDescription,
    tensors: LayerTensors,
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
    per block; any strides, any device), by layer name or as vLLM's ``kv_caches`` list in
    the description's layer order; block ids may be lists, numpy arrays or tensors. Only
    the requests' blocks are dumped, rows in ascending block id order (``kvaudit.blocks``),
    unless ``whole_cache``. Where a group has a block space of its own (its own
    ``num_blocks``), its tensors hold that space and each group dumps its own blocks
    (``kvaudit.blocks`` an object by group id). ``stored_checksums`` holds one entry per
    engine block (one block space only). The file is written to a temporary file in the
    same directory, synced and renamed over ``path``: on any error nothing is left and an
    existing file at ``path`` is untouched.

    Args:
        path: The dump file written.
        description: The cache the tensors hold; the dump embeds it.
        tensors: The live whole caches, by layer name or as a ``kv_caches`` list.
        requests: The requests whose blocks are dumped (engine block ids).
        worker: The worker's ranks, sizes, role and engine.
        block_hashes: Per request and group, the hashes of its leading listed blocks.
        received: Per request, the producer's wire bytes (``encode_wire``) it received.
        stored_checksums: The stored checksum of every engine block (int64 or uint64 of
            shape ``(num_blocks,)``); the dump keeps its rows' entries.
        whole_cache: Dump every block of the cache (rows in block id order, no
            ``kvaudit.blocks``), not only the requests' blocks.

    Raises:
        KvauditError: A tensor missing, not matching the description or of a layer the
            description does not have, a bad request, bad ranks or role, or a file that
            cannot be written.

    Example:
        A producer at TP=1 dumps the two blocks (3 and 1, in that order) of a 20-token request:

        >>> import pathlib, tempfile, torch
        >>> from kvaudit import RequestBlocks, WorkerInfo
        >>> from kvaudit.description import parse_description
        >>> from kvaudit.dumps import open_dump, write_dump
        >>> layer = "model.layers.0.self_attn.attn"
        >>> spec = {"type": "full_attention", "block_size": 16, "num_kv_heads": 1,
        ...         "head_size": 4, "dtype": "float32", "layout": "NTHC"}
        >>> groups = [{"spec": spec, "layers": [layer]}]
        >>> description = parse_description({"kvaudit": 1, "num_blocks": 6, "groups": groups}, "w")
        >>> kv = {layer: torch.randn(6, 16, 1, 8)}  # [blocks, tokens, heads, K and V]
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "rank0.safetensors"
        >>> write_dump(path, description, kv, {"req-7": RequestBlocks(20, {0: (0, [3, 1])})},
        ...            worker=WorkerInfo(tp_rank=0, tp_size=1, role="producer"))
        >>> open_dump(path).block_ids  # the dumped rows, in block id order
        [1, 3]

    """
    target = os.fspath(path)
    header, placed = _dump_parts(
        target,
        description,
        tensors,
        requests,
        worker,
        block_hashes,
        received,
        stored_checksums,
        whole_cache,
    )
    write_atomically(target, header, placed)


def write_dump_into(
    file: BinaryIO,
    name: str,
    description: CacheDescription,
    tensors: LayerTensors,
    requests: Mapping[str, RequestBlocks],
    *,
    worker: WorkerInfo,
) -> None:
    """Write one worker's dump of the requests' blocks into an open file.

    The bytes are those ``write_dump`` writes to a file (a live agent's reply payload),
    but neither synced nor renamed.

    Args:
        file: Where the dump's bytes go, from its current position.
        name: The dump in error messages.
        description: The cache the tensors hold.
        tensors: The live whole caches, as for ``write_dump``.
        requests: The requests whose blocks are written (engine block ids).
        worker: The worker's ranks and role.

    Raises:
        KvauditError: As ``write_dump``.

    """
    header, placed = _dump_parts(
        name, description, tensors, requests, worker, None, None, None, False
    )
    write_safetensors(file, header, placed)


def _dump_parts(
    target: str,
    description: CacheDescription,
    tensors: LayerTensors,
    requests: Mapping[str, RequestBlocks],
    worker: WorkerInfo,
    block_hashes: Mapping[str, Mapping[int, Sequence[bytes]]] | None,
    received: Mapping[str, bytes] | None,
    stored_checksums: torch.Tensor | np.ndarray | None,
    whole_cache: bool,
) -> tuple[bytes, list[tuple[Output, int]]]:
    """A dump's safetensors header and its tensors placed end to end, checked as a reader
    checks them."""
    import torch

    check_worker(worker, worker.role, target, "worker")
    tensors = tensors_by_name(description, tensors, target)
    known = set(description_layer_names(description)) | description.draft_layers
    for name in tensors:
        if name not in known:
            fail(
                target,
                f"tensor given for layer {name}, which is not in the cache description",
            )
    requests = plain_requests(requests, target)
    description = _alias_shared_storage(description, tensors)
    request_items = _request_metadata(
        target, description, requests, block_hashes or {}, received or {}
    )
    # Where groups have block spaces of their own each group dumps its own rows
    # (``kvaudit.blocks`` per group); otherwise one list of rows serves every group.
    per_group = description.has_group_spaces
    if per_group and stored_checksums is not None:
        fail(
            target,
            "stored_checksums: stored checksums need one block space for every group; "
            "this description gives groups block spaces of their own",
        )
    group_ids: dict[int, list[int]] = {}
    for group in description.groups:
        if whole_cache:
            space = description.blocks_of(group.id) if per_group else description.num_blocks
            group_ids[group.id] = list(range(space))
        else:
            group_ids[group.id] = sorted(
                {
                    int(block_id)
                    for request in requests.values()
                    for gid, (_, block_ids) in request.groups.items()
                    if per_group is False or gid == group.id
                    for block_id in block_ids
                }
            )
    row_ids = group_ids[description.groups[0].id]
    group_rows = {
        group_id: torch.tensor(ids, dtype=torch.int64) for group_id, ids in group_ids.items()
    }
    outputs = _layer_outputs(target, description, tensors, group_rows)
    if stored_checksums is not None:
        rows = group_rows[description.groups[0].id]
        outputs.append(_stored_output(target, stored_checksums, description.num_blocks, rows))

    compact = {"separators": (",", ":")}
    metadata = {
        META_FORMAT: FORMAT,
        META_WORKER: json.dumps(
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
        META_CACHE: json.dumps(description_to_dict(description), **compact),
        META_REQUESTS: json.dumps(request_items, **compact),
    }
    if not whole_cache:
        listed: Any = (
            {str(group_id): ids for group_id, ids in group_ids.items()} if per_group else row_ids
        )
        metadata[META_BLOCKS] = json.dumps(listed, **compact)
    check_metadata(metadata, target)
    placed = end_to_end(outputs)
    return header_bytes(metadata, placed), placed
