"""Naming the fault a diff found: from the located differences and the trace of a
``DiffReport`` to findings (heads exchanged, a stale block, a tail never written, a single
bit, ...), each with its evidence, above the located rows in every report.

Modules: ``model`` (``Finding``, the fault kinds), ``findings`` (``diagnose``: a bitwise
diff's), ``numeric`` (``diagnose_numeric``: a comparison by value's).
"""

from .findings import diagnose, diagnose_group
from .model import FAULT_KINDS, KIND_TITLES, FaultKind, Finding
from .numeric import diagnose_numeric, diagnose_numeric_group
from .words import layer_text

__all__ = [
    "FAULT_KINDS",
    "KIND_TITLES",
    "FaultKind",
    "Finding",
    "diagnose",
    "diagnose_group",
    "diagnose_numeric",
    "diagnose_numeric_group",
    "layer_text",
]
