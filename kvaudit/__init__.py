"""kvaudit: audit LLM KV caches with per-block checksums.

The checksums add up across TP ranks and PP stages and ignore block ids and memory
layout. The library's main entry points: ``load_description``/``parse_description`` (the cache
description), ``Checksummer`` (a worker's checksums of live tensors), ``combine_workers``
(sum one engine's workers into a ``Record``).
"""

from __future__ import annotations

from .core.lazy import lazy_exports

_EXPORTS = {
    "Checksummer": ".checksum.checksummer",
    "RequestBlocks": ".checksum.checksummer",
    "CacheDescription": ".description",
    "load_description": ".description",
    "parse_description": ".description",
    "KvauditError": ".core.errors",
    "Record": ".records",
    "WorkerInfo": ".records",
    "WorkerRecord": ".records",
    "combine_workers": ".records",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)


__version__ = "0.1.0"

__all__ = ["__version__", *sorted(_EXPORTS)]
