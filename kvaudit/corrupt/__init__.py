"""Planting faults in dumps (``kvaudit corrupt``): a copy of one worker's dump with one
fault in one block, and a typed account of what changed.

``planting.py`` writes the copy (``corrupt_dump``), ``modes.py`` holds the faults and
``result.py`` the result types (``PlantedFault``); ``kvaudit.formats`` and
``kvaudit.report`` write them out.
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    "corrupt_dump": ".planting",
    **{
        name: ".result"
        for name in (
            "MODES",
            "ChangedSlice",
            "CorruptMode",
            "FlippedBit",
            "PlantedFault",
            "StaleOrigin",
            "SwappedHeads",
            "SwappedTokens",
        )
    },
}

__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
