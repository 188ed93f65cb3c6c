"""kvaudit's verification of an SGLang prefill/decode KV transfer, inline, at the points
SGLang's own ``--disaggregation-enable-kv-checksum`` uses (docs/sglang.md, "Inline
verification").

SGLang's own digest (Adler-32 of one rank's bytes plus a layout signature) compares only
when the prefill's layout equals the decode's; any other TP width or a PP stage is
admitted unverified. kvaudit's checksum adds up across TP ranks and ignores pages and
layout, so:

* on the prefill, before a request's last chunk is sent (``send_kv_chunk``), every
  attention TP rank of a PP stage checksums its part of the request's tokens over the
  stage's layers, the per-block totals over the range are summed and all-gathered (mod
  2**64) over the attention TP CPU group, and every rank writes the same words into the
  spare words of the request's checksum row (``carried``), which travels with the last
  chunk; the stages do not communicate (their pipeline reaches a request's last chunk at
  different times), so each stage's row carries its own layers;
* on the decode, the row is read when the transfer is committed (``_commit_transfer_to_
  req``, before ``clear_slot`` zeroes it), and before the request joins a batch
  (``_verify_kv_checksums``) the decode's attention TP ranks gather what their rows
  carried (one collective), each checksums its part of the same tokens over each carried
  stage's layers, and the sums are gathered (a second collective) and compared; a
  mismatch goes through SGLang's own ``_handle_kv_checksum_mismatch`` (abort,
  transfer-failed counter). A request is verified when the carried layers are every layer
  the decode holds, and counted as ``partial`` (never as verified) when they are fewer (a
  PP prefill whose stages' rows overwrote one another on a decode with fewer stages).
  A row that cannot be read (empty or inverted ranges, another kvaudit version) leaves its
  request unverified, never the batch; every rank makes the same collectives whatever
  its rows hold, and the verdicts come from the gathered values, so the ranks agree.

With ``KVAUDIT_SGLANG_OUTPUT`` set, each process writes its checksums and bounded dumps
into the engine's output folder (``recording``). The hooks are installed by
``plugin.register()``, kvaudit's ``sglang.srt.plugins`` entry point. This module imports SGLang;
kvaudit's own modules never import it.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.disaggregation.checksum import is_health_check_req

from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from .carried import (
    MALFORMED,
    MOD64,
    Carried,
    Unverified,
    layer_word,
    read_carried,
    room_bits,
    split_layer_word,
    write_carried,
)
from .describe import NotDescribable
from .ranks import (
    CONSUMER,
    PRODUCER,
    LayerSpan,
    RankChecksummer,
    attention_tp,
    block_sums,
    gather_ranks,
    group_sums,
    pipeline_ranks,
)
from .recording import Recorder, settings_from_environment

logger = logging.getLogger(__name__)

ATTRIBUTE = "kvaudit_carried"
"""The attribute of a decode ``Req`` that holds what its checksum row carried."""

PREFILL_TARGET = (
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk"
)
COMMIT_TARGET = "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req"
VERIFY_TARGET = (
    "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._verify_kv_checksums"
)


@dataclass
class InlineStats:
    """This process's counts: requests verified, verified on some layers only (partial),
    caught (aborted), unverified and health checks skipped, with the reasons of the
    unverified and partial ones; prefill rows written and left empty; dumps written."""

    verified: int = 0
    partial: int = 0
    mismatched: int = 0
    unverified: int = 0
    skipped: int = 0
    written: int = 0
    not_written: int = 0
    dumps_written: int = 0
    reasons: Counter = field(default_factory=Counter)


STATS = InlineStats()
_logged: set[str] = set()


def inline_stats() -> dict[str, Any]:
    """A snapshot of this process's counts (``InlineStats`` as a dict)."""
    return {
        "verified": STATS.verified,
        "partial": STATS.partial,
        "mismatched": STATS.mismatched,
        "unverified": STATS.unverified,
        "skipped": STATS.skipped,
        "written": STATS.written,
        "not_written": STATS.not_written,
        "dumps_written": STATS.dumps_written,
        "reasons": dict(STATS.reasons),
    }


def reset_inline_stats() -> None:
    """Zero the counts and forget which reasons were logged."""
    global STATS
    STATS = InlineStats()
    _logged.clear()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("kvaudit: %s", message)


def rank_checksummer(scheduler: Any, role: str, layers: LayerSpan | None = None) -> RankChecksummer:
    """The scheduler's ``RankChecksummer`` of ``role`` over ``layers`` (default: every
    layer of its pool), built once per pool and span (the pool's buffers stay put)."""
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    cached = getattr(scheduler, "_kvaudit_rank_checksummers", None)
    if cached is None or cached[0] is not pool:
        cached = (pool, {})
        scheduler._kvaudit_rank_checksummers = cached
    key = (role, layers)
    if key not in cached[1]:
        _, tp_rank, tp_size = attention_tp(scheduler)
        pp_rank, pp_size = pipeline_ranks()
        total = scheduler.model_config.get_total_num_kv_heads()
        cached[1][key] = RankChecksummer(
            pool,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            total_kv_heads=int(total),
            role=role,
            layers=layers,
        )
    return cached[1][key]


def recorder(scheduler: Any, role: str) -> Recorder | None:
    """The scheduler's writer into its output folder (None without
    ``KVAUDIT_SGLANG_OUTPUT``), built once."""
    cached = getattr(scheduler, "_kvaudit_recorder", None)
    if cached is not None and cached[0] == role:
        return cached[1]
    settings = settings_from_environment()
    built = None
    if settings.output is not None:
        summer = rank_checksummer(scheduler, role)
        built = Recorder(settings, summer.worker, summer.description, summer.raw, summer.tensors)
    scheduler._kvaudit_recorder = (role, built)
    return built


def _write_output(
    scheduler: Any,
    role: str,
    request: str,
    record: WorkerRecord | None,
    blocks: RequestBlocks,
    dump: bool,
) -> None:
    """Append the request's checksums (``record``, or computed over every layer of the
    pool when None) to the output folder and dump it when ``dump`` (a decode: on a
    mismatch; a prefill: with rotating dumps). Never raises: a failure is logged once."""
    try:
        writer = recorder(scheduler, role)
        if writer is None:
            return
        if record is None:
            record = rank_checksummer(scheduler, role).range_record(request, blocks)
        writer.checksums(record, request)
        rotating = role == PRODUCER
        if rotating and not writer.settings.rotate_dumps:
            return
        if dump and writer.dump(request, blocks, rotating=rotating) is not None:
            STATS.dumps_written += 1
    except Exception as error:  # the engine goes on; the output folder lacks the request
        _log_once(f"output folder not written: {error}")


def prefill_range(req: Any, page_size: int, end_idx: int | None) -> tuple[int, int]:
    """The tokens a prefill checksums: from the decode's prefix rounded down to a page,
    to the end SGLang's own digest uses."""
    end = end_idx if end_idx is not None else min(req.extend_end, len(req.origin_input_ids))
    first = (int(req.disagg_decode_prefix_len) // page_size) * page_size
    return first, int(end)


def prefill_checksum(scheduler: Any, req: Any, end_idx: int | None = None) -> Carried | None:
    """On every attention TP rank of a prefill stage (a collective over
    ``attn_tp_cpu_group``): checksum this rank's part of the request's range over the
    stage's layers, sum over the ranks, and write the result into the request's checksum
    row (zeros where nothing can be carried); with an output folder, append this rank's
    checksums (and, with rotating dumps, dump the request).

    Returns:
        What was written, or None for an empty row.

    """
    buffers = scheduler.disagg_metadata_buffers
    if getattr(buffers, "kv_checksum", None) is None:
        _log_once("no checksum row: start both engines with --disaggregation-enable-kv-checksum")
        return None
    index = req.metadata_buffer_index
    if is_health_check_req(req):
        write_carried(buffers, index, None)
        return None
    status, total, first, end, signature, layers = 0, 0, 0, 0, 0, (0, 0)
    record: WorkerRecord | None = None
    blocks: RequestBlocks | None = None
    try:
        summer = rank_checksummer(scheduler, PRODUCER)
        first, end = prefill_range(req, summer.page_size, end_idx)
        row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        blocks = summer.range_blocks(row, first, end)
        record = summer.range_record(req.rid, blocks)
        total, _ = block_sums(record, req.rid)
        signature, layers = summer.signature, summer.layers
    except Exception as error:  # the request is sent, unverified
        status = 1
        _log_once(f"prefill checksum not carried: {error}")
    group = getattr(scheduler, "attn_tp_cpu_group", None)
    ((status, total),) = group_sums([[status, total]], group)
    if status:
        STATS.not_written += 1
        write_carried(buffers, index, None)
        return None
    carried = Carried(total, first, end, signature, layers, room_bits(req.bootstrap_room))
    write_carried(buffers, index, carried)
    STATS.written += 1
    assert blocks is not None
    _write_output(scheduler, PRODUCER, req.rid, record, blocks, dump=True)
    return carried


def commit_carried(queue: Any, decode_req: Any) -> None:
    """On the decode, when a transfer is committed: keep what the row carries on the
    request (before SGLang's ``clear_slot`` zeroes it)."""
    try:
        carried = read_carried(queue.metadata_buffers, decode_req.metadata_buffer_index)
    except Exception as error:
        carried = Unverified("checksum row unreadable", str(error))
    try:
        setattr(decode_req.req, ATTRIBUTE, carried)
    except Exception:  # a request that takes no attribute arrives without a checksum
        _failed("keeping the checksum row")


def _unverified(req: Any, reason: str, detail: str = "") -> None:
    """Count ``req`` unverified for ``reason``; log it once per reason (the first
    request's id and ``detail`` with it), so the log and the set of logged lines stay
    bounded however many requests arrive."""
    STATS.unverified += 1
    STATS.reasons[reason] += 1
    if reason not in _logged:
        _logged.add(reason)
        logger.warning(
            "kvaudit: request %s admitted unverified: %s%s (logged once per reason)",
            req.rid,
            reason,
            f" ({detail})" if detail else "",
        )


NOTHING, CARRIED, UNREADABLE = 0, 1, 2
"""Kinds of a rank's row in the first gather: nothing to verify (no kvaudit checksum
expected: a health check, a request SGLang's own path did not commit), a carried checksum,
a row that cannot be used (unverified, with a reason on the rank that holds it)."""


def _carried_row(req: Any) -> tuple[list[int], Unverified | None]:
    """This rank's six words for ``req`` in the first gather, ``[kind, total, first, end,
    signature, layers]``, and why it is ``UNREADABLE``; the request's carried value is
    taken (verified once: a retraction re-enters the batch).

    Raises:
        ValueError: A carried value that cannot be put in the gather (a range or layers
            no kvaudit prefill writes).

    """
    carried = getattr(req, ATTRIBUTE, None)
    setattr(req, ATTRIBUTE, None)
    if carried is None:
        return [NOTHING] * 6, None
    if is_health_check_req(req):
        STATS.skipped += 1
        return [NOTHING] * 6, None
    if isinstance(carried, Unverified):
        return [UNREADABLE] + [0] * 5, carried
    c = carried
    row = [CARRIED, c.total, c.first, c.end, c.signature, layer_word(c.layers, c.room)]
    if not all(isinstance(v, int) and 0 <= v < MOD64 for v in row) or not c.first < c.end:
        raise ValueError(f"words {row[1:]} do not fit a checksum row")
    return row, None


def _carried_rows(reqs: list[Any]) -> tuple[list[list[int]], dict[int, Unverified]]:
    """This rank's words per request for the first gather (``_carried_row``), and why
    each ``UNREADABLE`` one is. Never raises: a request whose row cannot be read is
    unverified on its own, so every rank sends one row per request whatever it holds."""
    rows: list[list[int]] = []
    reasons: dict[int, Unverified] = {}
    for i, req in enumerate(reqs):
        try:
            row, why = _carried_row(req)
        except Exception as error:  # this request only: the batch's others go on
            row, why = [UNREADABLE] + [0] * 5, Unverified(MALFORMED, str(error))
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
        kind, total, first, end, signature, word = part[i]
        if kind == CARRIED:
            layers, room = split_layer_word(word)
            if not (layers[0] < layers[1] and first < end):
                unreadable = True  # never sent by a kvaudit rank; checked all the same
                continue
            carried = Carried(total, first, end, signature, layers, room)
            if carried not in seen:
                seen.append(carried)
        elif kind != NOTHING:
            unreadable = True
    return seen, unreadable


def _consumer_part(
    scheduler: Any, req: Any, carried: Carried
) -> tuple[int, int, RequestBlocks, WorkerRecord | None]:
    """This decode rank's part of the checksum of what ``carried`` covers: ``(total,
    residual, blocks, record)``, the record kept when it covers every layer of the pool.

    Raises:
        NotDescribable: What the row carried cannot be compared here (another signature,
            page size, range or layers); the message says why.

    """
    whole = rank_checksummer(scheduler, CONSUMER)
    summer = whole if carried.layers == whole.layers else None
    if summer is None:
        summer = rank_checksummer(scheduler, CONSUMER, carried.layers)
    if carried.signature != summer.signature:
        raise NotDescribable(
            f"content signature {carried.signature:#x} differs from this decode's "
            f"{summer.signature:#x} (layers, heads, head size or dtype)"
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
    held = getattr(req.kv, "cache_protected_len", None)
    if held is None or carried.first != int(held):
        # The prefill rounds the decode's prefix down to its own page: tokens before
        # cache_protected_len are the decode's own cached prefix, never sent.
        raise NotDescribable(
            f"range start {carried.first} is not where this decode's cached prefix ends "
            f"({held} tokens): the first page holds tokens the decode did not receive"
        )
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    blocks = summer.range_blocks(row, carried.first, carried.end)
    record = summer.range_record(req.rid, blocks)
    total, residual = block_sums(record, req.rid)
    return total, residual, blocks, record if summer is whole else None


def _layers_text(layers: LayerSpan) -> str:
    return f"{layers[0]}..{layers[1] - 1}"


def abort_mismatched(scheduler: Any, batch: Any, mismatched: list[tuple[int, str]]) -> list[int]:
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
    try:
        for i, msg in mismatched:
            scheduler._handle_kv_checksum_mismatch(reqs[i], msg)
    finally:  # the KV of an aborted request is released: never computed on
        batch.filter_batch(keep_indices=[i for i in range(len(reqs)) if i not in aborted])
    return aborted


PEER_UNREADABLE = "checksum row unreadable on a peer rank"


def _held_row(scheduler: Any) -> list[int]:
    """This rank's layers for the second gather: ``[1, first, end]``, or zeros where its
    pool cannot be described."""
    try:
        first, end = rank_checksummer(scheduler, CONSUMER).layers
        return [1, int(first), int(end)] if 0 <= first < end < MOD64 else [0, 0, 0]
    except Exception:
        return [0, 0, 0]


def decode_checks(scheduler: Any, batch: Any) -> list[tuple[int, str]]:
    """On every decode attention TP rank (two collectives over ``attn_tp_cpu_group``, made
    whenever the batch has requests, so the ranks stay in step): verify each request of
    the batch that carries a kvaudit checksum, once; count, log and write the verdicts.
    Aborting is ``abort_mismatched``'s.

    Every rank takes part in the same collectives with the same shapes whatever its rows
    hold (a row that cannot be read is sent as ``UNREADABLE``), and every verdict is a
    function of the gathered values only, so the ranks agree on each request: a
    mismatch on any rank aborts it on all; a row unreadable on any rank leaves it
    unverified on all (never verified), the batch's other requests checked as usual.

    Returns:
        ``(index into the batch, message)`` per mismatched request.

    """
    reqs = list(batch.reqs)
    if not reqs:
        return []
    group = getattr(scheduler, "attn_tp_cpu_group", None)
    local, reasons = _carried_rows(reqs)
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
        _record_unverified(alone)
        return []
    mine: list[list[int]] = []
    errors: dict[int, str] = {}
    kept: dict[int, tuple[RequestBlocks, WorkerRecord | None]] = {}
    for n, (i, carried) in enumerate(checks):
        try:
            total, residual, blocks, record = _consumer_part(scheduler, reqs[i], carried)
        except Exception as error:  # not compared, with the reason
            errors[n] = str(error)
            mine.append([2, 0, 0])
            continue
        kept.setdefault(i, (blocks, record))
        mine.append([1, total, residual])
    # Every rank's part of every check, and the layers each rank holds last: a verdict
    # of "every layer" is then the same on every rank.
    gathered = gather_ranks([*mine, _held_row(scheduler)], group)
    sums = [part[:-1] for part in gathered]
    helds = [part[-1] for part in gathered]
    held = (helds[0][1], helds[0][2]) if all(h == helds[0] and h[0] for h in helds) else None
    numbered: dict[int, list[int]] = {}
    for n, (i, _) in enumerate(checks):
        numbered.setdefault(i, []).append(n)
    # The verdicts first, from the gathered values only (the same on every rank), so that
    # what the ranks abort is agreed whatever happens to this rank's counting after it.
    verdicts = {
        i: _verdict(reqs[i].rid, checks, numbers, sums, errors) for i, numbers in numbered.items()
    }
    mismatched = [(i, "; ".join(v.failed)) for i, v in verdicts.items() if v.failed]
    _record_unverified(alone)
    for i, verdict in verdicts.items():
        try:
            _record_verdict(scheduler, reqs[i], verdict, kept.get(i), unreadable.get(i), held)
        except Exception:  # counting and logging only: the verdict stands
            _failed("recording the decode's verdicts")
    return mismatched


def _record_unverified(requests: list[tuple[Any, Unverified]]) -> None:
    """Count the requests no rank carried a usable value for, each with its reason."""
    try:
        for req, why in requests:
            _unverified(req, why.reason, why.detail)
    except Exception:  # counting and logging only
        _failed("recording the decode's verdicts")


@dataclass
class _Verdict:
    """One request's outcome over the checks of what its rows carried: the layer spans
    that agreed, the mismatch lines, and why a check was not compared."""

    verified: list[LayerSpan] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    problem: str | None = None


def _verdict(
    rid: str,
    checks: list[tuple[int, Carried]],
    numbers: list[int],
    sums: list[list[list[int]]],
    errors: dict[int, str],
) -> _Verdict:
    """The verdict on one request from every rank's parts of its checks ``numbers``
    (``errors``: this rank's reasons for the checks it could not compare, the text of a
    problem only, never of what is decided)."""
    verdict = _Verdict()
    for n in numbers:
        carried = checks[n][1]
        if max(part[n][0] for part in sums) == 2:
            verdict.problem = verdict.problem or errors.get(n, "not comparable on a peer rank")
            continue
        total = sum(part[n][1] for part in sums) % MOD64
        residual = sum(part[n][2] for part in sums) % MOD64
        if total == carried.total and residual == 0:
            verdict.verified.append(carried.layers)
            continue
        what = "replicas disagree" if total == carried.total else "mismatch"
        verdict.failed.append(
            f"kvaudit KV checksum {what} req={rid} tokens={carried.first}..{carried.end} "
            f"layers={_layers_text(carried.layers)} expected={carried.total:#018x} "
            f"got={total:#018x} replica_residual={residual:#x}"
        )
    return verdict


def _record_verdict(
    scheduler: Any,
    req: Any,
    verdict: _Verdict,
    kept: tuple[RequestBlocks, WorkerRecord | None] | None,
    unreadable: Unverified | None,
    held: LayerSpan | None,
) -> None:
    """Count, log and write one request's verdict (the output folder: this rank's
    checksums, and a dump on a mismatch)."""
    if kept is not None:
        blocks, record = kept
        _write_output(scheduler, CONSUMER, req.rid, record, blocks, dump=bool(verdict.failed))
    if verdict.failed:
        logger.error("; ".join(verdict.failed))
        STATS.mismatched += 1
        return
    if unreadable is not None:  # compared equal where readable: still never verified
        _unverified(req, unreadable.reason, unreadable.detail)
        return
    problem = verdict.problem
    if not verdict.verified:
        _unverified(req, problem or "not comparable")
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
    if reason not in _logged:  # keyed by the reason: the set stays bounded
        _logged.add(reason)
        logger.warning("kvaudit: request %s %s (logged once per reason)", req.rid, reason)


def _failed(where: str) -> None:
    """A fault in kvaudit's own code: logged (once, with its traceback), counted; the
    engine goes on as without kvaudit."""
    STATS.reasons[f"kvaudit failed in {where}"] += 1
    if where not in _logged:
        _logged.add(where)
        logger.exception("kvaudit: %s failed; the engine goes on without kvaudit there", where)


def around_send_kv_chunk(original, self, req, last_chunk=False, end_idx=None):
    """AROUND hook of ``send_kv_chunk``: carry kvaudit's checksum with the last chunk."""
    if last_chunk:
        try:
            prefill_checksum(self, req, end_idx)
        except Exception:
            _failed("the prefill's checksum")
            # The slot is reused: no earlier request's words may travel with this one.
            try:
                write_carried(self.disagg_metadata_buffers, req.metadata_buffer_index, None)
            except Exception:
                _failed("clearing the checksum row")
    return original(self, req, last_chunk=last_chunk, end_idx=end_idx)


def around_commit_transfer_to_req(original, self, decode_req, *args, **kwargs):
    """AROUND hook of ``DecodeTransferQueue._commit_transfer_to_req``: keep the row."""
    commit_carried(self, decode_req)
    return original(self, decode_req, *args, **kwargs)


def around_verify_kv_checksums(original, self, batch, *args, **kwargs):
    """AROUND hook of ``_verify_kv_checksums``: SGLang's own check, then kvaudit's on
    the requests it kept."""
    result = original(self, batch, *args, **kwargs)
    try:
        mismatched = decode_checks(self, batch)
    except Exception:
        _failed("the decode's check")
        mismatched = []
    abort_mismatched(self, batch, mismatched)  # SGLang's own abort path, unguarded
    return result


def hooks() -> list[tuple[str, Any]]:
    """The inline check's ``HookRegistry`` AROUND hooks: ``(target, hook)`` pairs."""
    return [
        (PREFILL_TARGET, around_send_kv_chunk),
        (COMMIT_TARGET, around_commit_transfer_to_req),
        (VERIFY_TARGET, around_verify_kv_checksums),
    ]
