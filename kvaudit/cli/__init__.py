"""The ``kvaudit`` command: inspect dump sets, checksum them, diff a producer with a
consumer, verify a set, plant faults (docs/cli.md).

Exit status: 0 success; 1 when the set is incomplete (a worker is missing, so some
checksums are partial), or for ``diff`` and ``verify`` when a block differs or something
could not be verified; 2 on bad usage or bad input, reported as one line
``kvaudit: error: <message>`` on stderr; 3 on an internal error (a bug in kvaudit), one
line saying where (the traceback with ``--debug``); 130 when interrupted (Ctrl-C,
SIGTERM, SIGHUP), with no output file left half-written.

Modules: ``group`` (the click group, exit statuses, error handling), ``options`` (options
several commands share), ``arguments`` (SOURCEs opened, descriptions read, outputs
checked), ``output`` (results printed or written, in their ``--format``), then one module
per command, each registering itself on ``main``. What a command computes with is imported
when it runs: ``kvaudit --help`` and commands that compute nothing start fast (issue 10).
"""

# Each command module registers its command on main when imported.
from . import checksum_command, corrupt_command, diff_command, inspect_command, verify_command
from .group import main

__all__ = [
    "checksum_command",
    "corrupt_command",
    "diff_command",
    "inspect_command",
    "main",
    "verify_command",
]
