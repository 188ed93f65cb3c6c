"""kvaudit's optional C extensions (built by ``setup.py`` where a C compiler is at hand):
each one loaded on first use, or None where it did not build or ``KVAUDIT_NATIVE=0`` asks
for the numpy code it replaces. Whichever runs, the results are the same bits."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

ENVIRONMENT = "KVAUDIT_NATIVE"
"""Set to ``0`` to run the numpy code instead of every C extension."""

EXTENSIONS = {
    "kvaudit._native._row_sums": "checksum",
    "kvaudit._native._element_errors": "numeric errors",
    "kvaudit._native._value_reads": "numeric reads",
    "kvaudit._native._strong_sums": "strong lane",
}
"""Each C extension (the ``EXTENSIONS`` of setup.py) and what it computes."""

_LOADED: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """Whether the C extensions may run (``KVAUDIT_NATIVE`` is not ``0``)."""
    return os.environ.get(ENVIRONMENT, "").strip() != "0"


def extension(name: str) -> ModuleType | None:
    """The C extension module ``name`` (``kvaudit._native._row_sums``) where it built and
    :func:`enabled`, else None. The import is tried once per process."""
    if not enabled():
        return None
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(name)
        except ImportError:
            _LOADED[name] = None
    return _LOADED[name]


def summary() -> str:
    """One line for ``kvaudit --version``: which C loops run, or why the numpy code does."""
    if not enabled():
        return f"C loops: off ({ENVIRONMENT}=0), the numpy code runs"
    loaded = {what: extension(name) is not None for name, what in EXTENSIONS.items()}
    built = [what for what, ok in loaded.items() if ok]
    missing = [what for what, ok in loaded.items() if not ok]
    if not missing:
        return f"C loops: {', '.join(built)}"
    fallback = f"not built (no C compiler at install?), numpy runs: {', '.join(missing)}"
    return f"C loops: {', '.join(built)}; {fallback}" if built else f"C loops: {fallback}"
