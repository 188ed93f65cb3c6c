"""What the ``diff`` and ``verify`` driver learns about its two sides before comparing:
warnings about the sides themselves (the same files on both, roles swapped) and the
attention window of each windowed group (sliding-window or chunked local attention),
from the sides' descriptions."""

from __future__ import annotations

import os

from .compare.sides import AttentionWindow
from .description.model import SLIDING_TYPES, LayerSpec
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


def _group_window(specs: list[LayerSpec]) -> AttentionWindow | None:
    """The window of a group whose layers are all sliding-window layers (the largest
    window) or all chunked local attention with a known chunk size (the same size)."""
    if all(spec.type in SLIDING_TYPES and spec.sliding_window for spec in specs):
        return AttentionWindow(max(int(spec.sliding_window or 0) for spec in specs))
    if all(spec.type == "chunked_local_attention" and spec.attention_chunk_size for spec in specs):
        sizes = {int(spec.attention_chunk_size or 0) for spec in specs}
        return AttentionWindow(sizes.pop(), chunked=True) if len(sizes) == 1 else None
    return None


def group_windows(*sources: Source) -> dict[int, AttentionWindow]:
    """The window of each windowed group (sliding-window or chunked local attention),
    from the sides' descriptions: where they differ, the sliding window that expects
    fewer positions (the smaller), and no window for chunk sizes that disagree; groups
    of a record side are not known."""
    found: dict[int, list[AttentionWindow | None]] = {}
    for source in sources:
        for description in source.descriptions():
            for group in description.groups:
                specs = [entry.spec for entry in group.layers] or [group.spec]
                found.setdefault(group.id, []).append(_group_window(specs))
    windows: dict[int, AttentionWindow] = {}
    for gid, rules in found.items():
        known = {rule for rule in rules if rule is not None}
        if len(known) == 1:
            windows[gid] = known.pop()
        elif known and not any(rule.chunked for rule in known):
            windows[gid] = min(known, key=lambda rule: rule.tokens)
    return windows


__all__ = ["group_windows", "side_warnings"]
