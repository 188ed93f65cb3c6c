"""The decode's verdicts on the requests it checked: each request's outcome from every
rank's parts of its checks, then counted, logged and written to the output folder
(verified, verified on some layers only, mismatched or unverified)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...core.scheme import STRONG_PRIME
from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from .carried import MAX_GROUPS, MOD64, MOMENTS, STRONG, Carried, Unverified, locate
from .inline_state import write_output
from .ranks import CONSUMER, LayerSpan
from .state import SchedulerState, logger, state_of

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler


def _layers_text(layers: LayerSpan) -> str:
    """A span of layers as the log lines write it, ``first..last``."""
    return f"{layers[0]}..{layers[1] - 1}"


def record_unverified(state: SchedulerState, requests: list[tuple[Req, Unverified]]) -> None:
    """Count the requests no rank carried a usable value for, each with its reason.

    Args:
        state: The decode scheduler's state (its counts).
        requests: ``(request, why it is unverified)`` pairs.

    """
    try:
        for req, why in requests:
            state.count_unverified(req.rid, why.reason, why.detail)
    except Exception:  # counting and logging only
        state.log_fault("recording the decode's verdicts")


COMPARED, NOT_COMPARED, COARSE, DESCRIBED_APART = 1, 2, 3, 4
"""Kinds of a rank's part of a check in the second gather: compared (the strong lane's
moments, or the seed lane's sum), not compared on that rank, compared by the strong
lane's unweighted sum alone (the decode's pages coarser than the prefill's units), a
group the decode describes differently from the prefill (another dtype, shape or split:
a mismatch)."""
GROUP_SUMS = 1 + MOMENTS + 2
"""Where a part's group sums start."""
PART = GROUP_SUMS + MAX_GROUPS + 1
"""Words of a rank's part of a check: ``[kind, moments (3), residual moments (2), group
sums (MAX_GROUPS), state]`` (group sums: each carried group's strong-lane sum; ``state``:
1 where the pool has a state group, its block the unit ``-1``), or ``[kind, total,
residual, 0, ...]`` for the seed lane."""
SEED_ONLY = "compared by the seed lane only (the prefill's kvaudit carries no strong lane)"
COARSE_ONLY = (
    "compared by the strong lane's sum over the range only (the decode's pages are coarser "
    "than the prefill's): a mismatch is not located"
)


@dataclass
class Verdict:
    """One request's outcome over the checks of what its rows carried: the layer spans
    that agreed, the mismatch lines, why a check was not compared, and what the
    comparison could not do (``notes``: logged once each)."""

    verified: list[LayerSpan] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    problem: str | None = None
    notes: list[str] = field(default_factory=list)


def _units_text(units: list[int], unit: int, first: int, end: int) -> str:
    """Differing units as the mismatch line names them: the prefill's blocks and tokens,
    and ``the state`` (unit ``-1``: a state group's block, of no tokens)."""
    named = []
    pages = [j for j in units if j >= 0]
    if pages:
        noun = "block" if len(pages) == 1 else "blocks"
        spans = ", ".join(f"{max(j * unit, first)}..{min((j + 1) * unit, end) - 1}" for j in pages)
        named.append(f"{noun} {', '.join(map(str, pages))} (tokens {spans}, {unit}-token blocks)")
    if -1 in units:
        named.append("the state")
    verb = "differs" if len(units) == 1 else "differ"
    return f"{' and '.join(named)} {verb}"


def _strong_check(
    rid: str, carried: Carried, parts: list[list[int]], coarse: bool
) -> tuple[str | None, list[str]]:
    """One strong-lane check from the ranks' parts: its mismatch line (None: it agrees;
    a hybrid pool's ends with the groups whose sums differ) and its notes."""
    prime = STRONG_PRIME
    got = [sum(part[1 + m] for part in parts) % prime for m in range(MOMENTS)]
    residual = [sum(part[1 + MOMENTS + m] for part in parts) % prime for m in range(2)]
    differences = [(c - g) % prime for c, g in zip(carried.sums, got, strict=True)]
    notes = [COARSE_ONLY] if coarse else []
    if coarse:
        differences[1:] = [0] * (MOMENTS - 1)
    if not any(differences) and not any(residual):
        return None, notes
    head = f"req={rid} tokens={carried.first}..{carried.end} layers={_layers_text(carried.layers)}"
    tail = f"expected={carried.sums[0]:#018x} got={got[0]:#018x} replica_residual={residual[0]:#x}"
    tail += _failed_groups(carried, [part[GROUP_SUMS:] for part in parts])
    if not any(differences):
        found = "the blocks agree with the prefill's; the consumer's replicas disagree"
        return f"kvaudit KV checksum replicas disagree {head} {found} {tail}", notes
    unit = carried.unit
    # A state group's block (weight 0) is the unit -1: the moments name it as any other.
    state = [-1] if any(part[PART - 1] for part in parts) else []
    units = state + list(range(carried.first // unit, -(-carried.end // unit)))
    located = None if coarse else locate(differences, units)
    if located:
        where = _units_text(located, unit, carried.first, carried.end)
    elif coarse:
        where = "the range differs (not located: the decode's pages are coarser)"
    else:
        where = "more than one block differs (not located)"
    return f"kvaudit KV checksum mismatch {head} {where} (strong lane) {tail}", notes


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
        sums: Per rank, its ``PART`` words of every check (kind ``NOT_COMPARED``: not
            compared on that rank; ``DESCRIBED_APART``: a group described apart).
        errors: This rank's reasons, by check, for the checks it could not compare.

    Returns:
        The request's verdict.

    """
    verdict = Verdict()
    for n in numbers:
        carried = checks[n][1]
        kinds = {part[n][0] for part in sums}
        if DESCRIBED_APART in kinds:
            verdict.failed.append(
                f"kvaudit KV description mismatch req={rid} "
                f"tokens={carried.first}..{carried.end} "
                f"layers={_layers_text(carried.layers)}: "
                + errors.get(n, "a group is described apart on a peer rank")
            )
            continue
        if NOT_COMPARED in kinds:
            verdict.problem = verdict.problem or errors.get(n, "not comparable on a peer rank")
            continue
        if carried.lane == STRONG:
            line, notes = _strong_check(rid, carried, [part[n] for part in sums], COARSE in kinds)
            verdict.notes.extend(note for note in notes if note not in verdict.notes)
            if line is None:
                verdict.verified.append(carried.layers)
            else:
                verdict.failed.append(line)
            continue
        if SEED_ONLY not in verdict.notes:
            verdict.notes.append(SEED_ONLY)
        total = sum(part[n][1] for part in sums) % MOD64
        residual = sum(part[n][2] for part in sums) % MOD64
        if total == carried.sums[0] and residual == 0:
            verdict.verified.append(carried.layers)
            continue
        verdict.failed.append(_failed_line(rid, carried, total, residual))
    return verdict


def _failed_line(rid: str, carried: Carried, total: int, residual: int) -> str:
    """A mismatch line of a seed-lane row (an older prefill's): what was compared (the
    ranks' summed seed checksum of the tokens and layers against the one the prefill
    carried) and what was found (the totals differ, or they agree but the consumer's
    replicas of the same KV do not)."""
    expected = carried.sums[0]
    what = "replicas disagree" if total == expected else "mismatch"
    totals = "the totals agree" if total == expected else "the totals differ"
    replicas = "disagree" if residual else "agree"
    found = f"{totals}; the consumer's replicas {replicas} (replica_residual={residual:#x})"
    return (
        f"kvaudit KV checksum {what} req={rid} tokens={carried.first}..{carried.end} "
        f"layers={_layers_text(carried.layers)}: compared the checksum of these tokens and "
        f"layers summed over every rank with the one the prefill carried: "
        f"expected={expected:#018x} got={total:#018x}; {found}; {SEED_ONLY}"
    )


def _failed_groups(carried: Carried, parts: list[list[int]]) -> str:
    """`` groups=ID,...`` naming the groups whose strong-lane sums differ (every rank's
    group sums added modulo ``2**64 - 59`` against the carried group words); "" without
    group words (a pool of one group, or none arrived)."""
    if not carried.groups:
        return ""
    failed = [
        str(group_id)
        for k, (group_id, _, expected) in enumerate(carried.groups)
        if sum(part[k] for part in parts) % STRONG_PRIME != expected
    ]
    return f" groups={','.join(failed) or 'none (the replicas)'}"


def record_verdict(
    scheduler: Scheduler,
    req: Req,
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
    state = state_of(scheduler)
    if kept is not None:
        blocks, record = kept
        write_output(scheduler, CONSUMER, req.rid, record, blocks, dump=bool(verdict.failed))
    for note in verdict.notes:
        if state.first_time(note):  # keyed by the note: the set stays bounded
            logger.warning("kvaudit: request %s %s (logged once)", req.rid, note)
    if verdict.failed:
        logger.error("; ".join(verdict.failed))
        state.counts.mismatched += 1
        return
    if unreadable is not None:  # compared equal where readable: still never verified
        state.count_unverified(req.rid, unreadable.reason, unreadable.detail)
        return
    problem = verdict.problem
    if not verdict.verified:
        state.count_unverified(req.rid, problem or "not comparable")
        return
    covered = {layer for first, end in verdict.verified for layer in range(first, end)}
    if held is not None and covered == set(range(*held)) and problem is None:
        state.counts.verified += 1
        return
    spans = ", ".join(_layers_text(span) for span in verdict.verified)
    reason = f"verified on layers {spans} of {_layers_text(held) if held else '?'} only" + (
        f"; the rest: {problem}"
        if problem
        else ": the prefill's PP stages each send "
        "their own row and this decode kept the last to arrive"
    )
    state.counts.partial += 1
    state.counts.reasons[reason] += 1
    if state.first_time(reason):  # keyed by the reason: the set stays bounded
        logger.warning("kvaudit: request %s %s (logged once per reason)", req.rid, reason)
