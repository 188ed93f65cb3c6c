"""What the inline check builds on a scheduler, from its ``SchedulerState``: its rank
checksummers (over its pool, per role and span of layers) and its writer into the output
folder, through which both sides append a request's checksums."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from . import hooked
from .ranks import PRODUCER, LayerSpan, RankChecksummer, attention_tp, pipeline_ranks
from .recording import Recorder
from .scales import sglang_attention_layers
from .state import SchedulerState, state_of

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler


def rank_checksummer(
    scheduler: Scheduler, role: str, layers: LayerSpan | None = None
) -> RankChecksummer:
    """The scheduler's ``RankChecksummer`` of ``role`` over ``layers`` (default: every
    layer of its pool), built once per pool and span (the pool's buffers stay put).

    Args:
        scheduler: The SGLang scheduler.
        role: ``producer`` (a prefill) or ``consumer`` (a decode).
        layers: The global layer ids checksummed, or None for every layer of the pool.

    Returns:
        The checksummer.

    Raises:
        NotDescribable: A pool (or span) kvaudit cannot checksum.

    """
    state = state_of(scheduler)
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    built = state.checksummers.of(pool)
    key = (role, layers)
    if key not in built:
        _, tp_rank, tp_size = attention_tp(scheduler)
        pp_rank, pp_size = pipeline_ranks()
        total = scheduler.model_config.get_total_num_kv_heads()
        built[key] = RankChecksummer(
            pool,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            total_kv_heads=int(total),
            role=role,
            layers=layers,
            sliding_window=sliding_window(scheduler),
            attention=attention_layers(scheduler),
            # Only the output folder's lines carry them (the carried words do not).
            layer_sums=state.settings.output is not None and state.settings.layer_sums,
        )
    return built[key]


def sliding_window(scheduler: Scheduler) -> int | None:
    """The scheduler's sliding window in tokens (None: no window, or a scheduler
    without one: an ``SWAKVPool`` is then not described, with the reason)."""
    return hooked.read_or_none(
        scheduler, hooked.SLIDING_WINDOW, "an SWAKVPool's window is not known"
    )


def attention_layers(scheduler: Scheduler) -> dict[int, torch.nn.Module] | None:
    """The scheduler's model's ``RadixAttention`` layers by layer id, for the scales of an
    fp8 pool; None where the model cannot be reached (a scheduler without a model
    runner, logged once): the description then gives no scales, and nothing else
    changes."""
    model = hooked.read_or_none(scheduler, hooked.MODEL, "no fp8 KV scales recorded")
    if model is None:
        return None
    try:
        return sglang_attention_layers(model)
    except Exception:  # never the engine's failure: no scales is the worst it costs
        state_of(scheduler).log_fault("reading the attention layers' KV scales")
        return None


def recorder(scheduler: Scheduler, role: str) -> Recorder | None:
    """The scheduler's writer into its output folder (None without
    ``KVAUDIT_SGLANG_OUTPUT``), built once.

    Args:
        scheduler: The SGLang scheduler.
        role: ``producer`` or ``consumer``.

    Returns:
        The writer, or None.

    """
    state = state_of(scheduler)
    if role not in state.recorders:
        built = None
        if state.settings.output is not None:
            summer = rank_checksummer(scheduler, role)
            built = Recorder(
                state.settings, summer.worker, summer.description, summer.raw, summer.tensors
            )
        state.recorders[role] = built
    return state.recorders[role]


def write_output(
    scheduler: Scheduler,
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
    state: SchedulerState = state_of(scheduler)
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
            state.counts.dumps_written += 1
    except Exception as error:  # the engine goes on; the output folder lacks the request
        state.log_once(f"output folder not written: {error}")
