"""Plain tables drawn line by line (``kvaudit.report.text.print_table``): the same text as
rich draws, for any table and console, checked against rich itself; and a dump's record
table, thousands of rows, drawn that way whenever its output has no colours."""

from __future__ import annotations

import io

import numpy as np
import pytest
import rich.segment
import rich.table
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.table import Table
from rich.text import Text

import kvaudit.report.record
import kvaudit.report.text
from kvaudit.records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    combine_workers,
)
from kvaudit.report import print_record, render_text
from kvaudit.report.text import SafeConsole, print_table

# Half the tables hold only cells rich draws as they are (words of printable ASCII); the
# others also cells it must wrap, pad or escape (blanks around, tabs, escapes, wide text).
WORDS = st.lists(st.text(alphabet="abcXYZ019:,.-'[]/", min_size=1, max_size=6), max_size=3)
PLAIN = WORDS.map(" ".join)
ANY = PLAIN | st.text(alphabet=" ab1\t\x1bé漢", max_size=6)
JUSTIFY = st.sampled_from(["left", "right"] * 4 + ["center"])


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[tuple[str, str]], list[list[tuple[str, bool]]]]:
    """A table's columns (header, justify) and rows (text, whether a bold ``Text``)."""
    cell = PLAIN if draw(st.booleans()) else ANY
    width = draw(st.integers(1, 6))
    columns = [(draw(cell), draw(JUSTIFY)) for _ in range(width)]
    rows = draw(st.lists(st.lists(st.tuples(cell, st.booleans()), min_size=width,
                                  max_size=width), max_size=6))  # fmt: skip
    return columns, rows


def build(columns: list[tuple[str, str]], rows: list[list[tuple[str, bool]]]) -> Table:
    table = Table()
    for header, justify in columns:
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*(Text(text, style="bold") if bold else text for text, bold in row))
    return table


def drawn(draw: str, spec: tuple, width: int, encoding: str) -> str:
    """What a plain console of ``width`` columns writing ``encoding`` prints."""
    raw = io.BytesIO()
    file = io.TextIOWrapper(raw, encoding=encoding, errors="replace", newline="")
    console = SafeConsole(
        file=file, width=width, color_system=None, markup=False, emoji=False, highlight=False
    )
    table = build(*spec)
    if draw == "rich":
        console.print(table)
    else:
        print_table(console, table)
    file.flush()
    return raw.getvalue().decode(encoding)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(spec=tables(), width=st.sampled_from([12, 40, 80, 160]), encoding=st.sampled_from(
    ["utf-8", "ascii"]))  # fmt: skip
def test_plain_tables_are_drawn_as_rich_draws_them(spec: tuple, width: int, encoding: str) -> None:
    assert drawn("ours", spec, width, encoding) == drawn("rich", spec, width, encoding)


def big_record(positions: int, keys: int) -> Record:
    """One worker's record of one request: ``positions`` rows of ``keys`` replica keys."""
    rng = np.random.default_rng(keys)
    values = rng.integers(0, 2**63, (positions, keys), dtype=np.uint64) * np.uint64(2)
    replica_keys = [(keys, index) for index in range(keys)]
    group = GroupChecksums(16, 0, replica_keys, values, 0xAB)
    worker = WorkerInfo(0, 1, 0, 1, "producer", "p", "rank0.safetensors")
    requests = {"req": RequestChecksums(positions * 16 - 3, {0: group})}
    return combine_workers([WorkerRecord(worker, "request", {0: 0xAB}, {}, requests)])


def refused(*args: object, **kwargs: object) -> None:
    raise AssertionError("rich drew the table")


@pytest.mark.parametrize("keys", [1, 3, 8])
def test_a_records_table_is_drawn_line_by_line_when_plain(
    keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = big_record(1024, keys)
    with monkeypatch.context() as patch:
        patch.setattr(
            kvaudit.report.record, "print_table", lambda console, table: console.print(table)
        )
        by_rich = render_text(print_record, record)
    fits = keys < 8  # 8 keys are wider than a file's 160 columns: rich wraps them
    if fits:
        monkeypatch.setattr(rich.table.Table, "__rich_console__", refused)
    text = render_text(print_record, record)
    assert text == by_rich
    if fits:
        group = record.requests["req"].groups[0]
        values, totals = group.values.tolist(), group.totals().tolist()
        rows = [line for line in text.splitlines() if line.startswith("│")]
        assert [row.split("│")[1:-1] for row in rows] == [
            [f" {position:>8} ", f" {16 if position < 1023 else 13:>6} "]
            + [f" {value:016x} " for value in (*values[position], totals[position])]
            for position in range(1024)
        ]


def test_a_terminal_with_colours_gets_riches_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rich.table.Table, "__rich_console__", refused)
    console = SafeConsole(file=io.StringIO(), force_terminal=True, color_system="standard")
    with pytest.raises(AssertionError, match="rich drew the table"):
        print_table(console, build([("a", "left")], [[("1", True)]]))


def table_lines(text: str) -> list[str]:
    """The lines of the tables in ``text`` (the lines around them left out)."""
    return [line for line in text.splitlines() if line[:1] in set("┏┃┡│└")]


def by_rich(record: Record, width: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """The record's tables as rich draws them on a plain console of ``width`` columns."""
    buffer = io.StringIO()
    console = SafeConsole(
        file=buffer, width=width, color_system=None, markup=False, emoji=False, highlight=False
    )
    with monkeypatch.context() as patch:
        patch.setattr(
            kvaudit.report.record, "print_table", lambda console, table: console.print(table)
        )
        print_record(console, record)
    return buffer.getvalue()


@pytest.mark.parametrize(("keys", "terminal"), [(3, True), (8, False), (8, True)])
def test_a_long_table_is_plain_text_on_any_console(
    keys: int, terminal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``LONG_TABLE_ROWS`` rows, a table is drawn line by line on a colour terminal
    too, and a table wider than the console is not wrapped: each line is the one rich
    draws on a console wide enough for it."""
    record = big_record(kvaudit.report.text.LONG_TABLE_ROWS + 1, keys)
    wide = by_rich(record, 400, monkeypatch)
    monkeypatch.setattr(rich.table.Table, "__rich_console__", refused)
    buffer = io.StringIO()
    colours = {"force_terminal": True, "color_system": "truecolor"} if terminal else {}
    console = SafeConsole(file=buffer, width=80 if terminal else 160, **colours)  # type: ignore[arg-type]
    print_record(console, record)
    lines = table_lines(buffer.getvalue())
    assert len(lines) == kvaudit.report.text.LONG_TABLE_ROWS + 5
    assert max(map(len, lines)) > console.width
    assert lines == table_lines(wide)


def test_rich_never_splits_a_tables_text_line_by_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich splits what it crops line by line, copying the rest of the text at each line:
    the plain lines of a table go to it whole, uncropped, never through that split."""
    longest = [0]
    split = rich.segment.Segment.split_and_crop_lines

    def measured(segments, *args, **kwargs):  # type: ignore[no-untyped-def]
        segments = list(segments)
        longest[0] = max([longest[0], *(len(segment.text) for segment in segments)])
        return split(segments, *args, **kwargs)

    monkeypatch.setattr(rich.segment.Segment, "split_and_crop_lines", measured)
    text = render_text(print_record, big_record(1024, 3))
    assert len(text) > 100_000
    assert 0 < longest[0] < 200


def plain_console(buffer: io.StringIO, width: int = 80) -> SafeConsole:
    return SafeConsole(
        file=buffer, width=width, color_system=None, markup=False, emoji=False, highlight=False
    )


def test_a_safe_tables_escaped_cells_keep_their_columns() -> None:
    """A name with control characters, in a title, a header, a string and a styled text
    cell, is shown escaped, and every line of the table is as wide as the others."""
    hostile = "r\x1b]0;t\x9b\x7f"  # no BEL: rich's Text drops it on its own
    table = kvaudit.report.text.SafeTable(title=hostile)
    table.add_column(hostile)
    table.add_column("b", justify="right")
    table.add_row(hostile, Text(hostile, style="bold"))
    table.add_row("x", "y")
    buffer = io.StringIO()
    plain_console(buffer).print(table)
    text = buffer.getvalue()
    assert not any(c in text for c in "\x1b\x9b\x7f"), repr(text)
    shown = "r\\x1b]0;t\\x9b\\x7f"
    assert text.count(shown) == 4
    lines = table_lines(text)
    assert len({len(line) for line in lines}) == 1 and len(lines) == 6


def test_text_inside_another_renderable_is_escaped() -> None:
    """A text that reaches the console inside a renderable it does not unpack (a panel)
    is escaped on its way out, as any piece of text is."""
    from rich.panel import Panel

    buffer = io.StringIO()
    plain_console(buffer).print(Panel(Text("a\x1b[2Jb", style="red")))
    text = buffer.getvalue()
    assert "\x1b" not in text and "a\\x1b[2Jb" in text
