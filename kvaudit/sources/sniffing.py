"""How the built-in kinds recognise a SOURCE argument, without importing the modules that
open it: a record file, a vLLM connector's output folder, a Python handle, a live socket
(``kvaudit.sources.registry`` lists the kinds in the order they are tried)."""

from __future__ import annotations

import os

RECORD_SUFFIX = ".json"
DUMP_SUFFIX = ".safetensors"
LIVE_PREFIX = "live:"
PY_PREFIX = "py:"


def is_record(name: str) -> bool:
    """A record: a ``.json`` file, or a file whose first non-blank byte is ``{``."""
    if name.lower().endswith(RECORD_SUFFIX):
        return True
    if name.lower().endswith(DUMP_SUFFIX) or not os.path.isfile(name):
        return False
    try:
        with open(name, "rb") as handle:
            head = handle.read(64)
    except OSError:
        return False
    # A safetensors file starts with an 8-byte header length, never with "{".
    return head.lstrip()[:1] == b"{"


def is_output_folder(name: str) -> bool:
    """An in-engine audit's output folder (``kvaudit.integrations.output``)."""
    if not os.path.isdir(name):  # a dump file, the usual argument, needs no more
        return False
    from ..output_folders import is_output_folder as marked

    return marked(name)


def python_target(target: str) -> bool:
    """Whether ``live:TARGET`` is a Python handle: a path ending ``.py``, or a dotted
    module name that is no existing file, socket or folder."""
    if target.endswith(".py"):
        return True
    if not target or os.path.lexists(target):
        return False
    return all(part.isidentifier() for part in target.split("."))


def is_python_handle(name: str) -> bool:
    """``live:`` with a Python handle (the older spelling of ``py:``)."""
    return name.startswith(LIVE_PREFIX) and python_target(name[len(LIVE_PREFIX) :])


def is_socket(name: str) -> bool:
    """``live:`` with a socket or a folder of sockets: any ``live:`` but a Python handle."""
    return name.startswith(LIVE_PREFIX) and not python_target(name[len(LIVE_PREFIX) :])
