"""Where a command's result goes: JSON stamped under torchrun, tables on stdout's console
or as plain text in a file, files written whole or not at all, and the ``diff`` and
``verify`` report in its ``--format`` with its ``--json`` and ``--junit`` files."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from ..core.errors import KvauditError, printable
from ..distributed import is_writer, spread
from .options import ReportFormat

if TYPE_CHECKING:
    from rich.console import Console

    from ..compare import DiffReport
    from ..report import SideNames


@dataclass(frozen=True)
class ReportOutputs:
    """Where a ``diff`` or ``verify`` report goes: ``--format`` on stdout or ``-o``, and
    the ``--json`` and ``--junit`` files beside it."""

    output_format: ReportFormat
    output: str | None
    json_path: str | None
    junit_path: str | None


def warn(warnings: Sequence[str]) -> None:
    """Each warning of a report on stderr, one line each."""
    for warning in warnings:
        click.echo(f"kvaudit: warning: {printable(warning, newlines=False)}", err=True)


def emit_report(
    report: DiffReport, outputs: ReportOutputs, title: str, sides: SideNames, suite: str
) -> None:
    """Warn on stderr, write the ``--json`` and ``--junit`` files, then print or write
    the report in the chosen format. A reader of stdout that went away (``| head``)
    loses the rest of the output, not the verdict's exit status."""
    # Each format's writer imported only for its output: JSON imports no XML or rich.
    from ..formats import diff_to_json, json_text

    warn(report.warnings)
    if outputs.json_path is not None:
        emit(json_text(stamp(diff_to_json(report))) + "\n", outputs.json_path)
    if outputs.junit_path is not None:
        from ..formats import diff_junit

        emit(diff_junit(report, suite), outputs.junit_path)
    output = outputs.output
    if outputs.output_format == "json":
        emit(json_text(stamp(diff_to_json(report))) + "\n", output)
    elif outputs.output_format == "junit":
        from ..formats import diff_junit

        emit(diff_junit(report, suite), output)
    elif output is None:
        from ..report import make_console, print_diff

        def show() -> None:
            console = make_console()
            # rich exits with status 1 on a closed pipe; the verdict decides the status.
            console.on_broken_pipe = _raise_broken_pipe  # type: ignore[method-assign]
            print_diff(console, report=report, title=title, sides=sides)

        _to_stdout(show)
    else:
        from ..report import print_diff

        emit_table(functools.partial(print_diff, report=report, title=title, sides=sides), output)


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
    if not spread():
        return data
    from ..distributed.commands import stamped

    return stamped(data)


def emit_table(render: Callable[[Console], None], output: str | None) -> None:
    """Print tables on stdout's console, or write them as plain text to ``output``."""
    if not is_writer():
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
    if not is_writer():
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
