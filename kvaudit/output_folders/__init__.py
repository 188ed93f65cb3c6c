"""An in-engine audit's output folder (kvaudit's vLLM connector, its SGLang hooks): the
engine's cache descriptions, every audited request's per-worker checksums (appended as
JSON lines) and its dumps; read back as one record.

Layout (docs/vllm.md, docs/sglang.md)::

    OUTPUT/kvaudit-output.json                  marks the folder (the engine that wrote it)
    OUTPUT/cache.yaml                           the description (one PP stage: TP rank 0's)
    OUTPUT/workers/pp{P}-tp{T}/cache.yaml       each worker's description
    OUTPUT/workers/pp{P}-tp{T}/checksums.jsonl  one line per audited request
    OUTPUT/workers/pp{P}-tp{T}/checksums.{N}.jsonl   the same, rotated (N = 1 the newest)
    OUTPUT/dumps/{request}/pp{P}-tp{T}.safetensors   a dump set per dumped request

This package imports no engine and no integration: ``kvaudit``'s sources read the folder
anywhere (``read_output``: each line decoded by the record's strict decoder,
``records.reading``; a torn line skipped and counted), and the lines are encoded by the
record's encoder (``records.encoding``). Folders written before
the format was shared (marked ``kvaudit-vllm.json``, lines ``kvaudit.vllm-checksums/1``)
are read as well.

Its modules, one job each: ``layout`` (the folder's names), ``writing`` (the marker,
descriptions and checksum lines, rotated), ``budget`` (``DumpBudget``), ``reading`` (the
folder read back, torn lines skipped) and ``lines`` (one line decoded, checked against its
folder and merged). The modules import one another, never this package (which imports
them all): the names below are theirs.
"""

from __future__ import annotations

from .budget import DumpBudget, block_bytes
from .layout import (
    CHECKSUMS,
    FORMAT,
    LEGACY_FORMAT,
    LEGACY_MARKER,
    LINE_FORMAT,
    LINE_FORMATS,
    MARKER,
    ROTATED,
    dump_path,
    rotated_name,
    worker_folder,
)
from .lines import check_line, merge_line
from .reading import (
    MAX_LINE_BYTES,
    MAX_MARKER_BYTES,
    OutputFolder,
    checksum_files,
    cut_short,
    read_output,
    read_output_folder,
)
from .writing import (
    KEEP_CHECKSUM_FILES,
    MAX_CHECKSUM_BYTES,
    append_checksums,
    checksum_line,
    prompt_digest,
    write_description,
)

__all__ = [
    "CHECKSUMS",
    "FORMAT",
    "KEEP_CHECKSUM_FILES",
    "LEGACY_FORMAT",
    "LEGACY_MARKER",
    "LINE_FORMAT",
    "LINE_FORMATS",
    "MARKER",
    "MAX_CHECKSUM_BYTES",
    "MAX_LINE_BYTES",
    "MAX_MARKER_BYTES",
    "ROTATED",
    "DumpBudget",
    "OutputFolder",
    "append_checksums",
    "block_bytes",
    "check_line",
    "checksum_files",
    "checksum_line",
    "cut_short",
    "dump_path",
    "merge_line",
    "prompt_digest",
    "read_output",
    "read_output_folder",
    "rotated_name",
    "worker_folder",
    "write_description",
]
