"""Comparisons, one module per verb, each with its pure part and its driver: sources (or
records) in, a ``DiffReport`` out.

``model`` (the ``DiffReport``: per request and group, the block positions compared, those
whose totals differ, the replicas that disagree, why a group could not be compared),
``groups`` (one request's group compared between two sides), ``records`` (two records:
``diff``, ``verify --against``), ``sides`` (what a comparison learns of its two sides: the
requested ids, the tokens both hold, warnings, attention windows), ``diff``
(``diff_sources``: checksummed, compared, located, traced), ``trace`` (differing consumer
blocks traced to the producer blocks they hold), ``received`` (``verify --received``),
``stored`` (``verify --stored``) and ``verify`` (``verify_sources``: one of three ways).
The comparison by value is ``kvaudit.numeric``; reports are written by
``kvaudit.formats`` and ``kvaudit.report``. The drivers are imported on first use: the
model's users (formats, reports) load no source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.lazy import lazy_exports
from .groups import AttentionWindow
from .model import (
    NO_RECEIVED,
    DiffReport,
    ElementChange,
    GroupComparison,
    LocatedDifference,
    StaleSource,
    TokenRun,
    TokenShift,
)
from .records import compare_records, verify_against_record

if TYPE_CHECKING:
    from .diff import diff_sources, diff_work, locate_report
    from .options import DEFAULT_OPTIONS, CompareOptions
    from .received import carried_wires, received_wires, verify_received, verify_wire
    from .sides import shared_tokens
    from .stored import (
        StoredCheck,
        stored_checks,
        stored_report,
        verify_stored,
        verify_stored_blocks,
    )
    from .verify import verify_sources, verify_work

_EXPORTS = {
    **dict.fromkeys(("CompareOptions", "DEFAULT_OPTIONS"), ".options"),
    **dict.fromkeys(("diff_sources", "diff_work", "locate_report"), ".diff"),
    **dict.fromkeys(
        ("carried_wires", "received_wires", "verify_received", "verify_wire"), ".received"
    ),
    **dict.fromkeys(
        ("StoredCheck", "stored_checks", "stored_report", "verify_stored", "verify_stored_blocks"),
        ".stored",
    ),
    **dict.fromkeys(("verify_sources", "verify_work"), ".verify"),
    "shared_tokens": ".sides",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "DEFAULT_OPTIONS",
    "NO_RECEIVED",
    "AttentionWindow",
    "CompareOptions",
    "DiffReport",
    "ElementChange",
    "GroupComparison",
    "LocatedDifference",
    "StaleSource",
    "StoredCheck",
    "TokenRun",
    "TokenShift",
    "carried_wires",
    "compare_records",
    "diff_sources",
    "diff_work",
    "locate_report",
    "received_wires",
    "shared_tokens",
    "stored_checks",
    "stored_report",
    "verify_against_record",
    "verify_received",
    "verify_sources",
    "verify_stored",
    "verify_stored_blocks",
    "verify_wire",
    "verify_work",
]
