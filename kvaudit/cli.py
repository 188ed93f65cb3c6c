"""The ``kvaudit`` command: inspect dump sets, checksum them, diff a producer with a
consumer, verify a set, plant faults (docs/cli.md).

Exit status: 0 success; 1 when the set is incomplete (a worker is missing, so some
checksums are partial), or for ``diff`` and ``verify`` when a block differs or something
could not be verified; 2 on bad usage or bad input, reported as one line
``kvaudit: error: <message>`` on stderr; 3 on an internal error (a bug in kvaudit), one
line saying where (the traceback with ``--debug``); 130 when interrupted (Ctrl-C,
SIGTERM, SIGHUP), with no output file left half-written.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import click

from .corrupt.result import MODES
from .distributed import is_writer, spread
from .errors import KvauditError, one_line, printable
from .exits import (
    EXIT_INTERRUPTED,
    internal_error,
    interrupt_signals,
    tolerant_streams,
)
from .files import check_output
from .validation import POSITION_NUMBERINGS

# What the commands compute with is imported by each command when it runs: `kvaudit
# --help` and commands that compute nothing start as fast as click does (issue 10).
if TYPE_CHECKING:
    from rich.console import Console

    from .compare import DiffReport
    from .corrupt import CorruptMode
    from .description import CacheDescription
    from .report import Sides
    from .sources import Source

_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2
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
# click >= 8.2 raises this for a bare `kvaudit`; its message is the help text.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class KvauditGroup(click.Group):
    """A click group that reports errors as one line and returns each command's status."""

    debug = False
    """Whether ``--debug`` was given: an internal error prints its traceback."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        tolerant_streams()
        from .mapping import catch_bus_errors

        catch_bus_errors()
        self.debug = False
        try:
            with interrupt_signals():
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
        except (click.Abort, KeyboardInterrupt):
            click.echo("kvaudit: interrupted", err=True)
            status = EXIT_INTERRUPTED
        except BrokenPipeError:
            # The reader of our output went away (`kvaudit checksum ... | head`): point
            # stdout at /dev/null so that flushing it at exit raises nothing more.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            status = EXIT_INCOMPLETE
        except Exception as error:  # any bug that escapes: status 3, not a traceback
            status = internal_error(error, self.debug)
        finally:
            if spread():
                from .distributed.commands import finish

                finish()
        if not standalone_mode:
            return status
        sys.exit(status if isinstance(status, int) else EXIT_OK)


def _version() -> str:
    """The installed distribution's version, else the package's own."""
    import importlib.metadata

    try:
        return importlib.metadata.version("kvaudit")
    except importlib.metadata.PackageNotFoundError:
        from . import __version__

        return __version__


def _print_version(ctx: click.Context) -> None:
    """``kvaudit, version X``, looked up only when asked for (importlib.metadata is slow
    to import)."""
    click.echo(f"kvaudit, version {_version()}")
    ctx.exit()


def _fail(message: str) -> int:
    """Print ``kvaudit: error: <message>`` as one line on stderr; the bad-input status."""
    click.echo(one_line(f"kvaudit: error: {message}"), err=True)
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


def _format_option(choices: Sequence[str], help_text: str) -> _Decorator:
    """``--format`` among ``choices``, the first the default."""
    return click.option(
        "--format",
        "output_format",
        type=click.Choice(choices),
        default=choices[0],
        show_default=True,
        help=help_text,
    )


def _output_option() -> _Decorator:
    """``-o/--output FILE``, written atomically instead of stdout."""
    return click.option(
        "-o",
        "--output",
        metavar="FILE",
        default=None,
        help="Write to FILE (atomically) instead of stdout.",
    )


def _request_option(help_text: str) -> _Decorator:
    """``--request ID``, repeatable."""
    return click.option("--request", "request_ids", metavar="ID", multiple=True, help=help_text)


def _report_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--format table|json|junit``, ``-o FILE``, ``--json FILE``, ``--junit FILE``,
    ``--allow-missing`` and ``--allow-empty`` of ``diff`` and ``verify``."""
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
    command = _output_option()(command)
    return _format_option(
        REPORT_FORMATS, "Output format: rich tables, the diff report JSON, or JUnit XML."
    )(command)


def _set_debug(context: click.Context, parameter: click.Parameter, value: bool) -> bool:
    group = context.find_root().command
    if isinstance(group, KvauditGroup):
        group.debug = value
    return value


@dataclass(frozen=True)
class ReportOutputs:
    """Where a ``diff`` or ``verify`` report goes: ``--format`` on stdout or ``-o``, and
    the ``--json`` and ``--junit`` files beside it."""

    output_format: ReportFormat
    output: str | None
    json_path: str | None
    junit_path: str | None


@click.group(cls=KvauditGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, _, given: _print_version(ctx) if given else None,
    help="Show the version and exit.",
)
@click.option(
    "--debug",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_set_debug,
    help="On an internal error (exit status 3), print the full traceback.",
)
def main() -> None:
    """Audit LLM KV caches: per-block checksums that add up across tensor-parallel ranks
    and pipeline stages and ignore block ids and memory layout.

    A SOURCE is a dump file, a directory of dump files (one engine's workers), a record
    (the JSON of `checksum --format json`) or a live handle (live:PATH).
    """


@main.command(epilog=EXIT_HELP)
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@_format_option(get_args(InventoryFormat), "Output format.")
@common_options
def inspect(
    sources: tuple[str, ...],
    output_format: InventoryFormat,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Show what a dump set holds: workers, groups, coverage, fingerprints, requests."""
    from .formats import inventory_to_json, json_text
    from .report import make_console, print_inventory
    from .sources import resolve_device

    resolve_device(device or "auto")  # rejects --device cuda without CUDA, as everywhere
    inventory = _open(sources, _config(config_path), device).inventory()
    if output_format == "json":
        click.echo(json_text(_stamp(inventory_to_json(inventory))))
    else:
        print_inventory(make_console(), inventory)
    return EXIT_OK if inventory.complete else EXIT_INCOMPLETE


@main.command(epilog=EXIT_HELP)
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@_request_option("Checksum only this request (repeatable); default all.")
@click.option(
    "--positions",
    type=click.Choice(POSITION_NUMBERINGS),
    default=None,
    help="Number pieces from the request's first token, or from each block's "
    "[default: request; a record keeps its own].",
)
@_format_option(get_args(RecordFormat), "Output format.")
@_output_option()
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
    from .formats import json_text, record_csv, record_to_json
    from .progress import progress_bar
    from .sources import resolve_device

    _check_outputs({"-o": output}, [*sources, config_path])
    runtime = resolve_device(device or "auto")
    source = _open(sources, _config(config_path), device)
    wanted = _wanted(request_ids)
    if wanted is not None:
        source.check_request_ids(wanted)
    with progress_bar(source.work(wanted), "checksum", enabled=not quiet) as advance:
        record = source.checksum(wanted, positions, runtime, progress=advance)
    if output_format == "json":
        _emit(json_text(_stamp(record_to_json(record))) + "\n", output)
    elif output_format == "csv":
        _emit(record_csv(record), output)
    else:
        from .report import print_record

        _emit_table(functools.partial(print_record, record=record), output)
    if record.complete:
        return EXIT_OK
    if output_format != "table" and not quiet:
        from .report import missing_workers_text

        click.echo(
            f"kvaudit: incomplete set, missing workers "
            f"{missing_workers_text(record.missing_workers)}: checksums are partial",
            err=True,
        )
    return EXIT_INCOMPLETE


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
@_request_option("Compare only this request (repeatable); default all.")
@click.option(
    "--locate/--no-locate",
    default=None,
    help="Narrow each differing block down to layers, heads, tokens and bytes "
    "[default: when both sides hold the raw KV].",
)
@_report_options
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
    allow_missing: bool,
    allow_empty: bool,
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
    from .diffing import diff_sources, diff_work
    from .progress import progress_bar
    from .report import DIFF_SIDES
    from .sources import resolve_device

    _check_outputs(
        {"-o": output, "--json": json_path, "--junit": junit_path, "--html": html_path},
        [producer, consumer, producer_config, consumer_config, config_path],
    )
    runtime = resolve_device(device or "auto")
    config = functools.cache(_config)  # -c serves both sides: read it once
    left = _open([producer], config(producer_config or config_path), device)
    right = _open([consumer], config(consumer_config or config_path), device)
    wanted = _wanted(request_ids)
    if numeric:
        if junit_path is not None:
            raise click.UsageError("--numeric reports as table or JSON, not JUnit")
        outputs = (output, json_path, html_path)
        tolerance = (atol or 0.0, rtol or 0.0)
        return diff_numeric(left, right, wanted, tolerance, output_format, outputs, quiet)
    if atol is not None or rtol is not None:
        raise click.UsageError("--atol and --rtol go with --numeric")
    with progress_bar(diff_work(left, right, wanted), "diff", enabled=not quiet) as advance:
        report = diff_sources(
            left,
            right,
            request_ids=wanted,
            locate=False if spread() else locate,
            runtime=runtime,
            progress=advance,
            allow_missing=allow_missing,
            allow_empty=allow_empty,
        )
    if spread():
        from .distributed.commands import locate_across

        locate_across(report, left, right, wanted, locate)
    title = f"diff: producer {left.describe()}, consumer {right.describe()}"
    outputs = ReportOutputs(output_format, output, json_path, junit_path)
    _emit_report(report, outputs, title, DIFF_SIDES, "kvaudit.diff")
    if html_path is not None:
        from .formats.html import diff_html

        _emit(diff_html(report, title), html_path)
    return EXIT_OK if report.ok else EXIT_MISMATCH


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
@_request_option("Verify only this request (repeatable); default all.")
@_report_options
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
    allow_missing: bool,
    allow_empty: bool,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Check a dump set (or record) one way: against a saved record (--against), the
    producer checksums its dumps received (--received), or the stored checksums of its
    offloaded blocks (--stored)."""
    from .diffing import verify_sources, verify_work
    from .progress import progress_bar
    from .report import Sides
    from .sources import resolve_device

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
    _check_outputs(
        {"-o": output, "--json": json_path, "--junit": junit_path},
        [*sources, against, config_path],
    )
    runtime = resolve_device(device or "auto")
    source = _open(sources, _config(config_path), device)
    saved = _open([against], None, device) if against is not None else None
    wanted = _wanted(request_ids)
    work = verify_work(source, against=saved, request_ids=wanted)
    check = verify_sources
    if spread():
        from .distributed.spread_verify import verify_spread as check
    with progress_bar(work, "verify", enabled=not quiet) as advance:
        report = check(
            source,
            against=saved,
            received=received,
            stored=stored,
            request_ids=wanted,
            runtime=runtime,
            progress=advance,
            allow_missing=allow_missing,
            allow_empty=allow_empty,
        )
    if saved is not None:
        sides = Sides("saved record", "source")
        title = f"verify {source.describe()} against {saved.describe()}"
    elif received:
        sides = Sides("received producer checksums", "consumer")
        title = f"verify {source.describe()} against the producer checksums it received"
    else:
        sides = Sides("stored checksums", "dumps", "checked")
        title = f"verify the stored checksums of {source.describe()}"
    outputs = ReportOutputs(output_format, output, json_path, junit_path)
    _emit_report(report, outputs, title, sides, "kvaudit.verify")
    return EXIT_OK if report.ok else EXIT_MISMATCH


@main.command(epilog=CORRUPT_EXIT_HELP)
@click.argument("source", metavar="SOURCE")
@click.option(
    "-o", "--output", metavar="OUT", required=True, help="Where to write the corrupted copy."
)
@click.option("--request", "request_id", metavar="ID", required=True, help="The request.")
@click.option("--group", "group_id", metavar="G", type=int, required=True, help="The group id.")
@click.option(
    "--position",
    metavar="P",
    type=int,
    required=True,
    help="The request's block position, in the dump's block size of the group.",
)
@click.option("--layer", metavar="NAME", default=None, help="Only this layer.")
@click.option("--head", metavar="H", type=int, default=None, help="Only this global KV head.")
@click.option(
    "--token", metavar="T", type=int, default=None, help="This request position (flip, swap)."
)
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="flip",
    show_default=True,
    help="flip a bit, zero the block, swap tokens or heads, a stale block from another "
    "request, tokens shifted by one slot.",
)
@click.option(
    "--seed", metavar="N", type=int, default=0, show_default=True, help="Seed of the choices."
)
@_format_option(get_args(PlantedFormat), "How to say what changed.")
@common_options
def corrupt(
    source: str,
    output: str,
    request_id: str,
    group_id: int,
    position: int,
    layer: str | None,
    head: int | None,
    token: int | None,
    mode: CorruptMode,
    seed: int,
    output_format: PlantedFormat,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Write a copy of one dump file with one planted fault in one block, and say what
    changed (for testing connectors and checkers)."""
    from .corrupt import corrupt_dump
    from .formats import json_text, planted_to_json
    from .report import make_console, print_corrupted
    from .sources import resolve_device

    resolve_device(device or "auto")
    if os.path.exists(output) and os.path.exists(source) and os.path.samefile(source, output):
        raise KvauditError("the output is SOURCE itself; corrupt writes a copy elsewhere", output)
    _check_outputs({"-o": output}, [source, config_path])
    fault = corrupt_dump(
        source,
        output,
        request_id=request_id,
        group_id=group_id,
        position=position,
        layer=layer,
        head=head,
        token=token,
        mode=mode,
        seed=seed,
        config=_config(config_path),
    )
    if output_format == "json":
        click.echo(json_text(planted_to_json(fault)))
    else:
        print_corrupted(make_console(), fault)
    return EXIT_OK


def diff_numeric(
    left: Source,
    right: Source,
    wanted: list[str] | None,
    tolerance: tuple[float, float],
    output_format: ReportFormat,
    outputs: tuple[str | None, str | None, str | None],
    quiet: bool,
) -> int:
    """``diff --numeric``: compare by value, print or write the report (``outputs``: -o,
    --json and --html files), the exit status."""
    from .diffing import diff_work, numeric_sources
    from .formats import json_text
    from .formats.html import numeric_html
    from .formats.numeric import numeric_to_json
    from .progress import progress_bar
    from .report.numeric import print_numeric

    if output_format == "junit":
        raise click.UsageError("--numeric reports as --format table or json")
    output, json_path, html_path = outputs
    atol, rtol = tolerance
    with progress_bar(diff_work(left, right, wanted), "diff", enabled=not quiet) as advance:
        report = numeric_sources(
            left, right, atol=atol, rtol=rtol, request_ids=wanted, progress=advance
        )
    title = f"diff --numeric: producer {left.describe()}, consumer {right.describe()}"
    text = json_text(numeric_to_json(report, left.describe(), right.describe())) + "\n"
    if output_format == "json":
        _emit(text, output)
    else:
        _emit_table(functools.partial(print_numeric, report=report, title=title), output)
    if json_path is not None:
        _emit(text, json_path)
    if html_path is not None:
        _emit(numeric_html(report, title), html_path)
    return EXIT_OK if report.ok else EXIT_MISMATCH


def _emit_report(
    report: DiffReport, outputs: ReportOutputs, title: str, sides: Sides, suite: str
) -> None:
    """Warn on stderr, write the ``--json`` and ``--junit`` files, then print or write
    the report in the chosen format. A reader of stdout that went away (``| head``)
    loses the rest of the output, not the verdict's exit status."""
    from .formats import diff_junit, diff_to_json, json_text
    from .report import make_console, print_diff

    for warning in report.warnings:
        click.echo(f"kvaudit: warning: {printable(warning, newlines=False)}", err=True)
    if outputs.json_path is not None:
        _emit(json_text(_stamp(diff_to_json(report))) + "\n", outputs.json_path)
    if outputs.junit_path is not None:
        _emit(diff_junit(report, suite), outputs.junit_path)
    output = outputs.output
    try:
        if outputs.output_format == "json":
            _emit(json_text(_stamp(diff_to_json(report))) + "\n", output)
        elif outputs.output_format == "junit":
            _emit(diff_junit(report, suite), output)
        elif output is None:
            console = make_console()
            # rich exits with status 1 on a closed pipe; the verdict decides the status.
            console.on_broken_pipe = _raise_broken_pipe  # type: ignore[method-assign]
            print_diff(console, report=report, title=title, sides=sides)
        else:
            render = functools.partial(print_diff, report=report, title=title, sides=sides)
            _emit_table(render, output)
        if output is None:
            sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so that flushing it at exit raises nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _raise_broken_pipe() -> None:
    """A console's reaction to a closed pipe: raise, so that the caller decides."""
    raise BrokenPipeError


def _check_outputs(outputs: dict[str, str | None], inputs: Sequence[str | None]) -> None:
    """Refuse, before any work, an output option (``-o``) that names no file or names one
    of the command's inputs (SOURCE arguments, records, descriptions); under torchrun,
    on rank 0 only, which writes it."""
    if not is_writer():
        return
    named = [name for name in inputs if name]
    for option, output in outputs.items():
        if output is not None:
            check_output(output, named, option)


def _config(path: str | None) -> CacheDescription | None:
    """The cache description a ``-c``-style option names; None when not given."""
    from .description import load_description

    return None if path is None else load_description(path)


def _open(names: Sequence[str], config: CacheDescription | None, device: str | None) -> Source:
    """SOURCE arguments resolved; live tensors move to ``--device`` only when given. Under
    torchrun, each process opens its share of the dumps (docs/scale.md)."""
    if spread():
        from .distributed.commands import open_spread_source

        return open_spread_source(names, config, device)
    from .sources import open_source

    return open_source(names, config, device_given=device is not None)


def _stamp(data: dict[str, Any]) -> dict[str, Any]:
    """A result's JSON, with ``"processes"`` when several processes computed it."""
    if not spread():
        return data
    from .distributed.commands import stamped

    return stamped(data)


def _wanted(request_ids: Sequence[str]) -> list[str] | None:
    """The ``--request`` ids, each once; None (every request) when none is given."""
    return list(dict.fromkeys(request_ids)) or None


def _emit_table(render: Callable[[Console], None], output: str | None) -> None:
    """Print tables on stdout's console, or write them as plain text to ``output``."""
    if not is_writer():
        return
    from .report import make_console, render_text

    if output is None:
        render(make_console())
    else:
        _emit(render_text(render), output)


def _emit(text: str, output: str | None) -> None:
    """Print ``text``, or write it to ``output`` whole or not at all (under torchrun,
    rank 0 only)."""
    if not is_writer():
        return
    from .files import atomic_path

    if output is None:
        click.echo(text, nl=False)
        return
    with (
        atomic_path(output) as temporary,
        open(temporary, "x", encoding="utf-8", errors="backslashreplace", newline="") as handle,
    ):
        handle.write(text)
