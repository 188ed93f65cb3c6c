"""The checksum engine: tensors' views planned into row sums, computed by a kernel backend.

``checksummer`` (``Checksummer``: one worker's caches checksummed per request and group),
``plans`` (which rows and bytes each sum reads), ``kernels`` (the backends: Triton on a GPU,
torch and numpy on the CPU, chosen through a lazy registry), and a dump set checksummed in
bounded batches: ``dump_set`` (the driver), ``dump_batches`` (rows read in place from the
files' mappings) and ``dump_staging`` (rows staged into pinned buffers for a GPU).
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    "Checksummer": ".checksummer",
    **dict.fromkeys(("BATCH_BYTES", "checksum_dump_set", "total_bytes"), ".dump_set"),
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
