"""kvaudit's verification of an SGLang prefill/decode KV transfer, inline, at the points
SGLang's own ``--disaggregation-enable-kv-checksum`` uses (docs/sglang.md, "Inline
verification").

SGLang's own digest (Adler-32 of one rank's bytes plus a layout signature) compares only
when the prefill's layout equals the decode's; any other TP width or a PP stage is
admitted unverified. kvaudit's checksum adds up across TP ranks and ignores pages and
layout, so:

* on the prefill, before a request's last chunk is sent (``send_kv_chunk``), every
  attention TP rank of a PP stage checksums its part of the request's tokens over the
  stage's layers, the blocks' strong lane is folded into three moments over the range's
  pages, summed over the attention TP CPU group (all-gathered, added modulo ``2**64 -
  59``), and every rank writes the same words into the spare words of the request's
  checksum row (``carried``), which travels with the last chunk; the stages do not
  communicate (their pipeline reaches a request's last chunk at different times), so
  each stage's row carries its own layers;
* on the decode, the row is read when the transfer is committed (``_commit_transfer_to_
  req``, before ``clear_slot`` zeroes it), and before the request joins a batch
  (``_verify_kv_checksums``) the decode's attention TP ranks gather what their rows
  carried (one collective), each checksums its part of the same tokens over each carried
  stage's layers, and the sums are gathered (a second collective) and compared, a
  mismatch naming the differing block where the moments locate it; a mismatch goes
  through SGLang's own ``_handle_kv_checksum_mismatch`` (abort, transfer-failed
  counter). A request is verified when the carried layers are every layer
  the decode holds, and counted as ``partial`` (never as verified) when they are fewer (a
  PP prefill whose stages' rows overwrote one another on a decode with fewer stages).
  A row that cannot be read (empty or inverted ranges, another kvaudit version) leaves its
  request unverified, never the batch; every rank makes the same collectives whatever
  its rows hold, and the verdicts come from the gathered values, so the ranks agree.

With ``KVAUDIT_SGLANG_OUTPUT`` set, each process writes its checksums and bounded dumps
into the engine's output folder (``recording``). The hooks are installed by
``plugin.register()``, kvaudit's ``sglang.srt.plugins`` entry point. This module (through
``inline_prefill`` and ``inline_decode``) imports SGLang; kvaudit's own modules never
import it.

This module holds the hooks (and their targets), which ``plugin`` installs; the rest
lies in sibling modules, their public names imported here: ``inline_prefill`` (the
prefill's row), ``inline_decode`` (the decode's check), ``inline_verdicts`` (the
verdicts counted, logged and written), ``inline_state`` (each scheduler's checksummers
and writer) and ``state`` (kvaudit's state on a scheduler, the process's counts). The
SGLang methods hooked and called are named in ``hooked``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import hooked
from .carried import write_carried, write_groups
from .inline_decode import (
    CARRIED,
    NOTHING,
    PEER_UNREADABLE,
    UNREADABLE,
    abort_mismatched,
    commit_carried,
    decode_checks,
)
from .inline_prefill import prefill_checksum, prefill_range
from .inline_state import rank_checksummer, recorder
from .state import InlineStats, SchedulerState, inline_stats, reset_inline_stats, state_of

if TYPE_CHECKING:
    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

PREFILL_TARGET = hooked.SEND_KV_CHUNK.target
COMMIT_TARGET = hooked.COMMIT_TRANSFER.target
VERIFY_TARGET = hooked.VERIFY_CHECKSUMS.target

Hook = Callable[..., Any]
"""A ``HookRegistry`` AROUND hook: ``hook(original, self, *args, **kwargs)``."""


def log_fault(scheduler: Scheduler, where: str) -> None:
    """``SchedulerState.log_fault`` on the scheduler's state; never raises (a scheduler
    that keeps no state: the fault is logged once all the same). Called in an ``except``
    block.

    Args:
        scheduler: The scheduler the hook runs on.
        where: What kvaudit was doing.

    """
    try:
        state_of(scheduler).log_fault(where)
    except hooked.NotInThisSglang as missing:
        hooked.report(missing, f"kvaudit failed in {where}")


def around_send_kv_chunk(
    original: Callable[..., Any],
    self: Scheduler,
    req: Req,
    last_chunk: bool = False,
    end_idx: int | None = None,
) -> Any:
    """AROUND hook of ``send_kv_chunk``: carry kvaudit's checksum with the last chunk.

    Args:
        original: SGLang's ``send_kv_chunk``.
        self: The prefill scheduler.
        req: The request sent.
        last_chunk: Whether this is its last chunk (kvaudit acts on the last only).
        end_idx: The end of the chunk, as SGLang passes it.

    Returns:
        What SGLang's method returns.

    """
    if last_chunk:
        try:
            prefill_checksum(self, req, end_idx)
        except Exception:
            log_fault(self, "the prefill's checksum")
            # The slot is reused: no earlier request's words may travel with this one.
            try:
                write_carried(self.disagg_metadata_buffers, req.metadata_buffer_index, None)
                write_groups(self.disagg_metadata_buffers, req.metadata_buffer_index, ())
            except Exception:
                log_fault(self, "clearing the checksum row")
    return original(self, req, last_chunk=last_chunk, end_idx=end_idx)


def around_commit_transfer_to_req(
    original: Callable[..., Any],
    self: DecodeTransferQueue,
    decode_req: DecodeRequest,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """AROUND hook of ``DecodeTransferQueue._commit_transfer_to_req``: keep the row.

    Args:
        original: SGLang's method.
        self: The decode's transfer queue.
        decode_req: The request committed.
        *args: SGLang's further arguments, passed on.
        **kwargs: SGLang's further keyword arguments, passed on.

    Returns:
        What SGLang's method returns.

    """
    commit_carried(self, decode_req)
    return original(self, decode_req, *args, **kwargs)


def around_verify_kv_checksums(
    original: Callable[..., Any],
    self: Scheduler,
    batch: ScheduleBatch,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """AROUND hook of ``_verify_kv_checksums``: SGLang's own check, then kvaudit's on
    the requests it kept.

    Args:
        original: SGLang's check.
        self: The decode scheduler.
        batch: The prebuilt batch.
        *args: SGLang's further arguments, passed on.
        **kwargs: SGLang's further keyword arguments, passed on.

    Returns:
        What SGLang's check returns.

    """
    result = original(self, batch, *args, **kwargs)
    try:
        mismatched = decode_checks(self, batch)
    except Exception:
        log_fault(self, "the decode's check")
        mismatched = []
    abort_mismatched(self, batch, mismatched)  # SGLang's own abort path, unguarded
    return result


def hooks() -> list[tuple[str, Hook]]:
    """The inline check's ``HookRegistry`` AROUND hooks: ``(target, hook)`` pairs."""
    return [
        (PREFILL_TARGET, around_send_kv_chunk),
        (COMMIT_TARGET, around_commit_transfer_to_req),
        (VERIFY_TARGET, around_verify_kv_checksums),
    ]


__all__ = [
    "CARRIED",
    "COMMIT_TARGET",
    "NOTHING",
    "PEER_UNREADABLE",
    "PREFILL_TARGET",
    "UNREADABLE",
    "VERIFY_TARGET",
    "InlineStats",
    "SchedulerState",
    "abort_mismatched",
    "around_commit_transfer_to_req",
    "around_send_kv_chunk",
    "around_verify_kv_checksums",
    "commit_carried",
    "decode_checks",
    "hooks",
    "inline_stats",
    "prefill_checksum",
    "prefill_range",
    "rank_checksummer",
    "recorder",
    "reset_inline_stats",
    "state_of",
]
