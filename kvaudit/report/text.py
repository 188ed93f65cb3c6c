"""What every table of the command line shares: the console, plain text for files, and
the small formatting helpers (ranges of positions, byte counts, plurals)."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

from ..core.errors import printable
from ..core.ranges import ranges as ranges  # the tables' ranges, kept importable here
from ..records import WorkerInfo

PLAIN_WIDTH = 160
"""Columns of table output written to a file or a pipe (rich's default there is 80)."""
# Names print as they are: no rich markup ("[b]"), emoji codes (":x:") or highlighting.
_LITERAL = {"markup": False, "emoji": False, "highlight": False}


class SafeConsole(Console):
    """A console that shows control characters (ESC, OSC, C0, C1, DEL) and lone surrogates
    in what it prints as ``\\xNN`` escapes, so that a name in a dump or a record cannot
    move the cursor, retitle the window or clear the screen; rich's own styling is kept.

    Strings are escaped before rich measures them (``render_str``), and so are texts
    given to ``print`` and a ``SafeTable``'s cells, so that columns keep their widths;
    ``render`` escapes every other piece of text on its way out (a ``Text`` built
    elsewhere inside a renderable), after it was measured.
    """

    def render_str(self, text: str, **options: Any) -> Text:  # type: ignore[override]
        return super().render_str(printable(text), **options)

    def print(self, *objects: Any, **options: Any) -> None:  # type: ignore[override]
        super().print(*(_escaped(item) for item in objects), **options)

    def render(
        self, renderable: RenderableType, options: ConsoleOptions | None = None
    ) -> Iterable[Segment]:
        # Nested renderables come back through here too: printable() leaves text it has
        # escaped as it is, so escaping a piece again changes nothing.
        for segment in super().render(renderable, options):
            if segment.control:
                yield segment
            else:
                yield Segment(printable(segment.text), segment.style)


class SafeTable(Table):
    """A rich table whose title, column headers and cells have control characters escaped
    as they are given (before rich measures them), for a ``SafeConsole``."""

    def __init__(self, *headers: Any, title: Any = None, **options: Any) -> None:
        super().__init__(*headers, title=_escaped(title), **options)

    def add_column(self, header: Any = "", *args: Any, **options: Any) -> None:
        super().add_column(_escaped(header), *args, **options)

    def add_row(self, *renderables: Any, **options: Any) -> None:
        super().add_row(*(_escaped(item) for item in renderables), **options)


def _escaped(item: Any) -> Any:
    """A string or text with control characters escaped (a text keeps its style and
    justification); anything else as it is."""
    if isinstance(item, str):
        return printable(item)
    if isinstance(item, Text):
        if printable(item.plain) == item.plain:
            return item
        return Text(printable(item.plain), style=item.style, justify=item.justify)
    return item


def make_console() -> Console:
    """A console on stdout: plain and wide when stdout is not a terminal."""
    console = SafeConsole(**_LITERAL)
    if not console.is_terminal:
        console = SafeConsole(width=PLAIN_WIDTH, color_system=None, **_LITERAL)
    return console


LONG_TABLE_ROWS = 2000
"""A table of more rows than this (a long request's checksums: a row per block) is drawn
as plain text on any console: no colours, and lines as long as the table is wide (a
terminal narrower than the table wraps them itself). Rich lays out such a table in
seconds to minutes; the plain lines take a fraction of a second per 100,000 rows."""


def print_table(console: Console, table: Table) -> None:
    """Print a table as ``console.print(table)`` does, plain tables faster.

    A plain table (no colours) of one-line cells that fits is drawn line by line, as
    rich would draw it, in a fraction of the time (a dump's checksums are thousands of
    rows). A table of more than ``LONG_TABLE_ROWS`` rows of such cells is drawn that way
    on any console, colours or not, its lines never wrapped.

    Why not rich alone: rich measures, wraps and pads every cell through its renderer,
    about 0.7 ms a row here (1.5 s for 2,000 rows of 4 columns, 16 s for 20,000; the line
    by line drawing 0.014 s and 0.18 s), and has no faster path for a table whose cells
    need none of that. The lines are drawn from rich's public API only: the table's
    columns and cells (``Table.columns``, ``Column.cells``) and its box's own lines
    (``Box.substitute``, ``get_top``, ``get_row``, ``get_bottom`` and the box's characters);
    ``tests/report/test_plain_tables.py`` checks them against rich's drawing of random tables.

    Args:
        console: Where the table is printed.
        table: The table drawn.

    """
    long = table.row_count > LONG_TABLE_ROWS
    plain = console.color_system is None or long
    lines = _plain_lines(console, table, fit=not long) if plain else None
    if lines is None:
        console.print(table)
    else:
        # One piece of text, not cropped: rich splits what it crops line by line, each
        # split copying the rest of the text, which takes time the square of its length.
        console.print(Segments([Segment("\n".join(lines) + "\n")]), crop=False)


def _plain_cell(cell: object) -> str | None:
    """A cell's text when rich would draw it as it is: printable ASCII, one line, no
    surrounding blanks (wrapping, escaping and wide characters are left to rich)."""
    text = cell.plain if isinstance(cell, Text) else cell
    if not isinstance(text, str) or not (text.isascii() and text.isprintable()):
        return None
    return text if text == text.strip() else None


def _plain_lines(console: Console, table: Table, fit: bool = True) -> list[str] | None:
    """The lines rich draws for ``table`` when it is a plain one (the defaults: a header,
    edges, one space of padding, left or right justified columns of free width, no title
    or footer) that fits the console (or, not ``fit``, however wide it is); None for any
    other table."""
    columns = table.columns
    if not (
        columns
        and table.box is not None
        and table.show_header
        and table.show_edge
        and table.pad_edge
        and table.padding == (0, 1, 0, 1)
        and not (table.show_footer or table.show_lines or table.collapse_padding)
        and not (table.expand or table.leading or table.row_styles)
        and not (table.title or table.caption)
        and table.width is None
        and table.min_width is None
        and not any(row.end_section for row in table.rows)
        and all(
            column.justify in ("left", "right")
            and column.width is None
            and column.min_width is None
            and column.max_width is None
            and column.ratio is None
            for column in columns
        )
    ):
        return None
    texts = []
    for column in columns:
        cells = [_plain_cell(column.header), *(_plain_cell(cell) for cell in column.cells)]
        if any(cell is None for cell in cells):
            return None
        texts.append(cells)
    widths = [max(map(len, cells)) + 2 for cells in texts]
    if fit and sum(widths) + len(widths) + 1 > console.width:
        return None
    safe = console.safe_box if table.safe_box is None else table.safe_box
    box = table.box.substitute(console.options, safe=safe)
    rows = list(zip(*texts))
    lines = [box.get_top(widths)]
    for index, row in enumerate(rows):
        if index == 0:
            left, divider, right = box.head_left, box.head_vertical, box.head_right
        elif index == len(rows) - 1:
            left, divider, right = box.foot_left, box.foot_vertical, box.foot_right
        else:
            left, divider, right = box.mid_left, box.mid_vertical, box.mid_right
        cells = [
            f" {text.rjust(width - 2) if column.justify == 'right' else text.ljust(width - 2)} "
            for text, width, column in zip(row, widths, columns)
        ]
        lines.append(left + divider.join(cells) + right)
        if index == 0:
            lines.append(box.get_row(widths, "head", edge=True))
    lines.append(box.get_bottom(widths))
    return lines


def render_text(render: Callable[..., None], *args: object) -> str:
    """What ``render(console, *args)`` prints, as plain text."""
    buffer = io.StringIO()
    console = SafeConsole(file=buffer, width=PLAIN_WIDTH, color_system=None, **_LITERAL)
    render(console, *args)
    return buffer.getvalue()


def human_bytes(count: int) -> str:
    """A byte count in B, KiB, MiB or GiB."""
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def plural(count: int, noun: str) -> str:
    """``1 block``, ``2 blocks``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def worker_name(worker: WorkerInfo) -> str:
    """A worker in a table: its source, else its ranks."""
    return worker.source or f"pp{worker.pp_rank} tp{worker.tp_rank}"


def layout_line(workers: list[WorkerInfo]) -> str:
    """``2 workers of TP 2 x PP 1``."""
    first = workers[0]
    return f"{plural(len(workers), 'worker')} of TP {first.tp_size} x PP {first.pp_size}"


def completeness(complete: bool) -> tuple[str, str]:
    """A set's ``complete`` or ``INCOMPLETE``, with its style."""
    return ("complete", "bold green") if complete else ("INCOMPLETE", "bold red")


def missing_workers_text(missing: list[tuple[int, int]]) -> str:
    """Missing workers as ``pp_rank 0 tp_rank 2, ...``."""
    return ", ".join(f"pp_rank {pp} tp_rank {tp}" for pp, tp in missing)


def print_missing(console: Console, missing: list[tuple[int, int]], consequence: str) -> None:
    """Print the red line that names an incomplete set's missing workers.

    Args:
        console: Where the line is printed.
        missing: The ``(pp_rank, tp_rank)`` of the missing workers.
        consequence: What the line says follows from them.

    """
    console.print(
        Text(f"missing workers: {missing_workers_text(missing)}; {consequence}", style="red")
    )


def filled_table(title: str, columns: Sequence[str], rows: list[list[str | Text]]) -> Table:
    """A table of ``rows``, leaving out the columns no row fills (a record keeps less
    than a dump); a column name starting with ``>`` is right-justified."""
    filled = [k for k in range(len(columns)) if any(str(row[k]) for row in rows)]
    table = SafeTable(title=title, title_justify="left")
    for k in filled:
        name = columns[k]
        table.add_column(name.lstrip(">"), justify="right" if name.startswith(">") else "left")
    for row in rows:
        table.add_row(*(row[k] for k in filled))
    return table


def error_text(value: float) -> str:
    """A located error for a table: 4 significant digits, ``inf`` or ``nan``."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    return f"{value:.4g}"
