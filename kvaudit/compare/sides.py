"""What a comparison learns of its two sides before comparing them: the requested ids
(each once, those a side holds, none on neither side), the tokens both sides hold, a side
trimmed to them and its checksums under one position numbering; warnings about the sides
themselves (the same files on both, roles swapped) and the attention window of each
windowed group (sliding-window or chunked local attention), from their descriptions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..core.errors import KvauditError
from ..description.model import SLIDING_TYPES, LayerSpec
from ..records import Record
from ..sources import RecordQuery, Runtime, Source
from ..sources.record_source import RecordSource
from ..workers import Progress
from .groups import AttentionWindow


def unique_ids(request_ids: Sequence[str] | None) -> list[str] | None:
    """The requested ids, each once (None: all)."""
    return None if request_ids is None else list(dict.fromkeys(request_ids))


def held_ids(source: Source, request_ids: Sequence[str] | None) -> list[str] | None:
    """The requested ids the source holds (None: all of them)."""
    if request_ids is None:
        return None
    known = set(source.request_ids)
    return [rid for rid in request_ids if rid in known]


def check_wanted(
    producer: Source,
    consumer: Source,
    request_ids: Sequence[str],
    labels: tuple[str, str] = ("the producer", "the consumer"),
) -> None:
    """Reject a requested id that neither side holds."""
    known = set(producer.request_ids) | set(consumer.request_ids)
    absent = [rid for rid in request_ids if rid not in known]
    if absent:
        raise KvauditError(
            f"request {', '.join(absent)} is on neither {labels[0]} "
            f"({', '.join(producer.names)}) nor {labels[1]} ({', '.join(consumer.names)})"
        )


def shared_numbering(*sources: Source) -> str:
    """The position numbering to checksum with: one a source is fixed to (a record's),
    else ``request``."""
    fixed = [source.positions for source in sources if source.positions is not None]
    return fixed[0] if fixed else "request"


def shared_tokens(
    producer: Source, consumer: Source, request_ids: Sequence[str] | None = None
) -> dict[str, int]:
    """Per request both sides hold, the tokens both hold: the smaller token count."""
    left, right = producer.token_counts(), consumer.token_counts()
    ids = left if request_ids is None else request_ids
    return {rid: min(left[rid], right[rid]) for rid in ids if rid in left and rid in right}


def trim_to(source: Source, num_tokens: Mapping[str, int]) -> Source:
    """The source cut to ``num_tokens`` where it can be checksummed again."""
    counts = source.token_counts()
    if all(counts.get(rid, n) <= n for rid, n in num_tokens.items()):
        return source
    return source.trimmed(num_tokens) or source


def checksum_held(
    source: Source,
    request_ids: Sequence[str] | None,
    positions: str,
    runtime: Runtime,
    progress: Progress | None,
) -> Record:
    """The source's record of those requested ids it holds (all when None)."""
    return source.checksum(RecordQuery(runtime, held_ids(source, request_ids), positions, progress))


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
