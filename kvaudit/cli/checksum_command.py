"""``kvaudit checksum``: per-block checksums summed over the workers, a record."""

from __future__ import annotations

import functools
from typing import get_args

import click

from ..core.errors import printable
from ..core.exit_status import ExitStatus
from ..core.validation import POSITION_NUMBERINGS
from .arguments import check_outputs, load_config, open_sources, wanted_ids
from .group import main
from .options import (
    EXIT_HELP,
    RecordFormat,
    common_options,
    format_option,
    output_option,
    request_option,
)
from .output import emit, emit_table, stamp, warn


@main.command(epilog=EXIT_HELP)
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@request_option("Checksum only this request (repeatable); default all.")
@click.option(
    "--positions",
    type=click.Choice(POSITION_NUMBERINGS),
    default=None,
    help="Number pieces from the request's first token, or from each block's "
    "[default: request; a record keeps its own].",
)
@format_option(get_args(RecordFormat), "Output format.")
@output_option()
@common_options
def checksum(
    sources: tuple[str, ...],
    request_ids: tuple[str, ...],
    positions: str | None,
    output_format: RecordFormat,
    output: str | None,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Per-block checksums summed over the workers: per request, group and position, per
    replica key, and the total."""
    from ..sources import RecordQuery, resolve_device
    from .progress import progress_bar

    check_outputs({"-o": output}, [*sources, config_path])
    runtime = resolve_device(device or "auto")
    source = open_sources(sources, load_config(config_path), device)
    warn(source.warnings)
    wanted = wanted_ids(request_ids)
    if wanted is not None:
        source.check_request_ids(wanted)
    with progress_bar(source.work(wanted), "checksum", enabled=not quiet) as advance:
        record = source.checksum(RecordQuery(runtime, wanted, positions, advance))
    # Each format's writer imported only for its output.
    if output_format == "json":
        from ..formats import json_text, record_to_json

        emit(json_text(stamp(record_to_json(record))) + "\n", output)
    elif output_format == "csv":
        from ..formats import record_csv

        emit(record_csv(record), output)
    else:
        from ..report import print_record

        emit_table(functools.partial(print_record, record=record), output)
    partial = record.partial_groups()
    if not quiet:
        for request_id, gid, why in partial:
            click.echo(
                f"kvaudit: request {printable(request_id, newlines=False)} group {gid}: "
                f"partial sums: {printable(why, newlines=False)}",
                err=True,
            )
    if record.complete:
        return ExitStatus.INCOMPLETE if partial else ExitStatus.OK
    if output_format != "table" and not quiet:
        from ..report import missing_workers_text

        click.echo(
            f"kvaudit: incomplete set, missing workers "
            f"{missing_workers_text(record.missing_workers)}: checksums are partial",
            err=True,
        )
    return ExitStatus.INCOMPLETE
