"""Where a layer's rows lie in the dumps' file mappings, for ``kvaudit.numeric`` to compare
them in place (docs/numeric.md): per (head, token) row of a piece, the mapping and byte
offset of each of its parts (a cell, or its K and V rows), computed with numpy for a
worker's rows at once. The C extension (``compare_mapped``) checks every location against
its mapping's bounds and reads the rows there: no ``pread``, no staging copy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from ..core.arrays import is_numpy
from ..core.mapping import FileMap
from ..views import LayerView
from ..workers import RawWorker
from .model import Tolerance
from .native import add_mapped_batch
from .reads import LayerValues, WorkerRows
from .value_errors import LayerErrors, scratch


@dataclass(frozen=True)
class PartPlace:
    """One stored part of a dump's layer in its mapping: the mapping, the byte offset of
    its first piece, its byte strides (block row, kernel block, head, token), the index
    of its first element within the cell and its elements (consecutive in the file)."""

    mapped: FileMap
    base: int
    strides: tuple[int, int, int, int]
    start: int
    width: int


class MapTable:
    """The mappings one comparison call reads, numbered in the order first met."""

    def __init__(self) -> None:
        self.maps: list[FileMap] = []
        self._index: dict[int, int] = {}

    def index(self, mapped: FileMap) -> int:
        """The mapping's number in the table (added if new)."""
        key = id(mapped)
        if key not in self._index:
            self._index[key] = len(self.maps)
            self.maps.append(mapped)
        return self._index[key]

    def buffers(self) -> list[object]:
        """The mappings' buffers, in table order (what the C extension reads)."""
        return [mapped.buffer for mapped in self.maps]

    def check_unchanged(self) -> None:
        """Refuse to read a mapped file that shrank (reading its lost pages is a SIGBUS).

        Raises:
            KvauditError: A file changed while reading.

        """
        for mapped in self.maps:
            mapped.check_unchanged()


Located = tuple[np.ndarray, np.ndarray, tuple[tuple[int, int], ...], int, bool]
"""A side's layer piece in place: ``where`` int64 ``[parts, heads, tokens, 2]`` (mapping
number, byte offset), ``held`` ``[heads, tokens]``, the parts' ``(start, width)``
elements, the bytes of the block rows it reads from (as ``value_reads.decode_layer``
counts them), and whether a token's heads lie closer together than a head's tokens."""


StackedPlans = tuple[Sequence[Sequence[WorkerRows]], Sequence[Sequence[WorkerRows]]]
"""Both sides' rows of a piece: one plan (``value_reads.plan_rows``) per request compared
at once, in the same order on both sides."""


class MappedRows:
    """Each dump layer part's place in its mapping, found once per comparison (keyed by
    the pieces array, which is held so that its id stays its own), and how many bytes of
    mapped pages a comparison call may hold: ``release`` (a thread's share)."""

    def __init__(self, release: int) -> None:
        self._places: dict[int, tuple[object, list[PartPlace] | None]] = {}
        self.release = release

    def places(self, worker: RawWorker, view: LayerView) -> list[PartPlace] | None:
        """Where a view's parts lie in the worker's mappings; None where they cannot be
        read in place (not a dump, a cell's elements apart, outside every mapping)."""
        key = id(view.parts[0].pieces)
        found = self._places.get(key)
        if found is None:
            found = self._places[key] = (view.parts[0].pieces, _find(worker, view))
        return found[1]

    def add(
        self,
        native: ModuleType,
        errors: LayerErrors,
        piece: tuple[int, int, StackedPlans],
        name: str,
        layers: tuple[LayerValues, LayerValues],
        tolerance: Tolerance,
        chunk: int,
        token_ratio: np.ndarray | None = None,
    ) -> tuple[np.ndarray, int] | None:
        """Add a piece of layer ``name``'s batch (request positions ``lo .. hi - 1`` and
        both sides' rows, ``piece = (lo, hi, stack)``) to its errors with both sides' rows
        read where they lie in the dumps' mappings, ``chunk`` tokens at a time, the 2 MiB
        regions of the rows read released once they reach ``release`` bytes, and at the
        end; within a chunk token by token where both sides' heads of a token lie closer
        than a head's tokens, else head by head (the rows read in about their order in the
        files). With several
        requests stacked, ``errors`` holds each request's heads after the previous one's.
        Returns its token row (one per head, ``[heads, tokens]``, where several requests
        are stacked) and the bytes of rows read, or None, nothing done, where a side's rows
        cannot be read so (live tensors): the staged path reads them. ``token_ratio``
        (where given, float64 of the token row's shape) is filled with the largest
        tolerance ratio (``add_mapped_batch``).

        Raises:
            KvauditError: A dump file shrank since it was mapped.

        """
        lo, hi, stack = piece
        table = MapTable()
        located = []
        for side, plans, layer in zip("pc", stack, layers):
            found = self.locate(plans, name, (layer.heads, hi - lo), table, side)
            if found is None:
                return None
            located.append(found)
        table.check_unchanged()
        (p_where, p_held, p_parts, p_read, p_near), (c_where, c_held, c_parts, c_read, c_near) = (
            located
        )
        sides = tuple((layer.dtype, layer.head_size, layer.scales) for layer in layers)
        token_row = add_mapped_batch(
            native,
            errors,
            lo,
            table.buffers(),
            ((p_where, p_parts), (c_where, c_parts)),
            p_held & c_held,
            sides,  # type: ignore[arg-type]
            tolerance,
            # Several requests: head by head (a token's rows lie in as many blocks).
            (chunk, self.release, p_near and c_near and len(stack[0]) == 1),
            by_head=len(stack[0]) > 1,
            token_ratio=token_ratio,
        )
        return token_row, p_read + c_read

    def locate(
        self,
        plans: Sequence[Sequence[WorkerRows]],
        name: str,
        shape: tuple[int, int],
        table: MapTable,
        side: str,
    ) -> Located | None:
        """Where layer ``name``'s rows of a piece lie, ``shape = (heads, tokens)``, for one
        side's ``plans`` (``value_reads.plan_rows``: one per request stacked, each
        request's heads after the previous one's), in this thread's buffer for ``side``
        (valid until its next call for that side); None where a worker's rows cannot be
        read in place, or none holds the layer (the staged path reads them instead)."""
        heads, tokens = shape
        stacked = (len(plans) * heads, tokens)
        where: np.ndarray | None = None
        layout: tuple[tuple[int, int], ...] = ()
        held = np.zeros(stacked, dtype=bool)
        spanned = 0
        heads_near = True
        for first, item in ((r * heads, item) for r, plan in enumerate(plans) for item in plan):
            view = item.views.get(name)
            if view is None:
                continue
            places = self.places(item.worker, view)
            if places is None:
                return None
            parts = tuple((place.start, place.width) for place in places)
            if where is None:
                # A thread's buffer, reused: allocating and freeing one a piece made the
                # allocator return its pages to the system and fault them in again.
                shape4 = (len(parts), *stacked, 2)
                layout, where = parts, scratch(f"where-{side}", np.int64, shape4)
            elif parts != layout:
                return None
            _, kernel_blocks, _, block_tokens, _ = view.parts[0].pieces.shape
            rows, kernel_block, token = item.token_places(kernel_blocks, block_tokens)
            heads_at = slice(first + view.first_head, first + view.first_head + view.heads)
            for number, place in enumerate(places):
                row_stride, block_stride, head_stride, token_stride = place.strides
                along = place.base + rows * row_stride + kernel_block * block_stride
                along += token * token_stride
                into = where[number, heads_at, item.target]
                into[..., 0] = table.index(place.mapped)
                into[..., 1] = along + np.arange(view.heads, dtype=np.int64)[:, None] * head_stride
                whole_rows = len(item.rows) * kernel_blocks * block_tokens * view.heads
                spanned += whole_rows * place.width * view.dtype.itemsize
                heads_near = heads_near and abs(head_stride) < abs(token_stride)
            held[heads_at, item.target] = True
        if where is None:
            return None
        return where, held, layout, spanned, heads_near


def _find(worker: RawWorker, view: LayerView) -> list[PartPlace] | None:
    """Where a dump view's parts are in its mappings, sorted by their first element;
    None where they cannot be read in place."""
    maps: list[FileMap] | None = getattr(worker, "maps", None)  # a dump's; live: none
    if not maps:
        return None
    places = []
    for part in view.parts:
        pieces = part.pieces
        if not is_numpy(pieces) or pieces.size == 0:
            return None
        size = pieces.dtype.itemsize
        if pieces.shape[-1] > 1 and pieces.strides[-1] != size:
            return None  # a cell's elements apart: the staged path reads them
        start = int(pieces.__array_interface__["data"][0])
        mapped = next((m for m in maps if m.address <= start < m.address + m.length), None)
        if mapped is None:
            return None
        row, block, head, token = (int(stride) for stride in pieces.strides[:4])
        first = part.piece_offset * size // view.dtype.itemsize
        width = pieces.shape[-1] * size // view.dtype.itemsize
        strides = (row, block, head, token)
        places.append(PartPlace(mapped, start - mapped.address, strides, first, width))
    return sorted(places, key=lambda place: place.start)
