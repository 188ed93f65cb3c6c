"""Naming the fault a diff found: from the located differences and the trace of a
``DiffReport`` to findings (heads exchanged, a stale block, a tail never written, a single
bit, ...), each with its evidence, above the located rows in every report.

Modules: ``model`` (``Finding``, the fault kinds), ``findings`` (``diagnose``: a bitwise
diff's), ``numeric`` (``diagnose_numeric``: a comparison by value's).
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("diagnose", "diagnose_group"), ".findings"),
    **dict.fromkeys(("FAULT_KINDS", "KIND_TITLES", "FaultKind", "Finding"), ".model"),
    **dict.fromkeys(("diagnose_numeric", "diagnose_numeric_group"), ".numeric"),
    "layer_text": ".words",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
