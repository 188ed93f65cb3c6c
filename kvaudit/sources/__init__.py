"""Sources: what a command's SOURCE arguments (or a test's sides) are, resolved into one
thing to inspect, checksum or diff.

A command's SOURCEs are one of (docs/cli.md):

- dump files and directories of dump files (``*.safetensors``): together, one dump set;
- one record, the JSON ``kvaudit checksum --format json`` writes (a ``.json`` file, or any
  file whose content starts with ``{``);
- Python handles ``py:PATH``, each one worker of this process
  (``kvaudit.sources.handle_source``);
- running engines ``live:PATH``: a live agent's socket or a folder of them
  (``kvaudit.sources.socket_source``; never a Python handle);
- one output folder of an in-engine audit, vLLM or SGLang
  (``kvaudit.sources.output_folder_source``);
- vLLM ExampleConnector folders, or a connector's storage directory of them
  (``kvaudit.sources.example_connector_source``).

In Python, ``ChecksummerSource`` wraps an engine's live ``Checksummer`` objects
(``kvaudit.testing.LiveSide``).

Modules: ``base`` (the ``Source`` interface, ``Runtime``), ``inventory`` (what ``inspect``
shows), ``raw`` (the raw-KV protocol dumps and live tensors share, for checksumming and
locating), ``registry`` (kinds by prefix or sniffing, objects by type), then one module per
kind: ``record_source``, ``output_folder_source``, ``example_connector_source``,
``dump_source`` (with ``dump_checksums``, the bounded-memory checksums of a dump set),
``handle_source``, ``socket_source``, ``checksummer_source``, and ``sniffing`` (the one
place that recognises the built-in kinds, and what a wrong input looks like). A new
kind is one module and its ``register_kind`` line in ``registry`` (docs/architecture.md).
The names below are imported on first use, and a kind's module when it opens its
arguments: a command given dumps imports only theirs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.lazy import lazy_exports

if TYPE_CHECKING:
    from . import dump_source, handle_source, output_folder_source, record_source, socket_source
    from .base import Progress, Runtime, Source, resolve_device
    from .checksummer_source import ChecksummerSource
    from .dump_source import DumpSource
    from .handle_source import HandleSource
    from .inventory import GroupInfo, Inventory, RequestInventory, WorkerInventory
    from .raw import RawKVSource, RawWorker, TensorWorker
    from .record_source import RecordSource, load_record
    from .registry import SourceKind, open_source, register_kind, register_object, source_of
    from .socket_source import SocketSource

_EXPORTS = {
    "ChecksummerSource": ".checksummer_source",
    "DumpSource": ".dump_source",
    "GroupInfo": ".inventory",
    "Inventory": ".inventory",
    "HandleSource": ".handle_source",
    "TensorWorker": ".raw",
    "Progress": ".base",
    "RawKVSource": ".raw",
    "RawWorker": ".raw",
    "RecordSource": ".record_source",
    "RequestInventory": ".inventory",
    "Runtime": ".base",
    "SocketSource": ".socket_source",
    "Source": ".base",
    "SourceKind": ".registry",
    "WorkerInventory": ".inventory",
    "dump_source": ".dump_source",
    "handle_source": ".handle_source",
    "load_record": ".record_source",
    "open_source": ".registry",
    "record_source": ".record_source",
    "register_kind": ".registry",
    "register_object": ".registry",
    "resolve_device": ".base",
    "socket_source": ".socket_source",
    "source_of": ".registry",
    "output_folder_source": ".output_folder_source",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "ChecksummerSource",
    "DumpSource",
    "GroupInfo",
    "HandleSource",
    "Inventory",
    "Progress",
    "RawKVSource",
    "RawWorker",
    "RecordSource",
    "RequestInventory",
    "Runtime",
    "SocketSource",
    "Source",
    "SourceKind",
    "TensorWorker",
    "WorkerInventory",
    "dump_source",
    "handle_source",
    "load_record",
    "open_source",
    "output_folder_source",
    "record_source",
    "register_kind",
    "register_object",
    "resolve_device",
    "socket_source",
    "source_of",
]
