"""What the inline check keeps in an SGLang process: its counts and the reasons it logged
once, and on each scheduler its rank checksummers and its writer into the output folder
(through which both sides append a request's checksums)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from .ranks import PRODUCER, LayerSpan, RankChecksummer, attention_tp, pipeline_ranks
from .recording import Recorder, settings_from_environment
from .scales import sglang_attention_layers

# One logger for the whole inline check, named as before it was split into modules: a
# deployment's logging settings for it keep working.
logger = logging.getLogger("kvaudit.integrations.sglang.inline")


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
    # In place: the inline check's modules (and ``inline.STATS``) hold this very object.
    for name, value in vars(InlineStats()).items():
        setattr(STATS, name, value)
    _logged.clear()


def first_time(key: str) -> bool:
    """Whether ``key`` (a reason, a message) is logged for the first time; it is
    remembered, so each is logged once and the set stays as bounded as the keys.

    Args:
        key: What would be logged.

    Returns:
        True the first time since the last ``reset_inline_stats``.

    """
    if key in _logged:
        return False
    _logged.add(key)
    return True


def log_once(message: str) -> None:
    """Log ``message`` as a warning the first time only (``first_time``).

    Args:
        message: The warning, without the ``kvaudit:`` prefix.

    """
    if first_time(message):
        logger.warning("kvaudit: %s", message)


def count_unverified(req: Any, reason: str, detail: str = "") -> None:
    """Count ``req`` unverified for ``reason``; log it once per reason (the first
    request's id and ``detail`` with it), so the log and the set of logged lines stay
    bounded however many requests arrive.

    Args:
        req: The SGLang request (its ``rid`` is logged).
        reason: Why it is unverified (what is counted, and logged once).
        detail: What the log line adds in parentheses ("" for nothing).

    """
    STATS.unverified += 1
    STATS.reasons[reason] += 1
    if first_time(reason):
        logger.warning(
            "kvaudit: request %s admitted unverified: %s%s (logged once per reason)",
            req.rid,
            reason,
            f" ({detail})" if detail else "",
        )


def log_fault(where: str) -> None:
    """A fault in kvaudit's own code: logged (once, with its traceback), counted; the
    engine goes on as without kvaudit. Called in an ``except`` block, whose exception is
    logged.

    Args:
        where: What kvaudit was doing (counted as ``kvaudit failed in WHERE``).

    """
    STATS.reasons[f"kvaudit failed in {where}"] += 1
    if first_time(where):
        logger.exception("kvaudit: %s failed; the engine goes on without kvaudit there", where)


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
        settings = settings_from_environment()
        cached[1][key] = RankChecksummer(
            pool,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            total_kv_heads=int(total),
            role=role,
            layers=layers,
            sliding_window=getattr(scheduler, "sliding_window_size", None),
            attention=attention_layers(scheduler),
            # Only the output folder's lines carry them (the carried words do not).
            layer_sums=settings.output is not None and settings.layer_sums,
        )
    return cached[1][key]


def attention_layers(scheduler: Any) -> dict[int, Any] | None:
    """The scheduler's model's ``RadixAttention`` layers by layer id, for the scales of an
    fp8 pool; None where the model cannot be reached (a scheduler without a model
    runner): the description then gives no scales, and nothing else changes."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None:
        return None
    try:
        return sglang_attention_layers(model)
    except Exception:  # never the engine's failure: no scales is the worst it costs
        log_fault("reading the attention layers' KV scales")
        return None


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


def write_output(
    scheduler: Any,
    role: str,
    request: str,
    record: WorkerRecord | None,
    blocks: RequestBlocks,
    dump: bool,
) -> None:
    """Append the request's checksums (``record``, or computed over every layer of the
    pool when None) to the output folder and dump it when ``dump`` (a decode: on a
    mismatch; a prefill: with rotating dumps). Never raises: a failure is logged once.

    Args:
        scheduler: The SGLang scheduler (its writer is built on first use).
        role: ``producer`` (the prefill) or ``consumer`` (the decode).
        request: The request's id.
        record: This rank's checksums of the request, or None to compute them.
        blocks: The request's blocks in the pool.
        dump: Whether to dump the request too.

    """
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
        log_once(f"output folder not written: {error}")
