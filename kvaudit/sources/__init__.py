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

Modules: ``base`` (the ``Source`` interface, ``Runtime``, ``RecordQuery``), ``raw``
(``RawKVSource``, ``TensorWorker``: sources of raw KV read through the protocols of
``kvaudit.workers``, which also holds ``Inventory``, what ``inspect`` shows),
``registry`` (kinds by prefix or sniffing, objects by type), then one module per kind:
``record_source``, ``output_folder_source``, ``example_connector_source``, ``dump_source``
(with ``dump_checksums``, the bounded-memory checksums of a dump set), ``handle_source``,
``socket_source``, ``checksummer_source``, and ``sniffing`` (the one place that recognises
the built-in kinds, and what a wrong input looks like). A new
kind is one module and its ``register_kind`` line in ``registry`` (docs/architecture.md).
The names below are imported on first use, and a kind's module when it opens its
arguments: a command given dumps imports only theirs.
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("RecordQuery", "Runtime", "Source", "resolve_device"), ".base"),
    "ChecksummerSource": ".checksummer_source",
    "DumpSource": ".dump_source",
    "HandleSource": ".handle_source",
    **dict.fromkeys(("RawKVSource", "TensorWorker"), ".raw"),
    **dict.fromkeys(("RecordSource", "load_record"), ".record_source"),
    **dict.fromkeys(
        ("SourceKind", "open_source", "register_kind", "register_object", "source_of"),
        ".registry",
    ),
    "SocketSource": ".socket_source",
    **{
        kind: f".{kind}"
        for kind in (
            "dump_source",
            "handle_source",
            "output_folder_source",
            "record_source",
            "socket_source",
        )
    },
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
