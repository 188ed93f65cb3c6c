"""``diff --numeric``: a producer and a consumer compared by value over the tokens both hold,
from both sides' raw KV, and checked for what a diff must never pass (missing tokens or
positions, consumer copies that differ, incomplete sets, nothing compared) as the bitwise
diff checks it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..compare import DiffReport
from ..compare.diff import checksum_compare, paired_sides
from ..compare.model import SEED_LANE_NOTE
from ..compare.options import DEFAULT_OPTIONS, CompareOptions
from ..compare.sides import check_wanted, shared_tokens, unique_ids
from ..core.errors import KvauditError
from ..core.validation import worker_layout
from ..sources import Source
from ..workers import RawWorker
from .budget import DEFAULT_BUDGET, NumericBudget
from .model import NumericReport
from .scheduling import numeric_diff


def numeric_sources(
    producer: Source,
    consumer: Source,
    options: CompareOptions = DEFAULT_OPTIONS,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    budget: NumericBudget = DEFAULT_BUDGET,
) -> NumericReport:
    """The producer compared with the consumer by value over the tokens both hold.

    docs/numeric.md describes the comparison. Both sides are also checksummed and their
    records compared, as ``diff`` does (but neither located nor traced), for what the
    values cannot show: positions the consumer lacks and consumer copies of replicated
    heads that differ from the copy compared by value.

    Args:
        producer: The side that sent the KV.
        consumer: The side that received it.
        options: As for ``diff_sources`` (``progress`` counts the bytes compared).
        atol: The absolute tolerance of an element.
        rtol: The tolerance relative to the producer's element.
        budget: What the comparison reads, decodes and holds at once.

    Returns:
        The report: per request, group, layer and head, the errors and where they are.

    Raises:
        KvauditError: A requested id on neither side, a side that holds only checksums,
            a tolerance that is not a finite number >= 0, or any bad input met while
            checksumming or reading.

    """
    ids = unique_ids(options.request_ids)
    if ids is not None:
        check_wanted(producer, consumer, ids)
    shared = shared_tokens(producer, consumer, ids)
    raw = []
    for side in (producer, consumer):
        workers = side.value_kv(ids)
        if workers is None:
            raise KvauditError(
                f"--numeric needs the raw KV on both sides; {', '.join(side.names)} is a "
                f"{side.kind} that holds only checksums"
            )
        raw.append(workers)
    # What the values cannot show (positions the consumer lacks, consumer copies that
    # differ, the sides' warnings) from the bitwise diff's checksums: the comparison of
    # the records only, neither located nor traced.
    checked = CompareOptions(ids, options.runtime, allow_missing=True, allow_empty=True)
    sides = paired_sides(producer, consumer, checked)
    structure, _, _ = checksum_compare(sides, *sides.trimmed(), checked, sides.warnings())
    left, right = raw
    report = numeric_diff(
        left,
        right,
        shared,
        atol=atol,
        rtol=rtol,
        request_ids=ids,
        progress=options.progress,
        budget=budget,
    )
    options.judge(report)
    # Which lanes of the checksum were compared does not bear on a comparison by value.
    report.warnings = [w for w in structure.warnings if not w.startswith(SEED_LANE_NOTE)]
    report.scale_differences = list(structure.scale_differences)
    report.missing = _missing(structure)
    report.copies_differing = [
        (rid, gid, list(group.replica_mismatches))
        for rid, gid, group in structure.groups()
        if group.replica_mismatches
    ]
    report.incomplete = [
        text
        for label, workers in zip(("producer", "consumer"), raw)
        if (text := _incomplete(label, workers)) is not None
    ]
    return report


def _missing(structure: DiffReport) -> list[tuple[str, int | None, str]]:
    """What the producer holds that the consumer lacks: tokens past the consumer's count,
    and block positions within it (the bitwise diff's missing positions)."""
    found: list[tuple[str, int | None, str]] = []
    for rid in structure.requests:
        held, consumer_tokens = (count or 0 for count in structure.num_tokens[rid])
        if consumer_tokens < held:
            found.append(
                (
                    rid,
                    None,
                    f"tokens {consumer_tokens}..{held - 1}: the consumer holds "
                    f"{consumer_tokens} of the producer's {held} tokens",
                )
            )
        for gid, group in sorted(structure.requests[rid].items()):
            # Positions past the consumer's tokens are said above, once per request.
            size = group.block_size
            within = [p for p in group.missing_positions if (p + 1) * size <= consumer_tokens]
            if within:
                listed = ", ".join(str(p) for p in within)
                found.append((rid, gid, f"block positions {listed} (of {group.block_size} tokens)"))
    return found


def _incomplete(label: str, workers: Sequence[RawWorker]) -> str | None:
    """``label``'s set in words when it lacks workers of its TP x PP grid, else None."""
    absent = worker_layout([worker.worker for worker in workers]) if workers else []
    if not absent:
        return None
    ranks = ", ".join(f"pp {pp} tp {tp}" for pp, tp in absent)
    return f"the {label} set lacks workers {ranks}: its values are compared in part"
