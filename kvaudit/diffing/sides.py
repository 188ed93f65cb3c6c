"""The two sides a command reads: the requested ids (each once, those a side holds, none
on neither side), the tokens both sides hold, a side trimmed to them, and its checksums
under one position numbering.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..core.errors import KvauditError
from ..records import Record
from ..sources import Progress, Runtime, Source


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
    return source.checksum(held_ids(source, request_ids), positions, runtime, progress)
