"""``kvaudit diff``: a producer's KV compared with a consumer's, by checksums (differing
blocks located) or, with ``--numeric``, by value."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from ..core.exit_status import ExitStatus
from ..distributed.processes import processes
from .arguments import check_outputs, load_config, open_sources, wanted_ids
from .group import main
from .options import DIFF_EXIT_HELP, ReportFormat, common_options, report_options, request_option
from .output import ReportOutputs, diff_forms, emit_report, numeric_forms
from .output import report_name as default_name

if TYPE_CHECKING:
    from ..sources import Source


def _finite(
    context: click.Context, parameter: click.Parameter, value: float | None
) -> float | None:
    """Refuse a tolerance that is NaN or infinite (FloatRange lets both through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def _numeric_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--numeric``, ``--atol``, ``--rtol`` and ``--html FILE`` of ``diff``."""
    command = click.option(
        "--html",
        "html_path",
        metavar="FILE",
        default=None,
        help="Also write a self-contained HTML report with heatmaps (docs/numeric.md).",
    )(command)
    for name, what in (("--rtol", "relative"), ("--atol", "absolute")):
        command = click.option(
            name,
            type=click.FloatRange(min=0.0),
            default=None,
            callback=_finite,
            help=f"With --numeric: the {what} tolerance [default: 0].",
        )(command)
    return click.option(
        "--numeric",
        is_flag=True,
        help="Compare element values in each layer's dtype: errors per request, layer and "
        "head; exit 1 when |consumer - producer| > atol + rtol |producer| anywhere.",
    )(command)


@main.command(epilog=DIFF_EXIT_HELP)
@click.argument("producer", metavar="PRODUCER")
@click.argument("consumer", metavar="CONSUMER")
@request_option("Compare only this request (repeatable); default all.")
@click.option(
    "--locate/--no-locate",
    default=None,
    help="Narrow each differing block down to layers, heads, tokens and bytes "
    "[default: when both sides hold the raw KV].",
)
@report_options
@click.option(
    "--producer-config",
    metavar="FILE",
    default=None,
    help="Cache description of the producer's dumps only (overrides -c there).",
)
@click.option(
    "--consumer-config",
    metavar="FILE",
    default=None,
    help="Cache description of the consumer's dumps only (overrides -c there).",
)
@_numeric_options
@common_options
def diff(
    producer: str,
    consumer: str,
    request_ids: tuple[str, ...],
    locate: bool | None,
    output_format: ReportFormat,
    output: str | None,
    json_path: str | None,
    junit_path: str | None,
    report_name: str | None,
    all_located: bool,
    allow_missing: bool,
    allow_empty: bool,
    seed_lane_only: bool,
    producer_config: str | None,
    consumer_config: str | None,
    config_path: str | None,
    device: str | None,
    quiet: bool,
    numeric: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    html_path: str | None = None,
) -> int:
    """Compare a producer's KV with a consumer's, request by request: PRODUCER and
    CONSUMER are each a dump file, a directory of one engine's dumps, a record (JSON) or a
    live handle. Differing blocks are located down to layers, heads, tokens and bytes."""
    from ..compare import CompareOptions, diff_work
    from ..report import DIFF_SIDE_NAMES
    from ..sources import resolve_device
    from .progress import progress_bar

    check_outputs(
        {"-o": output, "--json": json_path, "--junit": junit_path, "--html": html_path},
        [producer, consumer, producer_config, consumer_config, config_path],
    )
    runtime = resolve_device(device or "auto")
    config = functools.cache(load_config)  # -c serves both sides: read it once
    left = open_sources([producer], config(producer_config or config_path), device)
    right = open_sources([consumer], config(consumer_config or config_path), device)
    wanted = wanted_ids(request_ids)
    outputs = ReportOutputs(output_format, output, json_path, junit_path, html_path)
    if numeric:
        if junit_path is not None or output_format == "junit":
            raise click.UsageError("--numeric reports as table or JSON, not JUnit")
        if locate is not None:
            raise click.UsageError("--locate and --no-locate go without --numeric")
        if seed_lane_only:
            raise click.UsageError("--seed-lane-only goes without --numeric (it compares values)")
        tolerance = (atol or 0.0, rtol or 0.0)
        allowed = (allow_missing, allow_empty)
        return diff_numeric(left, right, wanted, tolerance, allowed, outputs, quiet)
    if atol is not None or rtol is not None:
        raise click.UsageError("--atol and --rtol go with --numeric")
    with progress_bar(diff_work(left, right, wanted), "diff", enabled=not quiet) as advance:
        options = CompareOptions(
            wanted, runtime, advance, allow_missing, allow_empty, seed_lane_only
        )
        report = processes().diff(left, right, options, locate)
    title = f"diff: producer {left.describe()}, consumer {right.describe()}"
    suite = ("kvaudit.diff", report_name or default_name(left.names, right.names))
    emit_report(diff_forms(report, title, DIFF_SIDE_NAMES, suite, all_located), outputs)
    return ExitStatus.OK if report.ok else ExitStatus.MISMATCH


def diff_numeric(
    left: Source,
    right: Source,
    wanted: list[str] | None,
    tolerance: tuple[float, float],
    allowed: tuple[bool, bool],
    outputs: ReportOutputs,
    quiet: bool,
) -> int:
    """``diff --numeric``: compare by value, print or write the report, the exit status;
    ``allowed``: --allow-missing and --allow-empty."""
    from ..compare import CompareOptions, diff_work
    from ..numeric import numeric_sources
    from .progress import progress_bar

    atol, rtol = tolerance
    with progress_bar(diff_work(left, right, wanted), "diff", enabled=not quiet) as advance:
        options = CompareOptions(wanted, None, advance, *allowed)
        report = numeric_sources(left, right, options, atol=atol, rtol=rtol)
    title = f"diff --numeric: producer {left.describe()}, consumer {right.describe()}"
    emit_report(numeric_forms(report, title, (left.describe(), right.describe())), outputs)
    return ExitStatus.OK if report.ok else ExitStatus.MISMATCH
