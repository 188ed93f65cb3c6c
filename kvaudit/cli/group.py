"""The ``kvaudit`` click group: its ``--version`` and ``--debug`` options, the exit
statuses, and its error handling (bad input as one line, status 2; an internal error,
status 3; an interruption, status 130)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from ..distributed import spread
from ..errors import KvauditError, one_line
from ..exits import EXIT_INTERRUPTED, internal_error, tolerant_streams
from ..interrupts import check_interrupted, interrupt_received, interrupt_signals

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2
# click >= 8.2 raises this for a bare `kvaudit`; its message is the help text.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _CommandInterrupted(Exception):
    """A command's interruption, passed through click's main (which would print a blank
    line before turning a ``KeyboardInterrupt`` into its ``Abort``)."""


class KvauditGroup(click.Group):
    """A click group that reports errors as one line and returns each command's status."""

    debug = False
    """Whether ``--debug`` was given: an internal error prints its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
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
        from ..mapping import catch_bus_errors

        catch_bus_errors()
        self.debug = False
        try:
            with interrupt_signals():
                status = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
                # One that landed in a finalizer, which only printed it: the command ran on,
                # but an interrupted command ends as one.
                check_interrupted()
        except KvauditError as error:
            status = fail(str(error))
        except _NO_ARGS_IS_HELP as error:
            click.echo(error.format_message())
            status = EXIT_BAD_INPUT
        except click.UsageError as error:
            hint = f" (try '{error.ctx.command_path} --help')" if error.ctx is not None else ""
            status = fail(error.format_message() + hint)
        except click.ClickException as error:
            status = fail(error.format_message())
        except (click.Abort, KeyboardInterrupt, _CommandInterrupted):
            click.echo("kvaudit: interrupted", err=True)
            status = EXIT_INTERRUPTED
        except BrokenPipeError:
            # The reader of our output went away (`kvaudit checksum ... | head`): point
            # stdout at /dev/null so that flushing it at exit raises nothing more.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            status = EXIT_INCOMPLETE
        except Exception as error:  # any bug that escapes: status 3, not a traceback
            if interrupt_received():
                click.echo("kvaudit: interrupted", err=True)
                status = EXIT_INTERRUPTED
            else:
                status = internal_error(error, self.debug)
        finally:
            if spread():
                from ..distributed.commands import finish

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
        from .. import __version__

        return __version__


def _print_version(ctx: click.Context) -> None:
    """``kvaudit, version X`` and which C loops run, looked up only when asked for
    (importlib.metadata is slow to import)."""
    from ..native import summary

    click.echo(f"kvaudit, version {_version()}\n{summary()}")
    ctx.exit()


def fail(message: str) -> int:
    """Print ``kvaudit: error: <message>`` as one line on stderr; the bad-input status."""
    click.echo(one_line(f"kvaudit: error: {message}"), err=True)
    return EXIT_BAD_INPUT


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
    help="On an internal error (exit status 3), print the full traceback.",
)
def main() -> None:
    """Audit LLM KV caches: per-block checksums that add up across tensor-parallel ranks
    and pipeline stages and ignore block ids and memory layout.

    A SOURCE is a dump file, a directory of dump files (one engine's workers), a record
    (the JSON of `checksum --format json`), the output folder of kvaudit's vLLM connector,
    a running engine's live agents (live:SOCKET or live:FOLDER) or a Python handle
    (py:FILE.py or py:MODULE).
    """
