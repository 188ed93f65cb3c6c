"""Comparing checksums: a producer with a consumer, a dump set with a saved record or
with the producer totals it received, and offloaded blocks with their stored checksums.

Every comparison produces a ``DiffReport`` (``model.py``): per request and group, the
block positions compared, those whose totals differ, the replicas that disagree, and the
reason a group could not be compared at all. ``sides.py`` compares one group,
``record_diff.py`` two records (``diff``, ``verify --against``), ``received.py`` the wire
checksums a consumer received (``verify --received``), ``stored.py`` stored checksums of
offloaded blocks (``verify --stored``). Reports are written by ``kvaudit.formats`` and
``kvaudit.report``.
"""

from .model import NO_RECEIVED, DiffReport, GroupComparison, LocatedDifference, StaleSource
from .received import verify_received
from .record_diff import compare_records, verify_against_record
from .sides import AttentionWindow
from .stored import StoredCheck, stored_report, verify_stored_blocks

__all__ = [
    "NO_RECEIVED",
    "AttentionWindow",
    "DiffReport",
    "GroupComparison",
    "LocatedDifference",
    "StaleSource",
    "StoredCheck",
    "compare_records",
    "stored_report",
    "verify_against_record",
    "verify_received",
    "verify_stored_blocks",
]
