"""One side's cells gathered per (layer, global head, replica) slice: ``SliceReader`` reads
the block rows of some request positions from every worker that holds them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.dtypes import dtype_size
from ..description import LayerSpec
from ..views import GroupViews, LayerView
from ..workers import RawWorker
from .cells import CellSegment, cell_bytes, cell_segments, layer_specs, read_block


@dataclass(frozen=True)
class SliceCells:
    """One (layer, global head, replica) of one side: its cells ``[tokens, cell bytes]`` at
    some request positions ``tokens`` (sorted, each once), with the layer number and how
    a cell reads as values; ``parts`` are the first bytes of the K and V rows of an
    attention cell (``(0, K bytes)``), else empty."""

    number: int
    segments: tuple[CellSegment, ...]
    tokens: np.ndarray
    cells: np.ndarray
    worker: tuple[int, int] = (0, 0)
    file: str = ""
    parts: tuple[int, ...] = ()


SliceId = tuple[str, int, int]
"""``(layer name, global head, replica index)``."""


@dataclass
class SliceReader:
    """One side's workers that hold a request's group, with their views of the group
    (covered ones only) and its layers' specs."""

    workers: list[tuple[RawWorker, GroupViews, dict[str, LayerSpec]]]

    @classmethod
    def open(cls, raw: Sequence[RawWorker], request_id: str, group_id: int) -> SliceReader:
        """The workers of ``raw`` that list blocks of the request's group and cover it."""
        workers = []
        for dump in raw:
            request = dump.requests.get(request_id)
            if request is None or group_id not in request.groups:
                continue
            views = dump.array_views.get(group_id)
            if views is None or not views.covered:
                continue
            workers.append((dump, views, layer_specs(dump.description, group_id)))
        return cls(workers)

    def gather(
        self,
        request_id: str,
        group_id: int,
        lo: int,
        hi: int,
        layers: Collection[str] | None = None,
    ) -> dict[SliceId, SliceCells]:
        """The cells of request positions ``lo .. hi - 1`` (a state block: its first
        position) from every worker that holds them; only ``layers`` where given."""
        kinds: dict[SliceId, tuple[int, tuple[CellSegment, ...], RawWorker, tuple[int, ...]]] = {}
        tokens: dict[SliceId, list[np.ndarray]] = defaultdict(list)
        cells: dict[SliceId, list[np.ndarray]] = defaultdict(list)
        for dump, views, specs in self.workers:
            start, block_ids = dump.requests[request_id].groups[group_id]
            block_size = views.group.block_size
            for view in views.views:
                if layers is not None and view.name not in layers:
                    continue
                spec = specs[view.name]
                for position in _positions(lo, hi, block_size, spec.is_state):
                    if not start <= position < start + len(block_ids):
                        continue
                    first = position * block_size
                    if spec.is_state:
                        used = np.array([0])
                    else:
                        used = np.arange(max(lo, first), min(hi, first + block_size)) - first
                    block = read_block(view, dump.row_of(block_ids[position - start], group_id))[
                        :, used
                    ]
                    for h in range(view.heads):
                        key = (view.name, view.first_head + h, view.replica_key[1])
                        if key not in kinds:
                            segments = cell_segments(spec, view)
                            kinds[key] = (view.number, segments, dump, _parts(spec, view))
                        tokens[key].append(first + used)
                        cells[key].append(block[h])
        result = {}
        for key, (number, segments, dump, parts) in kinds.items():
            held, index = np.unique(np.concatenate(tokens[key]), return_index=True)
            worker = (dump.worker.tp_rank, dump.worker.pp_rank)
            cells_held = np.concatenate(cells[key])[index]
            result[key] = SliceCells(number, segments, held, cells_held, worker, dump.name, parts)
        return result


def _parts(spec: LayerSpec, view: LayerView) -> tuple[int, ...]:
    """Where a cell's V row starts, as ``(0, K bytes)``, for an attention cell of a K row
    then a V row (stored apart or together); empty for any other cell."""
    if spec.is_state or not spec.head_size_v:
        return ()
    size = dtype_size(view.dtype)
    if (spec.head_size + spec.head_size_v) * size != cell_bytes(view):
        return ()
    return (0, spec.head_size * size)


def _positions(lo: int, hi: int, block_size: int, is_state: bool) -> range:
    """A side's block positions that hold request positions ``lo .. hi - 1`` (state blocks:
    whose first position lies there)."""
    if hi <= lo:
        return range(0)
    if is_state:
        return range(-(-lo // block_size), -(-hi // block_size))
    return range(lo // block_size, (hi - 1) // block_size + 1)
