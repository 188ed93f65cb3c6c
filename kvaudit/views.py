"""Layer views: a worker's cache tensors seen as unsigned integer pieces, per group.

Each distinct cache of a group becomes one ``LayerView`` (or several, for TP-split state
segments): strided views, never copies, of shape
``[blocks, kernel_blocks, heads, tokens, pieces]`` with the global layer and head numbering
and the replica key of this rank (docs/checksum.md). A group that cannot be checksummed
gets its reason instead.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from .arrays import (
    Array,
    as_strided,
    data_ptr,
    element_size,
    matches_dtype,
    movedim,
    permute,
    reinterpret,
    strides,
    unflatten,
    unsqueeze,
)
from .description import CacheDescription, GroupDescription, LayerSpec
from .dtypes import UINT8, DType, dtype_name, dtype_size
from .errors import KvauditError, UnsupportedGroupError
from .fingerprint import group_fingerprint
from .scheme import MAX_KV_HEADS_PER_LAYER, ReplicaKey, layer_module, slice_number
from .validation import Checker

LayerTensor: TypeAlias = "Array | tuple[Array, Array]"
"""A layer's cache: one tensor in its layout, or K and V tensors for layouts without ``K``
(torch tensors, or numpy arrays of the elements' bytes as integers: ``kvaudit.arrays``)."""


@dataclass(frozen=True)
class PieceView:
    """One stored part of a cache (a whole cell, or its K or V row) as unsigned pieces
    ``[blocks, kernel_blocks, heads, tokens, pieces]``, any strides.

    ``piece_offset`` is the index of the part's first piece within the cell, and
    ``cell_pieces`` the number of pieces of the whole cell.
    """

    pieces: Array
    piece_offset: int
    cell_pieces: int


@dataclass(frozen=True)
class LayerView:
    """One cache of one layer on this worker: ``heads`` consecutive global heads from
    ``first_head``, held by this rank as replica ``replica_key[1]`` of ``replica_key[0]``."""

    name: str
    number: int
    first_head: int
    heads: int
    replica_key: ReplicaKey
    parts: tuple[PieceView, ...]
    dtype: DType

    @property
    def first_slice(self) -> int:
        """``L * H + h`` of this rank's first head."""
        return slice_number(self.number, self.first_head)


@dataclass
class GroupViews:
    """A group's views on one worker, or the reason it is not covered."""

    group: GroupDescription
    fingerprint: int
    views: list[LayerView] = field(default_factory=list)
    reason: str | None = None

    @property
    def covered(self) -> bool:
        return self.reason is None


@dataclass
class _Cache:
    """A distinct cache (or state segment) before its heads are numbered across the layer
    module: ``heads`` per rank, rank ``r`` holding shard ``r // replicas``, and
    ``first_head`` relative to the cache's place in its module."""

    heads: int
    replicas: int
    parts: tuple[PieceView, ...]
    dtype: DType
    first_head: int = 0
    global_heads: int = 0


def build_group_views(
    description: CacheDescription,
    tensors: Mapping[str, LayerTensor],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    num_blocks: int | None = None,
) -> dict[int, GroupViews]:
    """Every group's views on this worker, keyed by group id.

    ``num_blocks`` is the number of manager blocks the tensors hold (default: the
    description's); a dump holds only its dumped rows.
    """
    Checker(None).rank(tp_rank, tp_size, "tp_rank")
    check_model_kv_heads(description, tp_size)
    blocks = description.num_blocks if num_blocks is None else num_blocks
    result = {}
    for group in description.groups:
        fingerprint = group_fingerprint(group, tp_size, description.draft_layers)
        group_views = GroupViews(group, fingerprint)
        try:
            group_views.views = _group_views(description, group, tensors, tp_rank, tp_size, blocks)
        except UnsupportedGroupError as error:
            group_views.reason = str(error)
        result[group.id] = group_views
    return result


def check_model_kv_heads(description: CacheDescription, tp_size: int) -> None:
    """``model_kv_heads`` against every attention layer's heads per rank at this TP size.

    Raises:
        KvauditError: A layer whose heads across the TP ranks cannot be ``model_kv_heads``;
            the message names the description's source and the layer.

    """
    model = description.model_kv_heads
    if model is None:
        return
    for group in description.groups:
        for entry in group.layers:
            spec = entry.spec
            if spec.is_state or spec.is_mla or entry.name in description.draft_layers:
                continue
            heads = spec.num_kv_heads
            if spec.max_tp_shards is None and heads == 1 and tp_size > 1:
                # One head per rank: the model's heads are replicated over the ranks.
                if model <= tp_size and tp_size % model == 0:
                    continue
                held = f"one KV head per rank at TP {tp_size} needs a count that divides {tp_size}"
            else:
                shards = tp_size if spec.max_tp_shards is None else min(tp_size, spec.max_tp_shards)
                if heads * shards == model:
                    continue
                held = f"{heads} KV heads per rank x {shards} TP shards = {heads * shards}"
            raise KvauditError(
                f"model_kv_heads {model} contradicts layer {entry.name}: {held}", description.source
            )


def _group_views(
    description: CacheDescription,
    group: GroupDescription,
    tensors: Mapping[str, LayerTensor],
    tp_rank: int,
    tp_size: int,
    num_blocks: int,
) -> list[LayerView]:
    """One group's views on this worker, each distinct cache once.

    Raises:
        UnsupportedGroupError: The group cannot be checksummed; the message says why.

    """
    if not group.transfer:
        raise UnsupportedGroupError("it is not a transfer group")
    if group.host_resident:
        raise UnsupportedGroupError("its KV is host-resident")
    layers = [entry for entry in group.layers if entry.name not in description.draft_layers]
    by_name = {entry.name: entry for group_ in description.groups for entry in group_.layers}

    # Aliased caches (``shares:``, or one tensor under several names) count once, under
    # the lowest (layer number, name) that uses them.
    owners: dict[tuple, tuple[int, str]] = {}
    caches: dict[tuple, list[_Cache]] = {}
    for entry in layers:
        number, _ = layer_module(entry.name)
        storage_name = entry.shares or entry.name
        tensor = tensors.get(storage_name)
        if tensor is None:
            raise UnsupportedGroupError(f"layer {storage_name} has no KV cache tensor")
        identity = _storage_identity(tensor)
        if identity in owners:
            owners[identity] = min(owners[identity], (number, entry.name))
            continue
        owners[identity] = (number, entry.name)
        owner_spec = by_name[storage_name].spec
        caches[identity] = _layer_caches(owner_spec, tensor, num_blocks, tp_size, description)

    views: list[LayerView] = []
    modules: dict[int, str] = {}
    next_head: dict[int, int] = defaultdict(int)
    for identity, (number, name) in sorted(owners.items(), key=lambda item: item[1]):
        module = layer_module(name)[1]
        if modules.setdefault(number, module) != module:
            raise UnsupportedGroupError(
                f"layers {modules[number]} and {module} share layer number {number}"
            )
        base = next_head[number]
        for cache in caches[identity]:
            shard, replica = divmod(tp_rank, cache.replicas)
            views.append(
                LayerView(
                    name=name,
                    number=number,
                    first_head=base + cache.first_head + shard * cache.heads,
                    heads=cache.heads,
                    replica_key=(cache.replicas, replica),
                    parts=cache.parts,
                    dtype=cache.dtype,
                )
            )
            next_head[number] = max(next_head[number], base + cache.first_head + cache.global_heads)
        if next_head[number] > MAX_KV_HEADS_PER_LAYER:
            raise UnsupportedGroupError(
                f"layer {number} has more than {MAX_KV_HEADS_PER_LAYER} KV heads"
            )
    return views


def _storage_identity(tensor: LayerTensor) -> tuple:
    """What makes two layers' caches the same storage."""
    parts = tensor if isinstance(tensor, tuple) else (tensor,)
    return tuple((data_ptr(part), tuple(part.shape), strides(part)) for part in parts)


def _layer_caches(
    spec: LayerSpec,
    tensor: LayerTensor,
    num_blocks: int,
    tp_size: int,
    description: CacheDescription,
) -> list[_Cache]:
    """A layer's cache as the caches (state segments) its heads are numbered by."""
    if spec.is_state:
        if isinstance(tensor, tuple):
            raise UnsupportedGroupError("its state cache is given as a K/V pair")
        pages = _state_pages(tensor, num_blocks)
        if spec.state_splits is not None:
            return _split_state_caches(spec, pages, num_blocks, tp_size)
        return _state_caches(spec, pages, num_blocks, tp_size)
    parts = _attention_parts(spec, tensor, num_blocks)
    replicas = _tp_replicas(spec, tp_size, description.model_kv_heads)
    heads = spec.num_kv_heads
    return [_Cache(heads, replicas, parts, spec.dtype, 0, heads * tp_size // replicas)]


def _tp_replicas(spec: LayerSpec, tp_size: int, model_kv_heads: int | None) -> int:
    """How many consecutive TP ranks hold the same heads of an attention layer."""
    if spec.max_tp_shards is not None:
        shards = min(tp_size, spec.max_tp_shards)
        if tp_size % shards:
            raise UnsupportedGroupError(
                f"its max_tp_shards {spec.max_tp_shards} does not divide TP size {tp_size}"
            )
        return tp_size // shards
    if spec.is_mla:
        return tp_size
    if spec.num_kv_heads > 1 or tp_size == 1:
        return 1
    if model_kv_heads is None or model_kv_heads > tp_size or tp_size % model_kv_heads:
        raise UnsupportedGroupError(
            "its KV head replication across TP is unknown (one head per rank, and no "
            "model_kv_heads that divides the TP size)"
        )
    return tp_size // model_kv_heads


def _attention_parts(
    spec: LayerSpec, tensor: LayerTensor, num_blocks: int
) -> tuple[PieceView, ...]:
    """An attention cache as one piece view per stored row kind (cell, or K and V)."""
    layout = spec.layout
    if "N" not in layout:
        raise UnsupportedGroupError(
            f"its layout {layout} has no N (kernel blocks) axis: a token-major layout is only "
            "read from ExampleConnector folders"
        )
    kernel_blocks = spec.block_size // spec.kernel_block_size
    sizes = spec.axis_sizes(kernel_blocks=num_blocks * kernel_blocks)
    if "D" in layout and "K" not in layout:
        if not isinstance(tensor, tuple):
            raise UnsupportedGroupError(
                f"its layout {layout} stores K and V apart, but one tensor was given"
            )
        k_rows = _rows(tensor[0], layout, {**sizes, "D": spec.head_size}, spec, kernel_blocks)
        v_rows = _rows(tensor[1], layout, {**sizes, "D": spec.head_size_v}, spec, kernel_blocks)
        row_pieces = [_as_pieces(rows) for rows in (k_rows, v_rows)]
    else:
        if isinstance(tensor, tuple):
            raise UnsupportedGroupError(
                f"its layout {layout} stores K and V together, but a K/V pair was given"
            )
        if "K" in layout and spec.head_size != spec.head_size_v:
            raise UnsupportedGroupError(
                f"its layout {layout} has a K/V plane but K and V rows of different sizes"
            )
        rows = _rows(tensor, layout, sizes, spec, kernel_blocks)
        row_pieces = (
            [_as_pieces(rows[:, i]) for i in range(2)] if "K" in layout else [_as_pieces(rows)]
        )
    cell_pieces = sum(pieces.shape[-1] for pieces in row_pieces)
    parts = []
    offset = 0
    for pieces in row_pieces:
        if pieces.shape[-1]:
            parts.append(
                PieceView(unflatten(pieces, 0, (num_blocks, kernel_blocks)), offset, cell_pieces)
            )
        offset += pieces.shape[-1]
    return tuple(parts)


def _rows(
    tensor: Array,
    layout: str,
    sizes: dict[str, int],
    spec: LayerSpec,
    kernel_blocks: int,
) -> Array:
    """The tensor's logical axes in the order ``N, [K,] H, T, D|C`` (a view)."""
    expected = tuple(sizes[letter] for letter in layout)
    if tuple(tensor.shape) != expected:
        raise UnsupportedGroupError(
            f"its cache of shape {tuple(tensor.shape)} does not match layout {layout} "
            f"{expected} ({kernel_blocks} kernel blocks of {spec.kernel_block_size} tokens "
            f"per {spec.block_size}-token block)"
        )
    if not matches_dtype(tensor, spec.dtype):
        raise UnsupportedGroupError(
            f"its cache is {dtype_name(tensor.dtype)}, the description says "
            f"{dtype_name(spec.dtype)}"
        )
    if "H" not in layout:
        # A one-head axis just outside the row axis, so its stride is the row's length and
        # the row can still be viewed as 8-byte pieces.
        row = layout.index("C" if "C" in layout else "D")
        tensor = unsqueeze(tensor, row)
        layout = layout[:row] + "H" + layout[row:]
    row_axis = "C" if "C" in layout else "D"
    order = [letter for letter in ("N", "K", "H", "T", row_axis) if letter in layout]
    return permute(tensor, [layout.index(letter) for letter in order])


def _as_pieces(rows: Array) -> Array:
    """Rows ``[..., elements]`` as 8-byte pieces ``[..., pieces]`` (a view)."""
    row_bytes = rows.shape[-1] * element_size(rows)
    if row_bytes % 8:
        raise UnsupportedGroupError(f"its rows of {row_bytes} bytes are not whole 8-byte pieces")
    if rows.shape[-1] > 1 and strides(rows)[-1] != 1:
        raise UnsupportedGroupError("its KV rows are not contiguous in memory")
    try:
        return reinterpret(rows, 8)
    except RuntimeError as error:
        raise UnsupportedGroupError("its KV rows are not 8-byte aligned") from error


def _state_pages(tensor: Array, num_blocks: int) -> Array:
    """A state cache as ``[blocks, page bytes]`` (a view)."""
    if len(tensor.shape) < 1 or tensor.shape[0] != num_blocks:
        raise UnsupportedGroupError(
            f"its state cache of shape {tuple(tensor.shape)} does not hold {num_blocks} blocks"
        )
    try:
        pages = tensor.reshape(num_blocks, -1) if len(tensor.shape) != 2 else tensor
        if data_ptr(pages) != data_ptr(tensor) or (pages.shape[1] > 1 and strides(pages)[1] != 1):
            raise RuntimeError
        return reinterpret(pages, 1)
    except RuntimeError as error:
        raise UnsupportedGroupError("its state pages are not contiguous in memory") from error


def _state_caches(spec: LayerSpec, pages: Array, num_blocks: int, tp_size: int) -> list[_Cache]:
    """Unsplit states: the leading covered states of each page are one cell."""
    covered = sum(
        math.prod(shape) * dtype_size(dtype)
        for shape, dtype in zip(
            spec.shapes[: spec.covered_states], spec.dtypes[: spec.covered_states]
        )
    )
    if covered == 0:
        return []
    if covered > pages.shape[1]:
        raise UnsupportedGroupError(
            f"its pages of {pages.shape[1]} bytes are smaller than its {covered} bytes of states"
        )
    if covered % 8:
        raise UnsupportedGroupError(f"its {covered} bytes of states are not whole 8-byte pieces")
    try:
        pieces = reinterpret(pages[:, :covered], 8)
    except RuntimeError as error:
        raise UnsupportedGroupError("its state pages are not 8-byte aligned") from error
    replicas = tp_size if spec.tp_replicated else 1
    part = PieceView(pieces[:, None, None, None, :], 0, pieces.shape[1])
    dtype = spec.dtypes[0] if spec.dtypes else UINT8
    return [_Cache(1, replicas, (part,), dtype, 0, tp_size // replicas)]


def _split_state_caches(
    spec: LayerSpec, pages: Array, num_blocks: int, tp_size: int
) -> list[_Cache]:
    """TP-split states: each global row along a state's split axis is one slice of its
    elements (2- or 4-byte, zero-extended), numbered across the states in global order."""
    assert spec.state_splits is not None
    caches: list[_Cache] = []
    offset = 0
    global_rows = 0
    for index, (shape, dtype, split) in enumerate(zip(spec.shapes, spec.dtypes, spec.state_splits)):
        size = dtype_size(dtype)
        if size not in (2, 4):
            raise UnsupportedGroupError(
                f"its state {index} of {dtype_name(dtype)} is not of 2- or 4-byte elements"
            )
        nbytes = math.prod(shape) * size
        if offset + nbytes > pages.shape[1]:
            raise UnsupportedGroupError(
                f"its pages of {pages.shape[1]} bytes are smaller than its states"
            )
        if sum(local for local, _ in split.segments) != shape[split.axis]:
            raise UnsupportedGroupError(
                f"the segments of its state {index} do not add up to its split axis of "
                f"{shape[split.axis]} rows"
            )
        try:
            elements = reinterpret(pages[:, offset : offset + nbytes], size)
        except RuntimeError as error:
            raise UnsupportedGroupError(f"its state {index} is not aligned") from error
        offset += nbytes
        # [blocks, rows, other axes...]: the split axis first, the rest in C order.
        rows = movedim(unflatten(elements, 1, shape), split.axis + 1, 1)
        row_parts = _row_pieces(rows)
        local_first = 0
        for local, replicas in split.segments:
            if tp_size % replicas:
                raise UnsupportedGroupError(
                    f"its state {index} has {replicas} replicas, which do not divide "
                    f"TP size {tp_size}"
                )
            parts = tuple(
                PieceView(
                    part[:, None, local_first : local_first + local, None, :],
                    piece_offset,
                    cell_pieces,
                )
                for part, piece_offset, cell_pieces in row_parts
            )
            caches.append(
                _Cache(
                    heads=local,
                    replicas=replicas,
                    parts=parts,
                    dtype=dtype,
                    first_head=global_rows,
                    global_heads=local * tp_size // replicas,
                )
            )
            local_first += local
            global_rows += local * tp_size // replicas
    return caches


def _row_pieces(rows: Array) -> list[tuple[Array, int, int]]:
    """``[blocks, rows, a, b, ...]`` as ``[blocks, rows, pieces]`` parts, each with its
    piece offset and the row's piece count: one part when the other axes merge into one
    strided axis, else one part per index of the leading other axis."""
    cell_pieces = math.prod(rows.shape[2:])
    if len(rows.shape) == 2:
        return [(rows[:, :, None], 0, 1)]

    def split(tensor: Array, offset: int) -> list[tuple[Array, int, int]]:
        merged = _merge_axes(tensor)
        if merged is not None:
            return [(merged, offset, cell_pieces)]
        inner = math.prod(tensor.shape[3:])
        return [
            part
            for i in range(tensor.shape[2])
            for part in split(tensor[:, :, i], offset + i * inner)
        ]

    return split(rows, 0)


def _merge_axes(tensor: Array) -> Array | None:
    """Axes 2.. of ``tensor`` merged into one strided axis, if their strides allow."""
    axes = [(n, s) for n, s in zip(tensor.shape[2:], strides(tensor)[2:]) if n != 1]
    for (_, outer), (size, inner) in itertools.pairwise(axes):
        if outer != inner * size:
            return None
    stride = axes[-1][1] if axes else 1
    count = math.prod(n for n, _ in axes)
    return as_strided(tensor, (*tensor.shape[:2], count), (*strides(tensor)[:2], stride))
