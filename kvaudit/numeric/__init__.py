"""The by-value comparison (``diff --numeric``, docs/numeric.md), whole.

``model`` (the report: errors per request, group, layer and head), ``driver``
(``numeric_sources``: two sources compared, with the bitwise diff's checks),
``scheduling`` (``numeric_diff``: requests, layers and threads over two sides' raw KV),
``layers`` (one layer's batch, piece by piece), ``reads`` (one side's rows as values),
``mapped_rows`` (where rows lie in the dumps' mappings, compared in place),
``value_errors`` (the errors between two sides' values, in numpy), ``native`` (the same
in the C extension) and ``budget`` (``NumericBudget``: what it reads and holds at once).
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("DEFAULT_BUDGET", "NumericBudget"), ".budget"),
    "NumericReport": ".model",
    "numeric_diff": ".scheduling",
    "numeric_sources": ".driver",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
