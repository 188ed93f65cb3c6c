"""Where a command's result goes: JSON stamped under torchrun, tables on stdout's console
or as plain text in a file, files written whole or not at all, and the ``diff`` and
``verify`` report (bitwise or by value) in its ``--format`` with its ``--json``, ``--junit``
and ``--html`` files: one pipeline for every report."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from ..core.errors import KvauditError, printable
from ..distributed.processes import processes
from .options import ReportFormat

if TYPE_CHECKING:
    from rich.console import Console

    from ..compare import DiffReport
    from ..numeric import NumericReport
    from ..report import SideNames


@dataclass(frozen=True)
class ReportOutputs:
    """Where a report goes: ``--format`` on stdout or ``-o``, and the ``--json``,
    ``--junit`` and ``--html`` files beside it."""

    output_format: ReportFormat
    output: str | None = None
    json_path: str | None = None
    junit_path: str | None = None
    html_path: str | None = None


@dataclass(frozen=True)
class ReportForms:
    """One report in each of its forms, each made only when an output asks for it: its
    JSON data, its tables, its JUnit XML (None: it has none) and its HTML page."""

    warnings: Sequence[str]
    json: Callable[[], dict[str, Any]]
    table: Callable[[Console], None]
    junit: Callable[[], str] | None
    html: Callable[[], str]


def warn(warnings: Sequence[str]) -> None:
    """Each warning of a report on stderr, one line each."""
    for warning in warnings:
        click.echo(f"kvaudit: warning: {printable(warning, newlines=False)}", err=True)


def report_name(*sides: Sequence[str]) -> str:
    """What a report compares, after its sides' names: ``prefill->decode`` for the
    folders ``dumps/prefill`` and ``live:/run/kvaudit/decode`` (a side of several names:
    its first and how many more)."""
    words = []
    for names in sides:
        first = names[0].removeprefix("live:").removeprefix("py:").rstrip("/")
        stem = os.path.basename(first) or first
        for suffix in (".safetensors", ".json"):
            stem = stem.removesuffix(suffix)
        words.append(stem + (f"+{len(names) - 1}" if len(names) > 1 else ""))
    return "->".join(words)


def diff_forms(
    report: DiffReport,
    title: str,
    sides: SideNames,
    suite: tuple[str, str],
    all_located: bool = False,
) -> ReportForms:
    """The forms of a ``diff`` or ``verify`` report (``suite``: its JUnit suite's name and
    the name of what it compares, ``report_name``; ``all_located``: the table lists every
    located difference)."""

    # Each form's writer is imported only for its output: JSON imports no XML or rich.
    def json() -> dict[str, Any]:
        from ..formats import diff_to_json

        return diff_to_json(report)

    def table(console: Console) -> None:
        from ..report import print_diff

        rows = "all" if all_located else "unexplained"
        print_diff(console, report=report, title=title, sides=sides, located_rows=rows)

    def junit() -> str:
        from ..formats import diff_junit

        return diff_junit(report, *suite)

    def html() -> str:
        from ..formats.html import diff_html

        return diff_html(report, title)

    return ReportForms(report.warnings, json, table, junit, html)


def numeric_forms(report: NumericReport, title: str, names: tuple[str, str]) -> ReportForms:
    """The forms of a ``diff --numeric`` report (``names``: its sides described); it has
    no JUnit form."""

    def json() -> dict[str, Any]:
        from ..formats.numeric import numeric_to_json

        return numeric_to_json(report, *names)

    def table(console: Console) -> None:
        from ..report.numeric import print_numeric

        print_numeric(console, report=report, title=title)

    def html() -> str:
        from ..formats.html import numeric_html

        return numeric_html(report, title)

    return ReportForms(report.warnings, json, table, None, html)


def emit_report(forms: ReportForms, outputs: ReportOutputs) -> None:
    """Warn on stderr, write the ``--json``, ``--junit`` and ``--html`` files, then print
    or write the report in the chosen format: every report the same way. A reader of
    stdout that went away (``| head``) loses the rest of the output, not the verdict's
    exit status.

    Raises:
        click.UsageError: JUnit asked of a report that has no JUnit form.

    """
    from ..formats import json_text

    if forms.junit is None and (outputs.output_format == "junit" or outputs.junit_path):
        raise click.UsageError("this report is written as a table, JSON or HTML, not JUnit")
    warn(forms.warnings)
    if outputs.json_path is not None:
        emit(json_text(stamp(forms.json())) + "\n", outputs.json_path)
    if outputs.junit_path is not None and forms.junit is not None:
        emit(forms.junit(), outputs.junit_path)
    if outputs.html_path is not None:
        emit(forms.html(), outputs.html_path)
    if outputs.output_format == "json":
        emit(json_text(stamp(forms.json())) + "\n", outputs.output)
    elif outputs.output_format == "junit" and forms.junit is not None:
        emit(forms.junit(), outputs.output)
    else:
        emit_table(forms.table, outputs.output)


def _to_stdout(write: Callable[[], None]) -> None:
    """Run ``write``, which prints on stdout: a reader that went away (``| head``) loses
    the rest of the output, not the command's exit status."""
    try:
        write()
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so that flushing it at exit raises nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as error:
        # A full disk or device behind stdout: the output could not be written (bad
        # usage of the environment, exit 2), not a bug; nothing more goes there.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise KvauditError(f"cannot write: {error.strerror or error}", "stdout") from None


def _raise_broken_pipe() -> None:
    """A console's reaction to a closed pipe: raise, so that the caller decides."""
    raise BrokenPipeError


def stamp(data: dict[str, Any]) -> dict[str, Any]:
    """A result's JSON, with ``"processes"`` when several processes computed it."""
    return processes().stamp(data)


def emit_table(render: Callable[[Console], None], output: str | None) -> None:
    """Print tables on stdout's console, or write them as plain text to ``output``."""
    if not processes().writes:
        return
    from ..report import make_console, render_text

    if output is None:
        console = make_console()
        # rich exits with status 1 on a closed pipe; the command decides the status.
        console.on_broken_pipe = _raise_broken_pipe  # type: ignore[method-assign]
        _to_stdout(lambda: render(console))
    else:
        emit(render_text(render), output)


def emit(text: str, output: str | None) -> None:
    """Print ``text``, or write it to ``output`` whole or not at all (under torchrun,
    rank 0 only)."""
    if not processes().writes:
        return
    from ..core.files import atomic_path

    if output is None:
        _to_stdout(lambda: click.echo(text, nl=False))
        return
    with (
        atomic_path(output) as temporary,
        open(temporary, "x", encoding="utf-8", errors="backslashreplace", newline="") as handle,
    ):
        handle.write(text)
