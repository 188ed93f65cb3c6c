"""Records: checksums per request, group and block position under each replica key.

A ``WorkerRecord`` is what one worker computed; ``Record`` sums the workers of one
engine (a dump set) and is what ``kvaudit checksum --format json`` writes (docs/cli.md;
``records.encoding`` writes it, ``Record.from_json`` reads it back).

Modules, each using only those above it: ``model`` (the per-request and per-worker
dataclasses), ``layers`` (a description's layer facts, and what two records' facts
say differs), ``reading`` (the one strict decoder of a record's data shape: a record's
entries and an output folder's checksum lines), ``record`` (``Record``), ``encoding``
(the one encoder of the same shapes), ``combining`` (``combine_workers``).
"""

from .combining import combine_workers, layer_sums_sum
from .model import (
    PLANES,
    RECORD_FORMAT,
    GroupChecksums,
    LayerFacts,
    LayerPart,
    LayerSums,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    WorkerSummary,
    replica_zero_totals,
    strong_replica_zero_totals,
)
from .record import Record

__all__ = [
    "PLANES",
    "RECORD_FORMAT",
    "GroupChecksums",
    "LayerFacts",
    "LayerPart",
    "LayerSums",
    "Record",
    "RequestChecksums",
    "WorkerInfo",
    "WorkerRecord",
    "WorkerSummary",
    "combine_workers",
    "layer_sums_sum",
    "replica_zero_totals",
    "strong_replica_zero_totals",
]
