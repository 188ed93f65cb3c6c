"""Narrowing a differing block down: which layers, heads, tokens and bytes differ.

Given a producer's and a consumer's raw KV (``kvaudit.workers.RawWorker``: dumps or
live tensors, one per worker) and a block position at which their checksums differ,
``locate_differences`` reads only that position's block rows on both sides and
compares the cells of each (layer, global head) slice byte by byte: the tokens whose cells
differ, the first differing byte and the largest errors of the differing elements read in
their dtype. A consumer replica is also compared with replica 0 of the same heads.

Modules, each using only those above it: ``model`` (``LocatedDifference``,
``ElementChange``: what locating found, which ``compare``, ``diagnosis`` and the reports
read), ``cells`` (a block row's cells and their addresses, shared with ``kvaudit.corrupt``
so that a planted fault and its location agree on the layout), ``slices`` (one side's
cells per slice), ``differences`` (``locate_differences``, ``element_errors``). The names
are imported on first use: the model's readers load no numpy.
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("ElementChange", "LocatedDifference"), ".model"),
    **dict.fromkeys(
        (
            "CellSegment",
            "block_row",
            "block_tokens",
            "cell_addresses",
            "cell_bytes",
            "cell_segments",
            "counted_slots",
            "group_views",
            "layer_specs",
            "piece_bytes",
            "read_block",
        ),
        ".cells",
    ),
    **dict.fromkeys(("element_errors", "locate_differences"), ".differences"),
    **dict.fromkeys(("SliceCells", "SliceId", "SliceReader"), ".slices"),
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
