"""Integers written as compact ranges (``0-2, 5, 7-9``), as every report writes positions."""

from __future__ import annotations

from collections.abc import Iterable


def ranges(positions: Iterable[int]) -> str:
    """Positions as sorted compact ranges: ``0-2, 5, 7-9``.

    Args:
        positions: The integers written (repeats once).

    Returns:
        The ranges, comma-separated; "" for none.

    """
    items = sorted(set(positions))
    parts = []
    first = 0
    for i in range(len(items)):
        if i + 1 == len(items) or items[i + 1] != items[i] + 1:
            parts.append(f"{items[first]}" if first == i else f"{items[first]}-{items[i]}")
            first = i + 1
    return ", ".join(parts)
