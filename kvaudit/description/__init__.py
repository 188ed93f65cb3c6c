"""The cache description: a worker's KV cache groups, their layers, specs and layouts.

Mirrors vLLM's ``KVCacheConfig``/``KVCacheGroupSpec``/``KVCacheSpec`` (see
docs/cache-description.md). ``load_description`` reads the YAML; ``parse_description``
validates a dict (a dump's embedded JSON); ``description_to_dict`` writes one back.

The package: ``model`` (the dataclasses), ``fields``, ``specs`` and ``validator`` (the
checks, key by key), ``loader`` (YAML) and ``serializer`` (the dict form).
"""

from __future__ import annotations

from .loader import load_description
from .model import (
    ATTENTION_TYPES,
    FORMAT_VERSION,
    LAYOUT_AXES,
    MLA_TYPES,
    SLIDING_TYPES,
    SPEC_CLASSES,
    SPEC_TYPES,
    CacheDescription,
    GroupDescription,
    LayerEntry,
    LayerSpec,
    StateSplit,
)
from .serializer import description_to_dict
from .validator import parse_description

__all__ = [
    "ATTENTION_TYPES",
    "FORMAT_VERSION",
    "LAYOUT_AXES",
    "MLA_TYPES",
    "SLIDING_TYPES",
    "SPEC_CLASSES",
    "SPEC_TYPES",
    "CacheDescription",
    "GroupDescription",
    "LayerEntry",
    "LayerSpec",
    "StateSplit",
    "description_to_dict",
    "load_description",
    "parse_description",
]
