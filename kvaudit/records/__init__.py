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

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    "Record": ".record",
    **dict.fromkeys(("combine_workers", "layer_sums_sum"), ".combining"),
    **dict.fromkeys(
        (
            "PLANES",
            "RECORD_FORMAT",
            "GroupChecksums",
            "LayerFacts",
            "LayerPart",
            "LayerSums",
            "RequestChecksums",
            "WorkerInfo",
            "WorkerRecord",
            "WorkerSummary",
            "replica_zero_totals",
            "strong_replica_zero_totals",
        ),
        ".model",
    ),
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
