"""The prefill side of the inline check: before a request's last chunk is sent, every
attention TP rank of a PP stage checksums its part of the request's tokens over the
stage's layers, the strong lane's moments over the range's pages (every group's, for a
hybrid pool) and each group's strong-lane sum are gathered over the attention TP CPU
group and added modulo ``2**64 - 59``, and every rank writes the same words into the
request's checksum row and, for a hybrid pool, its ``bootstrap_room`` row
(``carried``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.disaggregation.checksum import is_health_check_req

from ...core.scheme import STRONG_PRIME
from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from . import hooked
from .carried import (
    MASK32,
    MAX_GROUPS,
    MOMENTS,
    Carried,
    GroupWord,
    room_bits,
    write_carried,
    write_groups,
)
from .inline_state import rank_checksummer, write_output
from .ranks import PRODUCER, group_sums
from .state import state_of

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler


def prefill_range(req: Req, page_size: int, end_idx: int | None) -> tuple[int, int]:
    """The tokens a prefill checksums: from the decode's prefix rounded down to a page,
    to the end SGLang's own digest uses.

    Args:
        req: The request being sent.
        page_size: The prefill's page size.
        end_idx: The end ``send_kv_chunk`` was given (None: the request's extend end).

    Returns:
        ``(first, end)``: tokens ``first .. end - 1``.

    """
    end = end_idx if end_idx is not None else min(req.extend_end, len(req.origin_input_ids))
    first = (int(req.disagg_decode_prefix_len) // page_size) * page_size
    return first, int(end)


def prefill_checksum(scheduler: Scheduler, req: Req, end_idx: int | None = None) -> Carried | None:
    """On every attention TP rank of a prefill stage (a collective over
    ``attn_tp_cpu_group``): checksum this rank's part of the request's range over the
    stage's layers, sum over the ranks, and write the result into the request's checksum
    row (zeros where nothing can be carried); with an output folder, append this rank's
    checksums (and, with rotating dumps, dump the request).

    Args:
        scheduler: The prefill scheduler.
        req: The request whose last chunk is sent.
        end_idx: The end ``send_kv_chunk`` was given.

    Returns:
        What was written, or None for an empty row.

    """
    state = state_of(scheduler)
    buffers = scheduler.disagg_metadata_buffers
    rows = hooked.read_or_none(buffers, hooked.KV_CHECKSUM, "no kvaudit checksum is carried")
    if rows is None:
        state.log_once(
            "no checksum row: start both engines with --disaggregation-enable-kv-checksum"
        )
        return None
    index = req.metadata_buffer_index
    if is_health_check_req(req):
        write_carried(buffers, index, None)
        return None
    status, moments, first, end, signature, layers = 0, [0] * MOMENTS, 0, 0, 0, (0, 0)
    page = 0
    words: list[GroupWord] = []
    record: WorkerRecord | None = None
    blocks: RequestBlocks | None = None
    try:
        summer = rank_checksummer(scheduler, PRODUCER)
        page = summer.page_size
        first, end = prefill_range(req, page, end_idx)
        blocks = summer.request_range(scheduler.req_to_token_pool, req.kv.req_pool_idx, first, end)
        record = summer.range_record(req.rid, blocks)
        # One unit per page: the moments name the prefill's pages (over every group).
        moments, _ = summer.moments(record, req.rid, page)
        words = summer.group_words(record, req.rid)
        signature, layers = summer.signature & MASK32, summer.layers
    except Exception as error:  # the request is sent, unverified
        status = 1
        state.log_once(f"prefill checksum not carried: {error}")
    group = hooked.read(scheduler, hooked.ATTN_TP_CPU_GROUP)
    # Summed modulo the strong lane's prime (the status, a count of failed ranks, too),
    # with each group's strong-lane sum.
    sums = [total for _, _, total in words] + [0] * (MAX_GROUPS - len(words))
    ((status, *summed),) = group_sums([[status, *moments, *sums]], group, STRONG_PRIME)
    moments, sums = summed[:MOMENTS], summed[MOMENTS:]
    if status:
        state.counts.not_written += 1
        write_carried(buffers, index, None)
        write_groups(buffers, index, ())
        return None
    room = room_bits(req.bootstrap_room)
    # Every rank's group ids and signatures are equal (the same description at every
    # rank): this rank's own, with the sums over the ranks.
    groups = tuple((g, sig, total) for (g, sig, _), total in zip(words, sums, strict=False))
    carried = Carried(tuple(moments), first, end, signature, layers, room, page, groups)
    write_carried(buffers, index, carried)
    write_groups(buffers, index, carried.groups)
    state.counts.written += 1
    assert blocks is not None
    write_output(scheduler, PRODUCER, req.rid, record, blocks, dump=True)
    return carried
