"""The prefill side of the inline check: before a request's last chunk is sent, every
attention TP rank of a PP stage checksums its part of the request's tokens over the
stage's layers, the strong lane's moments over the range's pages are gathered over the
attention TP CPU group and added modulo ``2**64 - 59``, and every rank writes the same
words into the request's checksum row (``carried``)."""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.checksum import is_health_check_req

from ...core.scheme import STRONG_PRIME
from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from .carried import MASK32, MOMENTS, Carried, room_bits, write_carried
from .inline_state import STATS, log_once, rank_checksummer, write_output
from .ranks import PRODUCER, group_sums, strong_moments


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
        log_once("no checksum row: start both engines with --disaggregation-enable-kv-checksum")
        return None
    index = req.metadata_buffer_index
    if is_health_check_req(req):
        write_carried(buffers, index, None)
        return None
    status, moments, first, end, signature, layers = 0, [0] * MOMENTS, 0, 0, 0, (0, 0)
    page = 0
    record: WorkerRecord | None = None
    blocks: RequestBlocks | None = None
    try:
        summer = rank_checksummer(scheduler, PRODUCER)
        page = summer.page_size
        first, end = prefill_range(req, page, end_idx)
        row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        blocks = summer.range_blocks(row, first, end)
        record = summer.range_record(req.rid, blocks)
        # One unit per page: the moments name the prefill's pages.
        moments, _ = strong_moments(record, req.rid, page, page)
        signature, layers = summer.signature & MASK32, summer.layers
    except Exception as error:  # the request is sent, unverified
        status = 1
        log_once(f"prefill checksum not carried: {error}")
    group = getattr(scheduler, "attn_tp_cpu_group", None)
    # Summed modulo the strong lane's prime (the status, a count of failed ranks, too).
    ((status, *moments),) = group_sums([[status, *moments]], group, STRONG_PRIME)
    if status:
        STATS.not_written += 1
        write_carried(buffers, index, None)
        return None
    room = room_bits(req.bootstrap_room)
    carried = Carried(tuple(moments), first, end, signature, layers, room, unit=page)
    write_carried(buffers, index, carried)
    STATS.written += 1
    assert blocks is not None
    write_output(scheduler, PRODUCER, req.rid, record, blocks, dump=True)
    return carried
