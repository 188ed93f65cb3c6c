"""The options several commands share (``-c``, ``--device``, ``-q``, ``--format``,
``-o``, ``--request``, the report options of ``diff`` and ``verify``) and the exit-status
epilogs of their help."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import click

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

DEVICES = ("auto", "cpu", "cuda")
EXIT_HELP = (
    "Exit status: 0 success; 1 the set is incomplete (a worker is missing, the checksums "
    "are partial); 2 bad usage or bad input; 3 an internal error; 130 interrupted."
)
DIFF_EXIT_HELP = (
    "Exit status: 0 every compared block matched and nothing was left unverified; 1 a "
    "block, replica or request differs or is missing, or a group could not be verified; "
    "2 bad usage or bad input; 3 an internal error; 130 interrupted."
)
CORRUPT_EXIT_HELP = (
    "Exit status: 0 the fault was planted; 2 bad usage or bad input; 3 an internal error; "
    "130 interrupted."
)
InventoryFormat = Literal["table", "json"]
RecordFormat = Literal["table", "json", "csv"]
ReportFormat = Literal["table", "json", "junit"]
PlantedFormat = Literal["text", "json"]
REPORT_FORMATS: tuple[ReportFormat, ...] = get_args(ReportFormat)


def common_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``-c/--config``, ``--device`` and ``-q/--quiet``, which every command takes."""
    command = click.option(
        "-q", "--quiet", is_flag=True, help="No progress bar and no notes on stderr."
    )(command)
    command = click.option(
        "--device",
        type=click.Choice(DEVICES),
        default=None,
        help="Where to checksum: auto (CUDA and the Triton kernel where available, "
        "else the CPU) [default: auto].",
    )(command)
    return click.option(
        "-c",
        "--config",
        "config_path",
        metavar="FILE",
        default=None,
        help="Cache description (YAML); supplies or overrides the dumps' own.",
    )(command)


def format_option(choices: Sequence[str], help_text: str) -> Decorator:
    """``--format`` among ``choices``, the first the default."""
    return click.option(
        "--format",
        "output_format",
        type=click.Choice(choices),
        default=choices[0],
        show_default=True,
        help=help_text,
    )


def output_option() -> Decorator:
    """``-o/--output FILE``, written atomically instead of stdout."""
    return click.option(
        "-o",
        "--output",
        metavar="FILE",
        default=None,
        help="Write to FILE (atomically) instead of stdout.",
    )


def request_option(help_text: str) -> Decorator:
    """``--request ID``, repeatable."""
    return click.option("--request", "request_ids", metavar="ID", multiple=True, help=help_text)


def report_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--format table|json|junit``, ``-o FILE``, ``--json FILE``, ``--junit FILE``,
    ``--name NAME``, ``--all``, ``--allow-missing``, ``--allow-empty`` and
    ``--seed-lane-only`` of ``diff`` and ``verify``."""
    command = click.option(
        "--seed-lane-only",
        is_flag=True,
        help="Compare by the seed lane of the checksum alone, not also by the strong lane "
        "(to compare with the seed engine's records; misses faults only the strong lane "
        "sees, docs/checksum.md).",
    )(command)
    command = click.option(
        "--all",
        "all_located",
        is_flag=True,
        help="List every located difference in the table, also those the diagnosis "
        "already names (default: those it names are left out, at most 40 rows a group).",
    )(command)
    command = click.option(
        "--allow-empty",
        is_flag=True,
        help="Accept a run in which nothing was compared (exit 0 if nothing differs).",
    )(command)
    command = click.option(
        "--allow-missing",
        is_flag=True,
        help="Accept positions the producer holds that the consumer lacks (a prefix-cache "
        "hit, a transfer of some blocks).",
    )(command)
    command = click.option(
        "--name",
        "report_name",
        metavar="NAME",
        default=None,
        help="Name the JUnit suite and test cases (default: after the sides, such as "
        "prefill->decode), so that the reports of several engines stay apart in one CI view.",
    )(command)
    command = click.option(
        "--junit",
        "junit_path",
        metavar="FILE",
        default=None,
        help="Also write the JUnit XML report to FILE (atomically).",
    )(command)
    command = click.option(
        "--json",
        "json_path",
        metavar="FILE",
        default=None,
        help="Also write the JSON report to FILE (atomically).",
    )(command)
    command = output_option()(command)
    return format_option(
        REPORT_FORMATS, "Output format: rich tables, the diff report JSON, or JUnit XML."
    )(command)
