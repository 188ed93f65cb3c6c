"""The cache description: a worker's KV cache groups, their layers, specs and layouts.

Mirrors vLLM's ``KVCacheConfig``/``KVCacheGroupSpec``/``KVCacheSpec`` (see
docs/cache-description.md). ``load_description`` reads the YAML; ``parse_description``
validates a dict (a dump's embedded JSON); ``description_to_dict`` writes one back.

The package: ``model`` (the dataclasses), ``fields``, ``specs`` and ``validator`` (the
checks, key by key), ``loader`` (YAML) and ``serializer`` (the dict form).
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

# Imported on first use: YAML is read only by commands given a description file.
_EXPORTS = {
    **dict.fromkeys(
        (
            "ATTENTION_TYPES",
            "FORMAT_VERSION",
            "HOST_RESIDENT",
            "LAYOUT_AXES",
            "LEFT_OUT_BY_DESCRIPTION",
            "MLA_TYPES",
            "NOT_TRANSFERRED",
            "SLIDING_TYPES",
            "SPEC_CLASSES",
            "SPEC_TYPES",
            "CacheDescription",
            "GroupDescription",
            "LayerEntry",
            "LayerSpec",
            "StateSplit",
        ),
        ".model",
    ),
    "description_to_dict": ".serializer",
    "load_description": ".loader",
    "parse_description": ".validator",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
