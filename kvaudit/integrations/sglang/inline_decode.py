"""The decode side of the inline check: the checksum row kept when a transfer is
committed, then, before the request joins a batch, what the ranks' rows carried
gathered (one collective), each rank's part of the same tokens checksummed over each
carried stage's layers, and the sums gathered (a second collective) and judged
(``inline_verdicts``); a mismatch aborted through SGLang's own path."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from sglang.srt.disaggregation.checksum import is_health_check_req

from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from . import hooked
from .carried import (
    MALFORMED,
    MAX_GROUPS,
    MOD64,
    MOMENTS,
    STRONG,
    Carried,
    Unverified,
    group_row,
    layer_word,
    read_carried,
    read_groups,
    room_bits,
    signature_word,
    split_group_row,
    split_layer_word,
)
from .inline_state import rank_checksummer
from .inline_verdicts import (
    COARSE,
    COMPARED,
    DESCRIBED_APART,
    NOT_COMPARED,
    PART,
    judge,
    record_unverified,
    record_verdict,
)
from .pools import NotDescribable
from .ranks import CONSUMER, RankChecksummer, block_sums, gather_ranks
from .state import SchedulerState, state_of

if TYPE_CHECKING:
    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler


def commit_carried(queue: DecodeTransferQueue, decode_req: DecodeRequest) -> None:
    """On the decode, when a transfer is committed: keep what the row carries in the
    scheduler's state, by request id (before SGLang's ``clear_slot`` zeroes the row).

    Args:
        queue: The decode's transfer queue (its ``scheduler`` holds kvaudit's state).
        decode_req: The request whose transfer is committed.

    """
    try:
        state = state_of(hooked.read(queue, hooked.QUEUE_SCHEDULER))
    except hooked.NotInThisSglang as missing:
        # Without the scheduler's state there is nowhere to keep the row: none is checked.
        hooked.report(missing, "kvaudit's inline check does not run on this decode")
        return
    try:
        carried = read_carried(queue.metadata_buffers, decode_req.metadata_buffer_index)
        if isinstance(carried, Carried):
            groups = read_groups(queue.metadata_buffers, decode_req.metadata_buffer_index)
            carried = dataclasses.replace(carried, groups=groups)
    except Exception as error:
        carried = Unverified("checksum row unreadable", str(error))
    try:
        state.keep(str(decode_req.req.rid), carried)
    except Exception:  # the request arrives without a checksum
        state.log_fault("keeping the checksum row")


NOTHING, CARRIED, UNREADABLE = 0, 1, 2
"""Kinds of a rank's row in the first gather: nothing to verify (no kvaudit checksum
expected: a health check, a request SGLang's own path did not commit), a carried checksum,
a row that cannot be used (unverified, with a reason on the rank that holds it)."""


ROW = 1 + 1 + MOMENTS + 4 + 2 * MAX_GROUPS
"""Words of a rank's row in the first gather: ``[kind, unit, sum_0 .. sum_2, first, end,
signature, layers, *group words]`` (a seed-lane row: unit 0, its sum in ``sum_0``; the
group words ``group_row``'s, zeros for a pool of one group)."""


def _carried_row(state: SchedulerState, req: Req) -> tuple[list[int], Unverified | None]:
    """This rank's ``ROW`` words for ``req`` in the first gather and why it is
    ``UNREADABLE``; the request's carried value is taken (verified once: a retraction
    re-enters the batch).

    Raises:
        ValueError: A carried value that cannot be put in the gather (a range or layers
            no kvaudit prefill writes).

    """
    carried = state.take(str(req.rid))
    if carried is None:
        return [NOTHING] * ROW, None
    if is_health_check_req(req):
        state.counts.skipped += 1
        return [NOTHING] * ROW, None
    if isinstance(carried, Unverified):
        return [UNREADABLE] + [0] * (ROW - 1), carried
    c = carried
    sums = [*c.sums, *[0] * (MOMENTS - len(c.sums))]
    row = [CARRIED, c.unit, *sums, c.first, c.end, c.signature, layer_word(c.layers, c.room)]
    row += group_row(c.groups)
    if (
        len(row) != ROW
        or not all(isinstance(v, int) and 0 <= v < MOD64 for v in row)
        or not c.first < c.end
    ):
        raise ValueError(f"words {row[1:9]} do not fit a checksum row")
    return row, None


def _carried_rows(
    state: SchedulerState, reqs: list[Req]
) -> tuple[list[list[int]], dict[int, Unverified]]:
    """This rank's words per request for the first gather (``_carried_row``), and why
    each ``UNREADABLE`` one is. Never raises: a request whose row cannot be read is
    unverified on its own, so every rank sends one row per request whatever it holds."""
    rows: list[list[int]] = []
    reasons: dict[int, Unverified] = {}
    for i, req in enumerate(reqs):
        try:
            row, why = _carried_row(state, req)
        except Exception as error:  # this request only: the batch's others go on
            row, why = [UNREADABLE] + [0] * (ROW - 1), Unverified(MALFORMED, str(error))
        if why is not None:
            reasons[i] = why
        rows.append(row)
    return rows, reasons


def _candidates(parts: list[list[list[int]]], i: int) -> tuple[list[Carried], bool]:
    """The distinct values the ranks' rows carried for request ``i``, in rank order (the
    decode's TP ranks may each have kept another prefill stage's row), and whether some
    rank's row was ``UNREADABLE``. A pure function of the gathered words: every rank
    gets the same answer."""
    seen: list[Carried] = []
    unreadable = False
    for part in parts:
        kind, unit, *sums, first, end, signature, word = part[i][: ROW - 2 * MAX_GROUPS]
        if kind == CARRIED:
            layers, room = split_layer_word(word)
            if not (layers[0] < layers[1] and first < end):
                unreadable = True  # never sent by a kvaudit rank; checked all the same
                continue
            carried_sums = tuple(sums) if unit else (sums[0],)
            groups = split_group_row(part[i][ROW - 2 * MAX_GROUPS :])
            carried = Carried(carried_sums, first, end, signature, layers, room, unit, groups)
            if carried not in seen:
                seen.append(carried)
        elif kind != NOTHING:
            unreadable = True
    return seen, unreadable


class DescribedApart(Exception):
    """A group the prefill and this decode describe differently (another dtype, shape,
    split or layers): a mismatch named by group, never a request admitted unverified."""


def _groups_apart(summer: RankChecksummer, carried: Carried) -> str | None:
    """The groups whose signatures differ between the carried words and this decode's
    description, as one line (None: the carried groups are this decode's)."""
    mine = summer.group_signatures
    theirs = {group_id: signature for group_id, signature, _ in carried.groups}
    if not carried.groups or mine == theirs:
        return None
    apart = []
    for group_id in sorted({*mine, *theirs}):
        if mine.get(group_id) == theirs.get(group_id):
            continue
        (group,) = [g for g in summer.raw["groups"] if g["id"] == group_id] or [None]
        if group is None or group_id not in theirs:
            side = "the decode" if group is None else "the prefill"
            apart.append(f"group {group_id} missing on {side}")
            continue
        spec = group["spec"]
        held = [
            layer.get("spec", {}).get("dtypes", spec.get("dtypes", [spec.get("dtype")]))
            if isinstance(layer, dict)
            else spec.get("dtypes", [spec.get("dtype")])
            for layer in group["layers"]
        ]
        dtypes = sorted({str(d) for layer in held for d in layer})
        apart.append(
            f"group {group_id} ({spec['type']}) described apart: the decode holds "
            f"{len(group['layers'])} layers of {'/'.join(dtypes)}"
        )
    return "; ".join(apart)


def _consumer_part(
    scheduler: Scheduler, req: Req, carried: Carried
) -> tuple[list[int], RequestBlocks, WorkerRecord | None]:
    """This decode rank's part of the checksum of what ``carried`` covers: its row of the
    second gather (``[COMPARED or COARSE, moments (3), residual moments (2), group sums
    (MAX_GROUPS), state]`` for the strong lane, ``[COMPARED, total, residual, 0, ...]``
    for the seed lane), the blocks, and the record, kept when it covers every layer of
    the pool. The group sums are each carried group's strong-lane sum, in the order of
    the carried group words; ``state``: 1 where the pool has a state group (its block
    weighted 0 in the moments, a unit ``-1`` the moments can name).

    Raises:
        DescribedApart: A group described differently here than on the prefill.
        NotDescribable: What the row carried cannot be compared here (another signature,
            page size, range or layers); the message says why.

    """
    whole = rank_checksummer(scheduler, CONSUMER)
    summer = whole if carried.layers == whole.layers else None
    if summer is None:
        summer = rank_checksummer(scheduler, CONSUMER, carried.layers)
    apart = _groups_apart(summer, carried)
    if apart is not None:
        raise DescribedApart(apart)
    signature = signature_word(summer.signature, carried.lane)
    if carried.signature != signature:
        raise NotDescribable(
            f"content signature {carried.signature:#x} differs from this decode's "
            f"{signature:#x} (layers, heads, head size or dtype)"
        )
    if carried.first % summer.page_size:
        raise NotDescribable(
            f"range start {carried.first} is not a block boundary of the decode "
            f"(page size {summer.page_size})"
        )
    if carried.room != room_bits(req.bootstrap_room):
        raise NotDescribable(
            f"the row carries bootstrap room {carried.room:#x}, this request's is "
            f"{room_bits(req.bootstrap_room):#x} (low 32 bits): another transfer's row"
        )
    tokens = len(req.origin_input_ids)
    if not carried.first < carried.end == tokens:
        raise NotDescribable(
            f"range {carried.first}..{carried.end} does not end at the request's {tokens} tokens"
        )
    held = hooked.read_or_none(req.kv, hooked.CACHE_PROTECTED, "its requests are unverified")
    if held is None or carried.first != int(held):
        # The prefill rounds the decode's prefix down to its own page: tokens before
        # cache_protected_len are the decode's own cached prefix, never sent.
        raise NotDescribable(
            f"range start {carried.first} is not where this decode's cached prefix ends "
            f"({held} tokens): the first page holds tokens the decode did not receive"
        )
    pool = scheduler.req_to_token_pool
    blocks = summer.request_range(pool, req.kv.req_pool_idx, carried.first, carried.end)
    record = summer.range_record(req.rid, blocks)
    kept = record if summer is whole else None
    if carried.lane != STRONG:
        # An older prefill's row: its seed-lane total over every group (no group words).
        total, residual = block_sums(record, req.rid, None)
        return [COMPARED, total, residual] + [0] * (PART - 3), blocks, kept
    page = summer.page_size
    groups = [summer.moments(record, req.rid, page, g)[0][0] for g, _, _ in carried.groups]
    tail = [*groups, *[0] * (MAX_GROUPS - len(groups)), int(bool(summer.state_groups))]
    if carried.unit % page:
        # Pages coarser than the prefill's: the moments' weights cannot be split; the
        # unweighted sum over the range (the moment of order 0) is compared alone.
        moments, residuals = summer.moments(record, req.rid, page)
        return [COARSE, moments[0], 0, 0, *residuals, *tail], blocks, kept
    moments, residuals = summer.moments(record, req.rid, carried.unit)
    return [COMPARED, *moments, *residuals, *tail], blocks, kept


def abort_mismatched(
    scheduler: Scheduler, batch: ScheduleBatch, mismatched: list[tuple[int, str]]
) -> list[int]:
    """Abort each mismatched request through SGLang's ``_handle_kv_checksum_mismatch``
    (which raises in SGLang's CI, as for its own check) and filter them from the batch.

    Args:
        scheduler: The decode scheduler.
        batch: The prebuilt batch ``decode_checks`` checked.
        mismatched: ``(index into the batch, message)`` per mismatched request.

    Returns:
        The indices of the aborted requests.

    """
    aborted = [i for i, _ in mismatched]
    if not aborted:
        return []
    reqs = list(batch.reqs)
    handle = hooked.read_or_none(
        scheduler,
        hooked.HANDLE_MISMATCH,
        "a mismatched request is filtered from the batch without SGLang's abort",
    )
    try:
        for i, msg in mismatched:
            if handle is not None:
                handle(reqs[i], msg)
    finally:  # the KV of an aborted request is released: never computed on
        batch.filter_batch(keep_indices=[i for i in range(len(reqs)) if i not in aborted])
    return aborted


PEER_UNREADABLE = "checksum row unreadable on a peer rank"


def _held_row(scheduler: Scheduler) -> list[int]:
    """This rank's layers for the second gather: ``[1, first, end]``, or zeros where its
    pool cannot be described."""
    try:
        first, end = rank_checksummer(scheduler, CONSUMER).layers
        return [1, int(first), int(end)] if 0 <= first < end < MOD64 else [0, 0, 0]
    except Exception:
        return [0, 0, 0]


def decode_checks(scheduler: Scheduler, batch: ScheduleBatch) -> list[tuple[int, str]]:
    """On every decode attention TP rank (two collectives over ``attn_tp_cpu_group``, made
    whenever the batch has requests, so the ranks stay in step): verify each request of
    the batch that carries a kvaudit checksum, once; count, log and write the verdicts.
    Aborting is ``abort_mismatched``'s.

    Every rank takes part in the same collectives with the same shapes whatever its rows
    hold (a row that cannot be read is sent as ``UNREADABLE``), and every verdict is a
    function of the gathered values only, so the ranks agree on each request: a
    mismatch on any rank aborts it on all; a row unreadable on any rank leaves it
    unverified on all (never verified), the batch's other requests checked as usual.

    Args:
        scheduler: The decode scheduler.
        batch: The prebuilt batch, after SGLang's own check.

    Returns:
        ``(index into the batch, message)`` per mismatched request.

    """
    reqs = list(batch.reqs)
    if not reqs:
        return []
    state = state_of(scheduler)
    group = hooked.read(scheduler, hooked.ATTN_TP_CPU_GROUP)
    local, reasons = _carried_rows(state, reqs)
    parts = gather_ranks(local, group)  # what every rank's row carried
    plans: dict[int, list[Carried]] = {}
    unreadable: dict[int, Unverified] = {}
    for i in range(len(reqs)):
        plans[i], bad = _candidates(parts, i)
        if bad:
            unreadable[i] = reasons.get(i, Unverified(PEER_UNREADABLE))
    # Counted once no collective is left (nothing of this rank's may come between two).
    alone = [(reqs[i], unreadable[i]) for i in unreadable if not plans[i]]
    checks = [(i, carried) for i in range(len(reqs)) for carried in plans[i]]
    if not checks:
        record_unverified(state, alone)
        return []
    mine: list[list[int]] = []
    errors: dict[int, str] = {}
    kept: dict[int, tuple[RequestBlocks, WorkerRecord | None]] = {}
    for n, (i, carried) in enumerate(checks):
        try:
            row, blocks, record = _consumer_part(scheduler, reqs[i], carried)
        except DescribedApart as error:  # a mismatch, named by group
            errors[n] = str(error)
            mine.append([DESCRIBED_APART] + [0] * (PART - 1))
            continue
        except Exception as error:  # not compared, with the reason
            errors[n] = str(error)
            mine.append([NOT_COMPARED] + [0] * (PART - 1))
            continue
        kept.setdefault(i, (blocks, record))
        mine.append(row)
    # Every rank's part of every check, and the layers each rank holds last: a verdict
    # of "every layer" is then the same on every rank.
    gathered = gather_ranks([*mine, [*_held_row(scheduler), *[0] * (PART - 3)]], group)
    sums = [part[:-1] for part in gathered]
    helds = [part[-1] for part in gathered]
    held = (helds[0][1], helds[0][2]) if all(h == helds[0] and h[0] for h in helds) else None
    numbered: dict[int, list[int]] = {}
    for n, (i, _) in enumerate(checks):
        numbered.setdefault(i, []).append(n)
    # The verdicts first, from the gathered values only (the same on every rank), so that
    # what the ranks abort is agreed whatever happens to this rank's counting after it.
    verdicts = {
        i: judge(reqs[i].rid, checks, numbers, sums, errors) for i, numbers in numbered.items()
    }
    mismatched = [(i, "; ".join(v.failed)) for i, v in verdicts.items() if v.failed]
    record_unverified(state, alone)
    for i, verdict in verdicts.items():
        try:
            record_verdict(scheduler, reqs[i], verdict, kept.get(i), unreadable.get(i), held)
        except Exception:  # counting and logging only: the verdict stands
            state.log_fault("recording the decode's verdicts")
    return mismatched
