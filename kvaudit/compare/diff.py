"""``diff_sources``: a producer and a consumer checksummed over the tokens both hold and
compared, request by request; differing blocks located from both sides' raw KV and traced
to the producer blocks they hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..core.errors import KvauditError
from ..locate import locate_differences
from ..records import Record
from ..sources import Source
from ..workers import FetchingWorker, RawWorker, fetched, fetches
from .groups import AttentionWindow
from .model import DiffReport
from .options import DEFAULT_OPTIONS, CompareOptions
from .pairing import pair_by_prompt
from .records import compare_records
from .sides import (
    check_wanted,
    checksum_held,
    group_windows,
    held_ids,
    shared_numbering,
    shared_tokens,
    side_warnings,
    trim_to,
    unique_ids,
)
from .trace import partial_note, trace_by_checksums, trace_report


def diff_work(producer: Source, consumer: Source, request_ids: Sequence[str] | None = None) -> int:
    """The bytes ``diff_sources`` checksums: the total of its ``progress`` calls.

    A side that holds only checksums counts 0.

    Args:
        producer: The side that sent the KV.
        consumer: The side that received it.
        request_ids: The requests compared; None for every request either side holds.

    Returns:
        The number of bytes.

    """
    ids = unique_ids(request_ids)
    return sum(source.work(held_ids(source, ids)) for source in (producer, consumer))


@dataclass
class PairedSides:
    """A producer and a consumer made ready to be checksummed and compared: paired by
    prompt (the consumer's ids renamed to the producer's), the requests checked, and what
    the comparison needs of the sides as given (their token counts, windows and the
    pairing's notes)."""

    producer: Source
    consumer: Source
    ids: list[str] | None
    counts: tuple[dict[str, int], dict[str, int]]
    windows: dict[int, AttentionWindow]
    shared: dict[str, int]
    notes: list[str]

    def warnings(self) -> list[str]:
        """The sides' warnings so far (a side adds one when a dump it reads for locating
        cannot be read), the pairing's notes, and swapped roles or one set twice."""
        return [
            *self.producer.warnings,
            *self.consumer.warnings,
            *self.notes,
            *side_warnings(self.producer, self.consumer),
        ]

    def trimmed(self) -> tuple[Source, Source]:
        """Both sides trimmed to the tokens both hold (``shared``)."""
        return trim_to(self.producer, self.shared), trim_to(self.consumer, self.shared)


def paired_sides(producer: Source, consumer: Source, options: CompareOptions) -> PairedSides:
    """The sides paired by prompt, the requested ids checked and the comparison's inputs
    gathered (what ``diff_sources`` and ``numeric_sources`` both start from).

    Args:
        producer: The side that sent the KV.
        consumer: The side that received it.
        options: The requests compared (``request_ids``).

    Returns:
        The paired sides, untrimmed, with the requested ids in the producer's names.

    Raises:
        KvauditError: A requested id on neither side.

    """
    pairing = pair_by_prompt(producer, consumer)
    producer, consumer = pairing.producer, pairing.consumer
    ids = unique_ids(options.request_ids)
    if ids is not None:
        ids = unique_ids([pairing.producer_id(rid) for rid in ids])
        check_wanted(producer, consumer, ids)
    return PairedSides(
        producer,
        consumer,
        ids,
        (producer.token_counts(), consumer.token_counts()),
        group_windows(producer, consumer),
        shared_tokens(producer, consumer, ids),
        list(pairing.notes),
    )


def checksum_compare(
    sides: PairedSides,
    producer: Source,
    consumer: Source,
    options: CompareOptions,
    warnings: Sequence[str],
) -> tuple[DiffReport, Record, Record]:
    """Both (trimmed) sides checksummed over the requests they hold and their records
    compared: the bitwise diff without locating or tracing.

    Args:
        sides: What ``paired_sides`` gathered.
        producer: The producer, trimmed to the shared tokens.
        consumer: The consumer, trimmed likewise.
        options: The runtime, progress and what a pass accepts.
        warnings: What the report warns of before its own warnings (``sides.warnings()``).

    Returns:
        The report, the producer's and the consumer's record.

    Raises:
        KvauditError: Records of different position numberings, or any bad input met
            while checksumming.

    """
    runtime, progress = options.device(), options.progress
    positions = shared_numbering(producer, consumer)
    left = checksum_held(producer, sides.ids, positions, runtime, progress)
    right = checksum_held(consumer, sides.ids, positions, runtime, progress)
    report = compare_records(
        left,
        right,
        request_ids=sides.ids,
        token_counts=sides.counts,
        windows=sides.windows,
        seed_lane_only=options.seed_lane_only,
    )
    options.judge(report)
    report.warnings = [*warnings, *report.warnings]
    return report, left, right


def diff_sources(
    producer: Source,
    consumer: Source,
    options: CompareOptions = DEFAULT_OPTIONS,
    *,
    locate: bool | None = None,
) -> DiffReport:
    """The producer compared with the consumer, request by request (docs/cli.md, diff).

    A side that can be checksummed again (dumps, live workers) is checksummed over the
    tokens both sides hold (the smaller token count), so a consumer that decoded further
    is compared up to the last shared token; a record is compared as it is. Positions the
    producer holds that the consumer lacks are missing. Located entries fill each group's
    ``located``; only the differing blocks are read again. The report warns when the
    sides' roles are swapped or both sides are the same files.

    Args:
        producer: The side that sent the KV.
        consumer: The side that received it.
        options: The requests compared, the runtime, progress, and what a pass accepts
            (``allow_missing``, ``allow_empty``).
        locate: None locates differences when both sides hold the raw KV, True requires
            it, False never locates.

    Returns:
        The report: per request and group, what was compared and what differs.

    Raises:
        KvauditError: A requested id on neither side, ``locate=True`` with a side that
            holds only checksums, records of different position numberings, or any bad
            input met while checksumming.

    """
    sides = paired_sides(producer, consumer, options)
    producer, consumer = sides.producer, sides.consumer
    untrimmed = producer.raw_kv() if locate is not False else None
    dumped = _dumped_kv(producer, consumer, locate)
    warnings = sides.warnings()  # after reading the dumps for locating: they may warn
    producer, consumer = sides.trimmed()
    raw = _raw_kv(producer, consumer, locate, dumped is not None)
    report, left, right = checksum_compare(sides, producer, consumer, options, warnings)
    if raw is not None:
        group_shapes(report, [*raw[0], *raw[1]])
        locate_report(report, *raw, sides.shared)
        remote = [side for side, workers in zip((producer, consumer), raw) if fetches(workers)]
        if remote:
            why = (
                f"{', '.join(remote[0].names)} is a running engine, whose blocks are fetched "
                "only at the differing positions"
            )
            if trace_by_checksums(report, left, right):
                report.untraced = partial_note(why)
        else:
            trace_report(report, untrimmed or raw[0], raw[1], sides.shared)
    elif dumped is not None:
        # Some requests' dumps: located where both sides dumped the request, traced by
        # the checksums, which every request has.
        group_shapes(report, [*dumped[0], *dumped[1]])
        locate_report(report, *dumped, sides.shared)
        explain_unlocated(report, *dumped)
        if trace_by_checksums(report, left, right):
            report.untraced = partial_note(_dumped_only(producer, consumer))
    elif trace_by_checksums(report, left, right):
        report.untraced = partial_note(_unread(producer, consumer, locate))
    return report


def _dumped_kv(
    producer: Source, consumer: Source, locate: bool | None
) -> tuple[list[RawWorker], list[RawWorker]] | None:
    """Both sides' KV for locating where a side holds only some requests' dumps (an
    output folder) and the other the raw KV or dumps too; None where both hold the raw
    KV, a side holds neither, or ``locate`` is False."""
    if locate is False:
        return None
    left, right = producer.raw_kv(), consumer.raw_kv()
    if left is not None and right is not None:
        return None
    sides = [
        raw if raw is not None else side.dumped_kv()
        for raw, side in ((left, producer), (right, consumer))
    ]
    if sides[0] is None or sides[1] is None or fetches(sides[0]) or fetches(sides[1]):
        return None
    return sides[0], sides[1]  # type: ignore[return-value]


def _dumped_only(producer: Source, consumer: Source) -> str:
    """Why a trace by checksums where the sides hold some requests' dumps only."""
    names = [", ".join(side.names) for side in (producer, consumer) if side.raw_kv() is None]
    if len(names) == 2:
        return f"{names[0]} and {names[1]} hold the KV of their dumped requests only"
    return f"{names[0]} holds the KV of its dumped requests only"


def explain_unlocated(
    report: DiffReport, producer: Sequence[RawWorker], consumer: Sequence[RawWorker]
) -> None:
    """Say why each differing group that was located nowhere was not: a side holds no
    dump of the request, or the dumps hold no difference at those positions (taken at
    another time than the checksums)."""
    listed = [{rid for worker in side for rid in worker.requests} for side in (producer, consumer)]
    for request_id, _, group in report.groups():
        if not group.differs or group.located:
            continue
        lacking = [
            name for name, ids in zip(("producer", "consumer"), listed) if request_id not in ids
        ]
        if len(lacking) == 2:
            group.not_located = "no dump of this request on either side"
        elif lacking:
            group.not_located = f"no dump of this request on the {lacking[0]}"
        else:
            group.not_located = "the dumps of this request do not differ at these positions"


def group_shapes(report: DiffReport, workers: Sequence[RawWorker | FetchingWorker]) -> None:
    """Fill each group's ``layers`` (its viewed layers by layer number and name, aliases
    once) and ``heads`` (its global KV heads: past the last head any worker views) from
    some workers' views; groups no worker views keep them empty, as do a running engine's
    workers (fetched at the differing positions only: their views are not at hand)."""
    shapes = viewed_shapes(workers)
    for _, gid, group in report.groups():
        if gid in shapes:
            group.layers, group.heads = shapes[gid]


def viewed_shapes(
    workers: Sequence[RawWorker | FetchingWorker],
) -> dict[int, tuple[list[str], int]]:
    """Per group the workers view, its layer names (by layer number and name, aliases
    once) and its global KV heads (past the last head any worker views)."""
    shapes: dict[int, tuple[dict[tuple[int, str], None], int]] = {}
    for worker in workers:
        if isinstance(worker, FetchingWorker):
            continue
        for gid, views in worker.array_views.items():
            names, heads = shapes.get(gid, ({}, 0))
            for view in views.views:
                names[view.number, view.name] = None
                heads = max(heads, view.first_head + view.heads)
            shapes[gid] = (names, heads)
    return {
        gid: (list(dict.fromkeys(name for _, name in sorted(names))), heads)
        for gid, (names, heads) in shapes.items()
        if names
    }


def _unread(producer: Source, consumer: Source, locate: bool | None) -> str:
    """Why the raw KV was not read for tracing (a side holds only checksums, or
    ``--no-locate``)."""
    if locate is False:
        return "--no-locate"
    side = producer if producer.raw_kv() is None else consumer
    return f"{', '.join(side.names)} is a {side.kind} that holds only checksums, not the KV"


def _raw_kv(
    producer: Source, consumer: Source, locate: bool | None, dumped: bool = False
) -> tuple[list[RawWorker], list[RawWorker]] | None:
    """Both sides' raw KV where differences are to be located (``locate``: None when
    both hold it, True always, False never), else None.

    Raises:
        KvauditError: ``locate=True`` with a side that holds only checksums (and no dumps
            to locate from: ``dumped``).

    """
    if locate is False:
        return None
    left, right = producer.raw_kv(), consumer.raw_kv()
    if left is not None and right is not None:
        return left, right
    if locate and not dumped:
        side = producer if left is None else consumer
        raise KvauditError(
            f"--locate needs the raw KV on both sides; {', '.join(side.names)} is a "
            f"{side.kind} that holds only checksums"
        )
    return None


def locate_report(
    report: DiffReport,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
) -> None:
    """Fill each differing group's ``located`` with the layers, heads, tokens and bytes
    that differ at its mismatched positions and replica-differing positions."""
    for request_id, gid, group in report.groups():
        positions = {*group.mismatched_positions, *(p for p, _, _ in group.replica_mismatches)}
        if not positions or request_id not in num_tokens:
            continue
        wanted = (request_id, gid, sorted(positions), group.block_size, num_tokens[request_id])
        group.located = locate_differences(
            fetched(producer, *wanted), fetched(consumer, *wanted), *wanted
        )
