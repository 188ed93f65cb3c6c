"""Narrowing a differing block down: which layers, heads, tokens and bytes differ.

Given a producer's and a consumer's raw KV (``kvaudit.sources.raw.RawWorker``: dumps or
live tensors, one per worker) and a block position at which their checksums differ,
``locate_differences`` reads only that position's block rows on both sides and
compares the cells of each (layer, global head) slice byte by byte: the tokens whose cells
differ, the first differing byte and the largest errors of the differing elements read in
their dtype. A consumer replica is also compared with replica 0 of the same heads.

Modules, each using only those above it: ``cells`` (a block row's cells and their
addresses, shared with ``kvaudit.corrupt`` so that a planted fault and its location agree
on the layout), ``slices`` (one side's cells per slice), ``differences``
(``locate_differences``, ``element_errors``).
"""

from .cells import (
    CellSegment,
    block_row,
    block_tokens,
    cell_addresses,
    cell_bytes,
    cell_segments,
    counted_slots,
    group_views,
    layer_specs,
    piece_bytes,
    read_block,
)
from .differences import element_errors, locate_differences
from .slices import SliceCells, SliceId, SliceReader

__all__ = [
    "CellSegment",
    "SliceCells",
    "SliceId",
    "SliceReader",
    "block_row",
    "block_tokens",
    "cell_addresses",
    "cell_bytes",
    "cell_segments",
    "counted_slots",
    "element_errors",
    "group_views",
    "layer_specs",
    "locate_differences",
    "piece_bytes",
    "read_block",
]
