"""Layer views: a worker's cache tensors seen as unsigned integer pieces, per group.

Each distinct cache of a group becomes one ``LayerView`` (or several, for TP-split state
segments): strided views, never copies, of shape
``[blocks, kernel_blocks, heads, tokens, pieces]`` with the global layer and head numbering
and the replica key of this rank (docs/checksum.md). A group that cannot be checksummed
gets its reason instead.

Modules, each using only those above it: ``model`` (the dataclasses), ``attention`` and
``state`` (a cache's tensor as piece views), ``replicas`` (heads shared across TP ranks),
``groups`` (``build_group_views``: aliases, global heads, replica keys, reasons).
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    "build_group_views": ".groups",
    **dict.fromkeys(("GroupViews", "LayerTensor", "LayerView", "PieceView"), ".model"),
    "check_model_kv_heads": ".replicas",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
