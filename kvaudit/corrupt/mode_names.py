"""The names of ``corrupt``'s faults, apart from the result types so that the command
line's ``--mode`` choice imports no dataclasses."""

from __future__ import annotations

from typing import Literal, get_args

CorruptMode = Literal["flip", "zero", "swap-tokens", "swap-heads", "stale", "shift"]
"""How a fault changes a block (``corrupt --mode``)."""

MODES: tuple[CorruptMode, ...] = get_args(CorruptMode)
