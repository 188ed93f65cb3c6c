"""What the command line shows people: rich tables of an inventory (``inventory.py``), a
record (``record.py``), a diff report (``diff.py``) and a planted fault (``planted.py``),
with the console and helpers they share (``text.py``). Machine forms are in
``kvaudit.formats``."""

from .diff import DIFF_SIDES, LOCATED_ROWS, Sides, diff_verdict, print_diff
from .inventory import print_inventory
from .planted import print_corrupted
from .record import print_record
from .text import (
    PLAIN_WIDTH,
    error_text,
    human_bytes,
    make_console,
    missing_workers_text,
    ranges,
    render_text,
)

__all__ = [
    "DIFF_SIDES",
    "LOCATED_ROWS",
    "PLAIN_WIDTH",
    "Sides",
    "diff_verdict",
    "error_text",
    "human_bytes",
    "make_console",
    "missing_workers_text",
    "print_corrupted",
    "print_diff",
    "print_inventory",
    "print_record",
    "ranges",
    "render_text",
]
