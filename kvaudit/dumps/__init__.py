"""KV cache dumps: what one worker held for some requests, as one safetensors file.

``open_dump`` and ``open_dump_set`` read dumps strictly (every problem is one line naming
the file) and memory-map their tensors, so nothing is loaded whole; ``checksum_dump_set``
checksums a set in batches of rows with bounded memory; ``write_dump`` writes a worker's
live tensors atomically, every tensor 64-byte aligned (docs/dump-format.md).

Modules, each using only those above it: ``safetensors_io`` (the file format), ``layers``
(the tensors a description's layers have), ``dump`` (the dataclasses and the format's
names), ``example_connector`` (vLLM ExampleConnector folders), ``reading`` (one dump,
strictly), ``dump_sets`` (sets and their checksums), ``writing`` (``write_dump``).
"""

from .dump import COPY_BYTES, FORMAT, STORED_CHECKSUMS, Dump, DumpRequest, DumpSet
from .dump_sets import BATCH_BYTES, checksum_dump_set, open_dump_set, total_bytes
from .example_connector import EXAMPLE_CONNECTOR_TENSOR
from .reading import open_dump
from .safetensors_io import ALIGNMENT, PAD_PREFIX
from .writing import write_dump

__all__ = [
    "ALIGNMENT",
    "BATCH_BYTES",
    "COPY_BYTES",
    "EXAMPLE_CONNECTOR_TENSOR",
    "FORMAT",
    "PAD_PREFIX",
    "STORED_CHECKSUMS",
    "Dump",
    "DumpRequest",
    "DumpSet",
    "checksum_dump_set",
    "open_dump",
    "open_dump_set",
    "total_bytes",
    "write_dump",
]
