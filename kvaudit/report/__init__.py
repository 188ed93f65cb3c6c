"""What the command line shows people: rich tables of an inventory (``inventory.py``), a
record (``record.py``), a diff report (``diff.py``) and a planted fault (``planted.py``),
with the console and helpers they share (``text.py``) and the names of a report's sides
(``sides.py``). Machine forms are in ``kvaudit.formats``. Each name is imported on first
use: rich only for a table."""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("LOCATED_ROWS", "diff_verdict", "print_diff"), ".diff"),
    "print_inventory": ".inventory",
    "print_corrupted": ".planted",
    "print_record": ".record",
    **dict.fromkeys(("DIFF_SIDE_NAMES", "SideNames"), ".side_names"),
    **dict.fromkeys(
        (
            "PLAIN_WIDTH",
            "error_text",
            "human_bytes",
            "make_console",
            "missing_workers_text",
            "ranges",
            "render_text",
        ),
        ".text",
    ),
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
