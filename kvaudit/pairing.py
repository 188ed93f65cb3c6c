"""What the ``diff`` and ``verify`` driver learns about its two sides before comparing:
warnings about the sides themselves (the same files on both, roles swapped) and the
attention window of each sliding-window group, from the sides' descriptions."""

from __future__ import annotations

import os

from .description.model import SLIDING_TYPES
from .sources import Source
from .sources.record_source import RecordSource


def _roles(source: Source) -> set[str]:
    """The roles the source's workers state (none for live workers without one)."""
    if isinstance(source, RecordSource):
        return {summary.worker.role for summary in source.record.workers}
    raw = source.raw_kv()
    return set() if raw is None else {worker.worker.role for worker in raw}


def _files(source: Source) -> set[tuple[int, int]]:
    """The files the source reads, as (device, inode); empty for live workers."""
    raw = source.raw_kv()
    names = source.names if raw is None else [worker.name for worker in raw]
    found = set()
    for name in names:
        try:
            info = os.stat(name)
        except (OSError, ValueError):
            return set()
        found.add((info.st_dev, info.st_ino))
    return found


def side_warnings(producer: Source, consumer: Source) -> list[str]:
    """What a diff should warn about: both sides are the same files (a set compared with
    itself), or the dumps say the PRODUCER is a consumer and the CONSUMER a producer."""
    warnings = []
    files = _files(producer)
    if files and files == _files(consumer):
        warnings.append(
            f"PRODUCER and CONSUMER are the same files ({', '.join(producer.names)}): the "
            "set is compared with itself"
        )
    elif _roles(producer) == {"consumer"} and _roles(consumer) == {"producer"}:
        warnings.append(
            f"the roles look swapped: PRODUCER {', '.join(producer.names)} says it is a "
            f"consumer and CONSUMER {', '.join(consumer.names)} a producer; pass the "
            "producer first"
        )
    return warnings


def group_windows(*sources: Source) -> dict[int, int]:
    """The attention window in tokens of each group whose layers are all sliding-window
    layers, from the sides' descriptions (the smaller where they differ); groups of a
    record side are not known."""
    windows: dict[int, int] = {}
    for source in sources:
        for description in source.descriptions():
            for group in description.groups:
                specs = [entry.spec for entry in group.layers] or [group.spec]
                if not all(spec.type in SLIDING_TYPES and spec.sliding_window for spec in specs):
                    continue
                window = max(int(spec.sliding_window or 0) for spec in specs)
                windows[group.id] = min(windows.get(group.id, window), window)
    return windows


__all__ = ["group_windows", "side_warnings"]
