"""The decode's verdicts on the requests it checked: each request's outcome from every
rank's parts of its checks, then counted, logged and written to the output folder
(verified, verified on some layers only, mismatched or unverified)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from .carried import MOD64, Carried, Unverified
from .inline_state import STATS, count_unverified, first_time, log_fault, logger, write_output
from .ranks import CONSUMER, LayerSpan

DESCRIBED_APART = 3
"""The kind of a rank's part of a check whose groups the decode describes differently
from the prefill (another dtype, shape or split): a mismatch."""


def _layers_text(layers: LayerSpan) -> str:
    """A span of layers as the log lines write it, ``first..last``."""
    return f"{layers[0]}..{layers[1] - 1}"


def record_unverified(requests: list[tuple[Any, Unverified]]) -> None:
    """Count the requests no rank carried a usable value for, each with its reason.

    Args:
        requests: ``(request, why it is unverified)`` pairs.

    """
    try:
        for req, why in requests:
            count_unverified(req, why.reason, why.detail)
    except Exception:  # counting and logging only
        log_fault("recording the decode's verdicts")


@dataclass
class Verdict:
    """One request's outcome over the checks of what its rows carried: the layer spans
    that agreed, the mismatch lines, and why a check was not compared."""

    verified: list[LayerSpan] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    problem: str | None = None


def judge(
    rid: str,
    checks: list[tuple[int, Carried]],
    numbers: list[int],
    sums: list[list[list[int]]],
    errors: dict[int, str],
) -> Verdict:
    """The verdict on one request from every rank's parts of its checks ``numbers``
    (``errors``: this rank's reasons for the checks it could not compare, the text of a
    problem only, never of what is decided).

    Args:
        rid: The request's id (in the mismatch lines).
        checks: Every check of the batch: ``(index into the batch, what a row carried)``.
        numbers: The request's checks, as indices into ``checks``.
        sums: Per rank, its ``[kind, total, residual, *group sums]`` of every check (kind
            2: not compared on that rank; ``DESCRIBED_APART``: a group described apart).
        errors: This rank's reasons, by check, for the checks it could not compare.

    Returns:
        The request's verdict.

    """
    verdict = Verdict()
    for n in numbers:
        carried = checks[n][1]
        kinds = [part[n][0] for part in sums]
        if DESCRIBED_APART in kinds:
            verdict.failed.append(
                f"kvaudit KV description mismatch req={rid} "
                f"tokens={carried.first}..{carried.end} "
                f"layers={_layers_text(carried.layers)}: "
                + errors.get(n, "a group is described apart on a peer rank")
            )
            continue
        if max(kinds) == 2:
            verdict.problem = verdict.problem or errors.get(n, "not comparable on a peer rank")
            continue
        total = sum(part[n][1] for part in sums) % MOD64
        residual = sum(part[n][2] for part in sums) % MOD64
        if total == carried.total and residual == 0:
            verdict.verified.append(carried.layers)
            continue
        verdict.failed.append(
            _failed_line(rid, carried, total, residual)
            + _failed_groups(carried, [part[n][3:] for part in sums])
        )
    return verdict


def _failed_line(rid: str, carried: Carried, total: int, residual: int) -> str:
    """A mismatch line: what was compared (the ranks' summed checksum of the tokens and
    layers against the one the prefill carried) and what was found (the totals differ,
    or they agree but the consumer's replicas of the same KV do not)."""
    what = "replicas disagree" if total == carried.total else "mismatch"
    totals = "the totals agree" if total == carried.total else "the totals differ"
    replicas = "disagree" if residual else "agree"
    found = f"{totals}; the consumer's replicas {replicas} (replica_residual={residual:#x})"
    return (
        f"kvaudit KV checksum {what} req={rid} tokens={carried.first}..{carried.end} "
        f"layers={_layers_text(carried.layers)}: compared the checksum of these tokens and "
        f"layers summed over every rank with the one the prefill carried: "
        f"expected={carried.total:#018x} got={total:#018x}; {found}"
    )


def _failed_groups(carried: Carried, parts: list[list[int]]) -> str:
    """`` groups=ID,...`` naming the groups whose sums differ (every rank's group sums
    summed against the carried group words); "" for a pool of one group."""
    if not carried.groups:
        return ""
    failed = [
        str(group_id)
        for k, (group_id, _, expected) in enumerate(carried.groups)
        if sum(part[k] for part in parts) % MOD64 != expected
    ]
    return f" groups={','.join(failed) or 'none (the replicas)'}"


def record_verdict(
    scheduler: Any,
    req: Any,
    verdict: Verdict,
    kept: tuple[RequestBlocks, WorkerRecord | None] | None,
    unreadable: Unverified | None,
    held: LayerSpan | None,
) -> None:
    """Count, log and write one request's verdict (the output folder: this rank's
    checksums, and a dump on a mismatch).

    Args:
        scheduler: The decode scheduler.
        req: The SGLang request.
        verdict: Its verdict (``judge``).
        kept: The request's blocks and this rank's record of it, where it was compared
            here (None: nothing to write).
        unreadable: Why a rank's row of it could not be read (None: every row could).
        held: The layers every rank holds (None where the ranks differ).

    """
    if kept is not None:
        blocks, record = kept
        write_output(scheduler, CONSUMER, req.rid, record, blocks, dump=bool(verdict.failed))
    if verdict.failed:
        logger.error("; ".join(verdict.failed))
        STATS.mismatched += 1
        return
    if unreadable is not None:  # compared equal where readable: still never verified
        count_unverified(req, unreadable.reason, unreadable.detail)
        return
    problem = verdict.problem
    if not verdict.verified:
        count_unverified(req, problem or "not comparable")
        return
    covered = {layer for first, end in verdict.verified for layer in range(first, end)}
    if held is not None and covered == set(range(*held)) and problem is None:
        STATS.verified += 1
        return
    spans = ", ".join(_layers_text(span) for span in verdict.verified)
    reason = f"verified on layers {spans} of {_layers_text(held) if held else '?'} only" + (
        f"; the rest: {problem}"
        if problem
        else ": the prefill's PP stages each send "
        "their own row and this decode kept the last to arrive"
    )
    STATS.partial += 1
    STATS.reasons[reason] += 1
    if first_time(reason):  # keyed by the reason: the set stays bounded
        logger.warning("kvaudit: request %s %s (logged once per reason)", req.rid, reason)
