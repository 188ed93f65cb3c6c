"""Reading one side's raw KV as values for ``kvaudit.numeric``: the workers that hold a
request's group, its attention layers, which block rows hold a batch of request positions,
and one layer's batch decoded into a ``[heads, tokens, elements]`` float buffer (a dump's
rows read in place where consecutive, else copied whole once; no torch for dumps)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from ..core.arrays import element_size, is_numpy
from ..core.dtypes import DType
from ..core.elements import copy_bits, decode
from ..core.errors import KvauditError
from ..core.mapping import CHANGED, FileMap
from ..description import LayerSpec
from ..locate import layer_specs
from ..views import GroupViews, LayerView
from ..workers import RawWorker

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LayerValues:
    """One layer of a side's group: number, global heads, elements per cell, dtype and
    the scales of its K and V elements."""

    number: int
    heads: int
    elements: int
    head_size: int
    dtype: DType
    scales: tuple[float | None, float | None]


class RowFiles:
    """Dump files opened while one thread reads a layer's batch, to read rows with
    ``pread`` into a buffer: rows far apart in a mapping would each map a large folio of
    pages (slow to map, and the RSS grows by the folio). Close it (``with``) after."""

    def __init__(self) -> None:
        self._descriptors: dict[str, int | None] = {}
        # By id; the pieces are held too, so that no other array takes their id meanwhile.
        self._layouts: dict[int, tuple[np.ndarray, tuple[int, str, int, int] | None]] = {}
        self._buffer = np.empty(0, dtype=np.uint8)

    def __enter__(self) -> RowFiles:
        return self

    def __exit__(self, *_: object) -> None:
        for descriptor in self._descriptors.values():
            if descriptor is not None:
                os.close(descriptor)
        self._descriptors.clear()

    def descriptor(self, mapped: FileMap) -> int | None:
        """The mapped file opened for reading; None where the path now names another file
        (the mapping is read instead) or cannot be opened."""
        if mapped.path not in self._descriptors:
            try:
                descriptor = os.open(mapped.path, os.O_RDONLY)
            except OSError:
                descriptor = None
            if descriptor is not None:
                info = os.fstat(descriptor)
                if (info.st_dev, info.st_ino) != mapped.identity:
                    os.close(descriptor)
                    descriptor = None
            self._descriptors[mapped.path] = descriptor
        return self._descriptors[mapped.path]

    def layout(self, worker: RawWorker, pieces: np.ndarray) -> tuple[int, str, int, int] | None:
        """Where a dump's pieces are in its file: the open file, its path, the offset of
        their first row and the bytes a row spans; None where they are read from the
        mapping (no file, strides that do not keep a row together)."""
        key = id(pieces)
        if key not in self._layouts:
            self._layouts[key] = (pieces, self._find(worker, pieces))
        return self._layouts[key][1]

    def _find(self, worker: RawWorker, pieces: np.ndarray) -> tuple[int, str, int, int] | None:
        maps: list[FileMap] | None = getattr(worker, "maps", None)  # a dump's; live: none
        size = pieces.dtype.itemsize
        if not maps or any(stride <= 0 or stride % size for stride in pieces.strides):
            return None
        inner = pieces.strides[1:]
        span = sum((n - 1) * stride for n, stride in zip(pieces.shape[1:], inner)) + size
        if span > 2 * math.prod(pieces.shape[1:]) * size:
            return None
        start = int(pieces.__array_interface__["data"][0])
        mapped = next((m for m in maps if m.address <= start < m.address + m.length), None)
        descriptor = None if mapped is None else self.descriptor(mapped)
        if mapped is None or descriptor is None:
            return None
        return descriptor, mapped.path, start - mapped.address, span

    def buffer(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes``, reused read after read."""
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer[:nbytes]


def _file_rows(
    worker: RawWorker, pieces: np.ndarray, rows: Sequence[int], files: RowFiles
) -> np.ndarray | None:
    """The rows of a dump's ``pieces`` read from its file into ``files``' buffer, as an
    array of the same row layout; None where they are read from the mapping instead (no
    file, strides that do not keep a row together).

    Raises:
        KvauditError: The file shrank while reading.

    """
    found = files.layout(worker, pieces)
    if found is None:
        return None
    descriptor, path, offset, span = found
    buffer = files.buffer(len(rows) * span)
    step = pieces.strides[0]
    for index, row in enumerate(rows):
        part = buffer[index * span : (index + 1) * span]
        if os.preadv(descriptor, [part], offset + row * step) != span:
            raise KvauditError(f"{CHANGED}: it is shorter than when opened", path)
    shape = (len(rows), *pieces.shape[1:])
    return np.ndarray(shape, pieces.dtype, buffer, strides=(span, *pieces.strides[1:]))


def _row_source(
    worker: RawWorker,
    pieces: np.ndarray | torch.Tensor,
    rows: Sequence[int],
    files: RowFiles | None,
) -> tuple[np.ndarray, list[int]]:
    """Where one part's rows are read from, and their indices there: a dump's rows read
    from its file, other numpy rows in place, a tensor's rows copied to the CPU in one
    gather."""
    if is_numpy(pieces):
        read = None if files is None else _file_rows(worker, pieces, rows, files)
        if read is not None:
            return read, list(range(len(rows)))
        if pieces.strides[-1] == pieces.dtype.itemsize:
            return pieces, list(rows)
        return np.ascontiguousarray(pieces[np.asarray(rows)]), list(range(len(rows)))
    import torch

    index = torch.as_tensor(list(rows), dtype=torch.long, device=pieces.device)
    return pieces.index_select(0, index).cpu().numpy(), list(range(len(rows)))


@dataclass(frozen=True)
class GroupWorker:
    """A worker of one side that holds a request's group and covers it: its raw KV, its
    views of the group and the group's layer specs by layer name."""

    raw: RawWorker
    views: GroupViews
    specs: dict[str, LayerSpec]


def side_workers(raw: Sequence[RawWorker], request_id: str, group_id: int) -> list[GroupWorker]:
    """The workers that list the request's group and cover it."""
    found = []
    for worker in raw:
        request = worker.requests.get(request_id)
        views = worker.array_views.get(group_id)
        if request is None or group_id not in request.groups or views is None:
            continue
        if views.covered:
            found.append(GroupWorker(worker, views, layer_specs(worker.description, group_id)))
    return found


def side_layers(side: list[GroupWorker]) -> dict[str, LayerValues]:
    """The attention layers a side's workers hold (states are compared by checksum only)."""
    layers: dict[str, LayerValues] = {}
    for held in side:
        for view in held.views.views:
            spec = held.specs[view.name]
            if spec.is_state:
                continue
            heads = view.first_head + view.heads
            seen = layers.get(view.name)
            if seen is not None:
                heads = max(heads, seen.heads)
            scales = (spec.k_scale, spec.v_scale)
            elements = spec.head_size + spec.head_size_v
            layers[view.name] = LayerValues(
                view.number, heads, elements, spec.head_size, view.dtype, scales
            )
    return layers


@dataclass(frozen=True)
class WorkerRows:
    """One worker's block rows that hold request positions of a batch: token ``skip`` of
    the first row is batch position ``target.start``, ``count`` positions in all."""

    worker: RawWorker
    views: dict[str, LayerView]
    rows: list[int]
    skip: int
    count: int
    target: slice
    _places: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def token_places(
        self, kernel_blocks: int, block_tokens: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per position, its block row, kernel block in the row and token in the kernel
        block, for rows of ``kernel_blocks`` blocks of ``block_tokens``: the same for every
        layer of a group, so found once (int64 arrays, not to be written)."""
        key = (kernel_blocks, block_tokens)
        found = self._places.get(key)
        if found is None:
            positions = np.arange(self.skip, self.skip + self.count)
            rows = np.asarray(self.rows, dtype=np.int64)[
                positions // (kernel_blocks * block_tokens)
            ]
            found = self._places[key] = (
                rows,
                positions // block_tokens % kernel_blocks,
                positions % block_tokens,
            )
        return found


def attention_views(side: list[GroupWorker]) -> list[dict[str, LayerView]]:
    """Per worker of a side, its attention views of replica 0 by layer name (copies of a
    head are read once; states are compared by checksum only)."""
    return [
        {
            view.name: view
            for view in held.views.views
            if view.replica_key[1] == 0 and not held.specs[view.name].is_state
        }
        for held in side
    ]


def plan_rows(
    side: list[GroupWorker],
    chosen: list[dict[str, LayerView]],
    request: tuple[str, int],
    lo: int,
    hi: int,
) -> list[WorkerRows]:
    """Which rows of which of the side's workers hold request positions ``lo .. hi - 1``
    of ``request = (id, group)``, with each worker's ``chosen`` views
    (``attention_views``)."""
    request_id, group_id = request
    plan = []
    for held, named in zip(side, chosen):
        worker, views = held.raw, held.views
        start, block_ids = worker.requests[request_id].groups[group_id]
        block_size = views.group.block_size
        first = max(lo // block_size, start)
        last = min((hi - 1) // block_size, start + len(block_ids) - 1)
        if last < first:
            continue
        rows = [worker.row_of(block_ids[p - start], group_id) for p in range(first, last + 1)]
        # Request positions first * block_size + u; those in lo .. hi - 1 are consecutive.
        skip = max(lo - first * block_size, 0)
        count = min(hi, (last + 1) * block_size) - max(lo, first * block_size)
        begin = first * block_size + skip - lo
        plan.append(WorkerRows(worker, named, rows, skip, count, slice(begin, begin + count)))
    return plan


def decode_layer(
    plan: Sequence[WorkerRows],
    name: str,
    layer: LayerValues,
    out: tuple[np.ndarray, np.ndarray],
    files: RowFiles | None = None,
    *,
    raw: bool = False,
) -> int:
    """Decode a layer's batch into ``values`` ``[heads, batch tokens, elements]`` (its
    work dtype, times its scales) and mark the ``[heads, batch tokens]`` decoded in
    ``held`` (positions not marked are left as they were), ``out = (values, held)``; dumps'
    rows are read through ``files`` where given. ``raw``: the elements' bits are copied
    instead (``values`` of an unsigned type of their size), unscaled. Returns the bytes
    read."""
    values, held = out
    write = copy_bits if raw else decode
    reader = _reader() if raw and files is not None else None
    read = 0
    for item in plan:
        view = item.views.get(name)
        if view is None:
            continue
        heads = slice(view.first_head, view.first_head + view.heads)
        target = values[heads, item.target]
        for part in view.parts:
            size = element_size(part.pieces)
            _, kernel_blocks, _, tokens, pieces = part.pieces.shape
            read += len(item.rows) * kernel_blocks * view.heads * tokens * pieces * size
            start = part.piece_offset * size // view.dtype.itemsize
            width = pieces * size // view.dtype.itemsize
            into = target[..., start : start + width]
            if reader and files and _scattered(reader, item, part.pieces, files, (values, into)):
                continue
            source = _row_source(item.worker, part.pieces, item.rows, files)
            _decode_part(source, item, (view.dtype, write), into)
        held[heads, item.target] = True
        if raw:
            continue
        k_scale, v_scale = layer.scales
        if k_scale is not None:
            target[..., : layer.head_size] *= k_scale
        if v_scale is not None:
            target[..., layer.head_size :] *= v_scale
    return read


def _reader() -> ModuleType | None:
    """The C extension that reads rows into place, or None (not built, or
    ``KVAUDIT_NATIVE=0``)."""
    from ..core import native  # only when comparing by value: other commands load no extension

    return native.extension("kvaudit._native._value_reads")


def _scattered(
    reader: ModuleType,
    item: WorkerRows,
    pieces: np.ndarray | torch.Tensor,
    files: RowFiles,
    out: tuple[np.ndarray, np.ndarray],
) -> bool:
    """Read a dump's rows of ``pieces`` at ``item`` from its file into ``out = (values,
    target)`` (``target`` a view of ``values``: ``[heads, count, part elements]`` bits) with
    the C extension; False, nothing read, where it does not apply (no file, a cell's
    elements apart).

    Raises:
        KvauditError: The file shrank while reading.

    """
    values, target = out
    if not is_numpy(pieces) or pieces.strides[-1] != pieces.dtype.itemsize:
        return False
    if target.strides[-1] != target.itemsize:
        return False
    _, blocks, heads, tokens, count = pieces.shape
    found = files.layout(item.worker, pieces)
    if found is None:
        return False
    descriptor, path, offset, span = found
    offsets = offset + np.asarray(item.rows, dtype=np.int64) * pieces.strides[0]
    base = target.__array_interface__["data"][0] - values.__array_interface__["data"][0]
    row = (span, blocks, heads, tokens, *pieces.strides[1:4], count * pieces.dtype.itemsize)
    kept = (base, *target.strides[:2], item.skip, item.count)
    done = reader.scatter_rows(descriptor, offsets, row, values, kept)
    if done != len(item.rows):
        raise KvauditError(f"{CHANGED}: it is shorter than when opened", path)
    return True


Writer = Callable[[np.ndarray, DType, np.ndarray], None]
"""``decode`` or ``copy_bits``: elements' bytes (uint8, last axis) written into an array."""


def _decode_part(
    rows_at: tuple[np.ndarray, list[int]],
    item: WorkerRows,
    dtype_write: tuple[DType, Writer],
    out: np.ndarray,
) -> None:
    """Decode one part's cells at ``item``'s positions (rows ``rows_at[1]`` of
    ``rows_at[0]``, pieces ``[rows, kernel blocks, heads, tokens, pieces]``) into ``out``
    ``[heads, count, part elements]``, row by row, with ``dtype_write = (dtype, decode
    or copy_bits)``."""
    source, rows = rows_at
    dtype, write = dtype_write
    _, kernel_blocks, _, tokens, _ = source.shape
    per_row = kernel_blocks * tokens
    begin, end = item.skip, item.skip + item.count
    if source.shape[0] == len(rows) == rows[-1] + 1 and end - begin == len(rows) * per_row:
        # Whole rows, all of them in order (read into a buffer): one pass.
        cells = source.view(np.uint8).transpose(2, 0, 1, 3, 4)  # heads first, a view
        target = out.view()
        target.shape = (*cells.shape[:-1], out.shape[-1])
        write(cells, dtype, target)
        return
    for index, row in enumerate(rows):
        lo, hi = max(begin, index * per_row), min(end, (index + 1) * per_row)
        if lo >= hi:
            continue
        cells = source[row].view(np.uint8).transpose(1, 0, 2, 3)  # [heads, kb, tokens, bytes]
        if hi - lo == per_row:
            # Splitting the token axis of a slice of the buffer: a view, never a copy
            # (setting ``shape`` raises rather than copy).
            target = out[:, lo - begin : hi - begin].view()
            target.shape = (*cells.shape[:-1], out.shape[-1])
            write(cells, dtype, target)
            continue
        # A row cut short (the batch's first or last): its kernel blocks one by one.
        for block in range(kernel_blocks):
            first = index * per_row + block * tokens
            a, b = max(lo, first), min(hi, first + tokens)
            if a < b:
                write(cells[:, block, a - first : b - first], dtype, out[:, a - begin : b - begin])


def block_unit(sides: Sequence[list[GroupWorker]]) -> int:
    """The least multiple of every block size of both sides."""
    return math.lcm(*(held.views.group.block_size for side in sides for held in side))


def batch_tokens(sides: Sequence[list[GroupWorker]], batch_bytes: int) -> int:
    """Tokens per batch: a multiple of every block size of both sides, about
    ``batch_bytes`` of cells on the larger side."""
    unit = block_unit(sides)
    per_token = max(
        sum(view.heads * _cell_bytes(view) for held in side for view in held.views.views)
        for side in sides
    )
    return max(unit, batch_bytes // max(per_token, 1) // unit * unit)


def _cell_bytes(view: LayerView) -> int:
    """The bytes of one cell of the view."""
    return view.parts[0].cell_pieces * element_size(view.parts[0].pieces)
