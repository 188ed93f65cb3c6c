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
``kvaudit.formats`` and ``kvaudit.report``. Every name is imported on first use: the
model's users (formats, reports) load no source. ``LocatedDifference`` and
``ElementChange``, which the groups hold, are ``kvaudit.locate``'s.
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    "AttentionWindow": ".groups",
    **dict.fromkeys(
        (
            "NO_RECEIVED",
            "DiffReport",
            "GroupComparison",
            "StaleSource",
            "TokenRun",
            "TokenShift",
        ),
        ".model",
    ),
    **dict.fromkeys(("compare_records", "verify_against_record"), ".records"),
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

__all__ = sorted(_EXPORTS)
