"""Planting faults in dumps (``kvaudit corrupt``): a copy of one worker's dump with one
fault in one block, and a typed account of what changed.

``planting.py`` writes the copy (``corrupt_dump``), ``modes.py`` holds the faults and
``result.py`` the result types (``PlantedFault``); ``kvaudit.formats`` and
``kvaudit.report`` write them out.
"""

from .planting import corrupt_dump
from .result import (
    MODES,
    ChangedSlice,
    CorruptMode,
    FlippedBit,
    PlantedFault,
    StaleOrigin,
    SwappedHeads,
    SwappedTokens,
)

__all__ = [
    "MODES",
    "ChangedSlice",
    "CorruptMode",
    "FlippedBit",
    "PlantedFault",
    "StaleOrigin",
    "SwappedHeads",
    "SwappedTokens",
    "corrupt_dump",
]
