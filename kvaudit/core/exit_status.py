"""The exit statuses of every kvaudit command (docs/cli.md, "Exit status"), in one place."""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    """What a command's exit status says; CI pipelines read it."""

    OK = 0
    """Everything checked held (and, for a diff, nothing was left unverified)."""
    MISMATCH = 1
    """A difference was found, or the result is incomplete (a worker missing, checksums
    partial, a group unverified): not a pass."""
    INCOMPLETE = 1
    BAD_INPUT = 2
    """Bad usage or bad input: one line names the file and the problem."""
    INTERNAL = 3
    """A bug in kvaudit: one line says where (the traceback with ``--debug``)."""
    INTERRUPTED = 130
    """Ctrl-C, SIGTERM or SIGHUP: nothing half-written is left."""
