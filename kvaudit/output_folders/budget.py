"""The bytes of dumps a worker may keep on disk, and what one block of its cache takes."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def block_bytes(tensors: Mapping[str, Any], num_blocks: int) -> int:
    """The bytes one block holds over every layer's tensors (what a dump writes per
    block): each tensor's bytes over the ``num_blocks`` blocks it holds."""
    total = 0
    for tensor in tensors.values():
        for part in tensor if isinstance(tensor, tuple) else (tensor,):
            total += part.numel() * part.element_size() // max(1, num_blocks)
    return total


class DumpBudget:
    """The bytes of dumps one worker may keep (``limit``), and its rotating dumps, which
    are removed oldest first to make room for new ones.

    It counts what is on disk: every dump written, at its path, until the budget removes
    it; a dump that rewrites a path replaces the old file's bytes only once written (a
    rewrite refused, or one whose write failed, leaves the old file counted).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._sizes: dict[Path, int] = {}
        self._rotating: deque[Path] = deque()

    def admits(self, path: Path, size: int, *, rotating: bool) -> bool:
        """Whether a dump of ``size`` bytes at ``path`` fits (``rotating``: after removing
        this worker's oldest rotating dumps as needed). A dump that could never fit
        removes nothing; one that rewrites ``path`` counts in place of the old file."""
        if size <= 0 or size > self.limit:
            return False
        old = self._sizes.get(path, 0)
        while rotating and self.used - old + size > self.limit:
            oldest = next((entry for entry in self._rotating if entry != path), None)
            if oldest is None:
                break
            self._rotating.remove(oldest)
            self.used -= self._sizes.pop(oldest)
            oldest.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # other workers' dumps are still in it
                oldest.parent.rmdir()
        return self.used - old + size <= self.limit

    def written(self, path: Path, size: int, *, rotating: bool) -> None:
        """Count a dump written at ``path`` (in place of a file it replaced; a rotating one
        may be removed later, the newest last)."""
        self.used += size - self._sizes.get(path, 0)
        self._sizes[path] = size
        if path in self._rotating:
            self._rotating.remove(path)
        if rotating:
            self._rotating.append(path)
