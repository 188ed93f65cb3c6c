"""The ``kvaudit`` click group: its ``--version`` and ``--debug`` options, the exit
statuses, and its error handling (bad input as one line, status 2; an internal error,
status 3; an interruption, status 130)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from ..core.errors import KvauditError, one_line
from ..core.exit_status import ExitStatus
from ..core.interrupts import check_interrupted, interrupt_received, interrupt_signals
from ..distributed import Settled
from ..distributed.processes import processes
from .exits import INTERRUPTED_LINE, internal_error_line, tolerant_streams

# click >= 8.2 raises this for a bare `kvaudit`; its message is the help text.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _CommandInterrupted(Exception):
    """A command's interruption, passed through click's main (which would print a blank
    line before turning a ``KeyboardInterrupt`` into its ``Abort``)."""


class KvauditGroup(click.Group):
    """A click group that reports errors as one line and returns each command's status."""

    debug = False
    """Whether ``--debug`` was given: an internal error prints its traceback, a failed
    exchange under torchrun the backend's text."""

    given: tuple[str, ...] = ()
    """The command line's arguments, which every process under torchrun must share."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            processes().begin(self.given, self.debug)
            return super().invoke(ctx)
        except KeyboardInterrupt as interruption:
            raise _CommandInterrupted from interruption

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        tolerant_streams()
        from ..core.mapping import catch_bus_errors

        catch_bus_errors()
        self.debug = False
        self.given = tuple(sys.argv[1:] if args is None else args)
        runtime = processes()
        try:
            status, line = self._run(args, prog_name, complete_var, **extra)
            if line is not None:
                click.echo(line, err=True)
            status, more = runtime.finish(self.given, self.debug, status, line)
            if more is not None:
                click.echo(one_line(more), err=True)
        finally:
            runtime.leave()
        if not standalone_mode:
            return status
        sys.exit(status)

    def _run(
        self,
        args: Sequence[str] | None,
        prog_name: str | None,
        complete_var: str | None,
        **extra: Any,
    ) -> tuple[int, str | None]:
        """Run the command: its exit status, and the one line to print on stderr (None:
        none)."""
        try:
            with interrupt_signals():
                status = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
                # One that landed in a finalizer, which only printed it: the command ran on,
                # but an interrupted command ends as one.
                check_interrupted()
        except Settled as settled:  # another process ended first, under torchrun
            return settled.status, None if settled.line is None else one_line(settled.line)
        except KvauditError as error:
            return ExitStatus.BAD_INPUT, error_line(str(error))
        except _NO_ARGS_IS_HELP as error:
            click.echo(error.format_message())
            return ExitStatus.BAD_INPUT, None
        except click.UsageError as error:
            hint = f" (try '{error.ctx.command_path} --help')" if error.ctx is not None else ""
            return ExitStatus.BAD_INPUT, error_line(error.format_message() + hint)
        except click.ClickException as error:
            return ExitStatus.BAD_INPUT, error_line(error.format_message())
        except (click.Abort, KeyboardInterrupt, _CommandInterrupted):
            return ExitStatus.INTERRUPTED, INTERRUPTED_LINE
        except BrokenPipeError:
            # The reader of our output went away (`kvaudit checksum ... | head`): point
            # stdout at /dev/null so that flushing it at exit raises nothing more.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return ExitStatus.INCOMPLETE, None
        except Exception as error:  # any bug that escapes: status 3, not a traceback
            if interrupt_received():
                return ExitStatus.INTERRUPTED, INTERRUPTED_LINE
            return ExitStatus.INTERNAL, internal_error_line(error, self.debug)
        return (status if isinstance(status, int) else ExitStatus.OK), None


def _version() -> str:
    """The installed distribution's version, else the package's own."""
    import importlib.metadata

    try:
        return importlib.metadata.version("kvaudit")
    except importlib.metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def _print_version(ctx: click.Context) -> None:
    """``kvaudit, version X`` and which C loops run, looked up only when asked for
    (importlib.metadata is slow to import)."""
    from ..core.native import summary

    click.echo(f"kvaudit, version {_version()}\n{summary()}")
    ctx.exit()


def error_line(message: str) -> str:
    """``kvaudit: error: <message>`` as one line, as a bad input is reported on stderr."""
    return one_line(f"kvaudit: error: {message}")


def _set_debug(context: click.Context, parameter: click.Parameter, value: bool) -> bool:
    group = context.find_root().command
    if isinstance(group, KvauditGroup):
        group.debug = value
    return value


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
    help="On an internal error (exit status 3), print the full traceback; under torchrun, "
    "add the backend's own text to a failed exchange's line.",
)
def main() -> None:
    """Audit LLM KV caches: per-block checksums that add up across tensor-parallel ranks
    and pipeline stages and ignore block ids and memory layout.

    A SOURCE is a dump file, a directory of dump files (one engine's workers), a record
    (the JSON of `checksum --format json`), the output folder of kvaudit's vLLM connector,
    a running engine's live agents (live:SOCKET or live:FOLDER) or a Python handle
    (py:FILE.py or py:MODULE).
    """
