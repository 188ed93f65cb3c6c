"""Lazy package exports: a package's public names imported from their modules on first
use, so that importing the package (``python -m kvaudit --help``) loads none of them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module
    relative to the package) when ``name`` is first asked for, and keeps it; a name that
    is the module's own (``"dump_source": ".dump_source"``) is the module itself."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = importlib.import_module(module, package)
        value = imported if imported.__name__ == f"{package}.{name}" else getattr(imported, name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
