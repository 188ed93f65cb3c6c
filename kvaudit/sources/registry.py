"""The source registry: which kind of source a SOURCE argument or a Python object is.

A kind registers how it recognises its arguments, by a prefix (``live:``) or by sniffing
the path (a record file), and how it opens them; one kind (dumps) takes what no other
claims. Python objects (a ``Record``, a ``DumpSet``, ``kvaudit.testing.LiveSide``) register
how they become a source. ``open_source`` serves the command line, ``source_of`` serves
``kvaudit.testing``. A new kind of source is one module and a ``register_kind`` call.

The built-in kinds are listed here by name (``"module:function"``): a kind's module is
imported when it opens its arguments, so a command given dumps never imports the record,
handle, socket, output-folder or ExampleConnector kinds (``kvaudit.sources.sniffing``
recognises them all, and is the only module that does).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..core.errors import KvauditError
from ..core.files import check_input
from ..description import CacheDescription
from .base import Source
from .sniffing import (
    LIVE_PREFIX,
    PY_PREFIX,
    is_example_connector_source,
    is_output_folder,
    is_record,
)


@dataclass(frozen=True)
class OpenOptions:
    """What the command line says about all its SOURCE arguments.

    ``config`` supplies or overrides a description; ``device_given``: live tensors move
    to ``--device`` when it was given, else they are checksummed where they are.
    """

    config: CacheDescription | None = None
    device_given: bool = False


Opener = Callable[[Sequence[str], Sequence[str], OpenOptions], Source]
"""Opens a command's SOURCE arguments (all of them, then those the kind claims)."""


def _named(path: str) -> object:
    """What ``"module:name"`` names, the module relative to ``kvaudit.sources``."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module, __package__), name)


@dataclass(frozen=True)
class SourceKind:
    """A kind of SOURCE argument: how it is recognised and opened.

    It claims the arguments with its ``prefix``, or those ``sniff`` accepts, and opens
    them with ``opener`` (which rejects mixes it cannot take): a function, or its
    ``"module:function"`` imported when first needed.
    """

    name: str
    opener: Opener | str
    prefix: str | None = None
    sniff: Callable[[str], bool] | None = None

    def claims(self, name: str) -> bool:
        """Whether a SOURCE argument is of this kind."""
        if self.prefix is not None and name.startswith(self.prefix):
            return True
        return self.sniff is not None and self.sniff(name)

    def open(self, names: Sequence[str], claimed: Sequence[str], options: OpenOptions) -> Source:
        """Open a command's SOURCE arguments (all of them, and those this kind claims)."""
        opener = _named(self.opener) if isinstance(self.opener, str) else self.opener
        return opener(names, claimed, options)  # type: ignore[operator]


_KINDS: list[SourceKind] = []
_FALLBACK: list[SourceKind] = []


def register_kind(kind: SourceKind, *, fallback: bool = False) -> None:
    """Register a kind of SOURCE argument.

    Kinds with a prefix are tried first, then the sniffing ones in the order registered,
    then the fallback, which takes any argument.

    Args:
        kind: The kind: its name, how it claims arguments and its opener.
        fallback: Make it the fallback, in place of the one registered before.

    """
    if fallback:
        _FALLBACK[:] = [kind]
    else:
        _KINDS.append(kind)


def open_source(
    names: Sequence[str], config: CacheDescription | None = None, *, device_given: bool = False
) -> Source:
    """Resolve a command's SOURCE arguments into one source (docs/cli.md, SOURCE).

    ``config`` supplies or overrides the dumps' and live workers' description.
    ``device_given``: live tensors move to ``--device`` when it was given, else they are
    checksummed where they are.

    Args:
        names: The SOURCE arguments, as the command line gives them.
        config: A description that supplies or overrides the sources' own.
        device_given: Whether ``--device`` was given.

    Returns:
        The source, opened by the kind that claims the arguments.

    Raises:
        KvauditError: No SOURCE given, a source that does not exist or cannot be read, or
            a mix of kinds.

    """
    if not names:
        raise KvauditError("no SOURCE given")
    for name in names:
        if not name.startswith(LIVE_PREFIX):
            check_input(name, directory=True)  # a FIFO or a device would block
    kind, claimed = source_kind(names)
    return kind.open(names, claimed, OpenOptions(config, device_given))


def source_kind(names: Sequence[str]) -> tuple[SourceKind, list[str]]:
    """The kind a command's SOURCE arguments are, and the arguments it claims.

    Raises:
        KvauditError: No kind claims them.

    """
    prefixed = [kind for kind in _KINDS if kind.prefix is not None]
    sniffed = [kind for kind in _KINDS if kind.prefix is None]
    for kind in (*prefixed, *sniffed, *_FALLBACK):
        claimed = [name for name in names if kind.claims(name)]
        if claimed or kind in _FALLBACK:
            return kind, claimed or list(names)
    raise KvauditError(f"not a source kvaudit knows: {names[0]}")


_Side = TypeVar("_Side")
Wrapper = Callable[[_Side, CacheDescription | None, str], Source]
"""Makes a Python object a source: ``(object, config, label)``."""

_ACCEPTED: list[str] = []
_BUILTIN_OBJECTS = (
    ("..records:Record", ".record_source:record_as_source", "a Record"),
    ("..dumps:DumpSet", ".dump_source:dump_set_as_source", "a DumpSet"),
)
"""The built-in objects' classes and wrappers, registered before any other (so that the
error for an object of another type lists them first), when an object is first wrapped
or registered."""
_builtins_registered = False


@functools.singledispatch
def _wrap(side: object, config: CacheDescription | None, label: str) -> Source:
    *rest, last = _ACCEPTED
    accepted = f"{', '.join(rest)} or {last}" if rest else last
    raise KvauditError(f"the {label} must be {accepted}, got {type(side).__name__}")


def _register_builtin_objects() -> None:
    global _builtins_registered
    if not _builtins_registered:
        _builtins_registered = True
        for cls, wrapper, accepted in _BUILTIN_OBJECTS:
            _wrap.register(_named(cls))(_named(wrapper))
            _ACCEPTED.append(accepted)


def register_object(cls: type, wrapper: Wrapper, accepted: str) -> None:
    """Register how an object of ``cls`` (or a subclass) becomes a source.

    Args:
        cls: The objects' class.
        wrapper: Makes such an object a source, called as ``(object, config, label)``.
        accepted: Names the objects in the error for an object of no registered type
            (``"a Record"``).

    """
    _register_builtin_objects()
    _wrap.register(cls)(wrapper)
    _ACCEPTED.append(accepted)


def source_of(side: object, config: CacheDescription | None = None, label: str = "side") -> Source:
    """A Python object as a source: paths as on the command line, or a registered type.

    Args:
        side: A path, a list of paths, or an object of a registered type (a ``Record``,
            a ``DumpSet``, ``kvaudit.testing.LiveSide``).
        config: A description that applies to dumps.
        label: Names the side in errors.

    Returns:
        The source.

    Raises:
        KvauditError: A path that cannot be read, or an object of another type.

    """
    _register_builtin_objects()
    return _wrap(side, config, label)


def _path(side: str | os.PathLike, config: CacheDescription | None, label: str) -> Source:
    return open_source([os.fspath(side)], config)


def _paths(side: Sequence[object], config: CacheDescription | None, label: str) -> Source:
    if side and all(isinstance(item, (str, os.PathLike)) for item in side):
        return open_source([os.fspath(item) for item in side], config)  # type: ignore[arg-type]
    return _wrap.dispatch(object)(side, config, label)


_wrap.register(str)(_path)
_ACCEPTED.append("dump paths")
_wrap.register(os.PathLike)(_path)
_wrap.register(Sequence)(_paths)

# The built-in kinds (docs/cli.md, SOURCE): those with a prefix first, then the sniffed
# ones in this order, then dumps, which take what no other kind claims.
register_kind(SourceKind("record", ".record_source:open_records", sniff=is_record))
register_kind(
    SourceKind("output", ".output_folder_source:open_output_folders", sniff=is_output_folder)
)
register_kind(
    SourceKind(
        "example-connector",
        ".example_connector_source:open_example_connector_folders",
        sniff=is_example_connector_source,
    )
)
register_kind(SourceKind("dumps", ".dump_source:open_dumps"), fallback=True)
register_kind(SourceKind("py", ".handle_source:open_handles", prefix=PY_PREFIX))
register_kind(SourceKind("live", ".socket_source:open_sockets", prefix=LIVE_PREFIX))
