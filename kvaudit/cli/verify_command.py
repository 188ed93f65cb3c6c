"""``kvaudit verify``: a dump set (or record) checked one way: against a saved record,
the producer checksums it received, or the stored checksums of its offloaded blocks."""

from __future__ import annotations

import click

from ..core.exit_status import ExitStatus
from ..distributed.processes import processes
from .arguments import check_outputs, load_config, open_sources, wanted_ids
from .group import main
from .options import DIFF_EXIT_HELP, ReportFormat, common_options, report_options, request_option
from .output import ReportOutputs, diff_forms, emit_report
from .output import report_name as default_name


@main.command(epilog=DIFF_EXIT_HELP)
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@click.option(
    "--against",
    metavar="RECORD",
    default=None,
    help="Check against a saved record (a regression check): every block must match it.",
)
@click.option(
    "--received",
    is_flag=True,
    help="Check a consumer's dumps against the producer checksums they received.",
)
@click.option(
    "--stored",
    is_flag=True,
    help="Check the stored checksums of offloaded blocks against the blocks.",
)
@request_option("Verify only this request (repeatable); default all.")
@report_options
@common_options
def verify(
    sources: tuple[str, ...],
    against: str | None,
    received: bool,
    stored: bool,
    request_ids: tuple[str, ...],
    output_format: ReportFormat,
    output: str | None,
    json_path: str | None,
    junit_path: str | None,
    report_name: str | None,
    all_located: bool,
    allow_missing: bool,
    allow_empty: bool,
    seed_lane_only: bool,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Check a dump set (or record) one way: against a saved record (--against), the
    producer checksums its dumps received (--received), or the stored checksums of its
    offloaded blocks (--stored)."""
    from ..compare import CompareOptions, verify_work
    from ..report import SideNames
    from ..sources import resolve_device
    from .progress import progress_bar

    chosen = [
        name
        for name, given in (("--against", against), ("--received", received), ("--stored", stored))
        if given
    ]
    if len(chosen) != 1:
        found = " and ".join(chosen) if chosen else "none"
        raise click.UsageError(
            f"give exactly one of --against RECORD, --received or --stored (got {found})"
        )
    check_outputs(
        {"-o": output, "--json": json_path, "--junit": junit_path},
        [*sources, against, config_path],
    )
    runtime = resolve_device(device or "auto")
    source = open_sources(sources, load_config(config_path), device)
    saved = open_sources([against], None, device) if against is not None else None
    wanted = wanted_ids(request_ids)
    work = verify_work(source, against=saved, request_ids=wanted)
    with progress_bar(work, "verify", enabled=not quiet) as advance:
        options = CompareOptions(
            wanted, runtime, advance, allow_missing, allow_empty, seed_lane_only
        )
        report = processes().verify(
            source, options, against=saved, received=received, stored=stored
        )
    if saved is not None:
        sides = SideNames("saved record", "source")
        title = f"verify {source.describe()} against {saved.describe()}"
    elif received:
        sides = SideNames("received producer checksums", "consumer")
        title = f"verify {source.describe()} against the producer checksums it received"
    else:
        sides = SideNames("stored checksums", "dumps", "checked")
        title = f"verify the stored checksums of {source.describe()}"
    outputs = ReportOutputs(output_format, output, json_path, junit_path)
    suite = ("kvaudit.verify", report_name or default_name(source.names))
    emit_report(diff_forms(report, title, sides, suite, all_located), outputs)
    return ExitStatus.OK if report.ok else ExitStatus.MISMATCH
