"""The ``kvaudit`` command: inspect dump sets and checksum them (docs/cli.md).

Exit status: 0 success; 1 when the set is incomplete (a worker is missing, so some
checksums are partial); 2 on bad usage or bad input, reported as one line
``kvaudit: error: <message>`` on stderr.
"""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from .description import CacheDescription, load_description
from .errors import KvauditError
from .records import POSITION_NUMBERINGS, Record
from .report import (
    inventory_to_json,
    json_text,
    make_console,
    print_inventory,
    print_record,
    progress_bar,
    record_csv,
    render_text,
)
from .sources import Runtime, Source, open_source, resolve_device

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_BAD_INPUT = 2
DEVICES = ("auto", "cpu", "cuda")
EXIT_HELP = (
    "Exit status: 0 success; 1 the set is incomplete (a worker is missing, the checksums "
    "are partial); 2 bad usage or bad input."
)
# click >= 8.2 raises this for a bare `kvaudit`; its message is the help text.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class KvauditGroup(click.Group):
    """A click group that reports errors as one line and returns each command's status."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            status = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except KvauditError as error:
            status = _fail(str(error))
        except _NO_ARGS_IS_HELP as error:
            click.echo(error.format_message())
            status = EXIT_BAD_INPUT
        except click.UsageError as error:
            hint = f" (try '{error.ctx.command_path} --help')" if error.ctx is not None else ""
            status = _fail(error.format_message() + hint)
        except click.ClickException as error:
            status = _fail(error.format_message())
        except click.Abort:
            click.echo("kvaudit: aborted", err=True)
            status = 130
        except BrokenPipeError:
            # The reader of our output went away (`kvaudit checksum ... | head`): point
            # stdout at /dev/null so that flushing it at exit raises nothing more.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            status = EXIT_INCOMPLETE
        if not standalone_mode:
            return status
        sys.exit(status if isinstance(status, int) else EXIT_OK)


def _version() -> str:
    """The installed distribution's version, else the package's own."""
    try:
        return importlib.metadata.version("kvaudit")
    except importlib.metadata.PackageNotFoundError:
        from . import __version__

        return __version__


def _fail(message: str) -> int:
    click.echo(f"kvaudit: error: {' '.join(message.split())}", err=True)
    return EXIT_BAD_INPUT


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


@click.group(cls=KvauditGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", prog_name="kvaudit")
def main() -> None:
    """Audit LLM KV caches: per-block checksums that add up across tensor-parallel ranks
    and pipeline stages and ignore block ids and memory layout.

    A SOURCE is a dump file, a directory of dump files (one engine's workers), a record
    (the JSON of `checksum --format json`) or a live handle (live:PATH).
    """


@main.command(epilog=EXIT_HELP)
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(("table", "json")),
    default="table",
    show_default=True,
    help="Output format.",
)
@common_options
def inspect(
    sources: tuple[str, ...],
    output_format: str,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Show what a dump set holds: workers, groups, coverage, fingerprints, requests."""
    resolve_device(device or "auto")  # rejects --device cuda without CUDA, as everywhere
    inventory = _open(sources, config_path, device).inventory()
    if output_format == "json":
        click.echo(json_text(inventory_to_json(inventory)))
    else:
        print_inventory(make_console(), inventory)
    if not inventory.complete:
        return EXIT_INCOMPLETE
    return EXIT_OK


@main.command(epilog=EXIT_HELP)
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@click.option(
    "--request",
    "request_ids",
    metavar="ID",
    multiple=True,
    help="Checksum only this request (repeatable); default all.",
)
@click.option(
    "--positions",
    type=click.Choice(POSITION_NUMBERINGS),
    default=None,
    help="Number pieces from the request's first token, or from each block's "
    "[default: request; a record keeps its own].",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(("table", "json", "csv")),
    default="table",
    show_default=True,
    help="Output format.",
)
@click.option(
    "-o",
    "--output",
    metavar="FILE",
    default=None,
    help="Write to FILE (atomically) instead of stdout.",
)
@common_options
def checksum(
    sources: tuple[str, ...],
    request_ids: tuple[str, ...],
    positions: str | None,
    output_format: str,
    output: str | None,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Per-block checksums summed over the workers: per request, group and position, per
    replica key, and the total."""
    runtime = resolve_device(device or "auto")
    source = _open(sources, config_path, device)
    wanted = list(dict.fromkeys(request_ids)) or None
    if wanted is not None:
        source.check_request_ids(wanted)
    record = _checksum(source, wanted, positions, runtime, quiet)
    if output_format == "json":
        text = json_text(record.to_json()) + "\n"
    elif output_format == "csv":
        text = record_csv(record)
    elif output is not None:
        text = render_text(print_record, record)
    else:
        text = None
        print_record(make_console(), record)
    if text is not None:
        _emit(text, output)
    if not record.complete:
        if output_format != "table" and not quiet:
            missing = ", ".join(f"pp_rank {pp} tp_rank {tp}" for pp, tp in record.missing_workers)
            click.echo(
                f"kvaudit: incomplete set, missing workers {missing}: checksums are partial",
                err=True,
            )
        return EXIT_INCOMPLETE
    return EXIT_OK


def _open(sources: Sequence[str], config_path: str | None, device: str | None) -> Source:
    config: CacheDescription | None = None
    if config_path is not None:
        config = load_description(config_path)
    return open_source(sources, config, device_given=device is not None)


def _checksum(
    source: Source,
    request_ids: list[str] | None,
    positions: str | None,
    runtime: Runtime,
    quiet: bool,
) -> Record:
    work = source.work(request_ids)
    with progress_bar(work, "checksum", enabled=not quiet) as advance:
        return source.checksum(request_ids, positions, runtime, progress=advance)


def _emit(text: str, output: str | None) -> None:
    """Print ``text``, or write it to ``output`` whole or not at all."""
    if output is None:
        click.echo(text, nl=False)
        return
    target = os.path.abspath(output)
    temporary = os.path.join(
        os.path.dirname(target), f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp"
    )
    try:
        # Mode 0o666 less the umask, as for any file the user creates.
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        raise KvauditError(f"cannot write: {error.strerror}", output) from None
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise KvauditError(f"cannot write: {error.strerror}", output) from None
