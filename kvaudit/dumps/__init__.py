"""KV cache dumps: what one worker held for some requests, as one safetensors file.

``open_dump`` and ``open_dump_set`` read dumps strictly (every problem is one line naming
the file) and memory-map their tensors, so nothing is loaded whole; ``write_dump`` writes a
worker's live tensors atomically, every tensor 64-byte aligned (docs/dump-format.md). This
package is file I/O only: checksumming a dump set is ``kvaudit.checksum.checksum_dump_set``.

Modules, each using only those above it: ``safetensors_io`` (the file format), ``layers``
(the tensors a description's layers have), ``dump`` (the dataclasses and the format's
names), ``example_connector`` (vLLM ExampleConnector folders read as a dump), ``hints``
(the other engine's description named in errors), ``reading`` (one dump, strictly),
``dump_sets`` (one engine's dumps opened together), ``writing`` (``write_dump``). Which
input a path is (a dump, a record, ExampleConnector folders) is ``kvaudit.sources``'s to
say: nothing here recognises inputs.
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

# Imported on first use: the command line's start-up imports ``dumps.mapping`` alone.
_EXPORTS = {
    **dict.fromkeys(
        ("COPY_BYTES", "FORMAT", "STORED_CHECKSUMS", "Dump", "DumpRequest", "DumpSet"), ".dump"
    ),
    "open_dump_set": ".dump_sets",
    "EXAMPLE_CONNECTOR_TENSOR": ".example_connector",
    "open_dump": ".reading",
    **dict.fromkeys(("ALIGNMENT", "PAD_PREFIX"), ".safetensors_io"),
    "write_dump": ".writing",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
