"""The prefill side of the inline check: before a request's last chunk is sent, every
attention TP rank of a PP stage checksums its part of the request's tokens over the
stage's layers, the sums are gathered over the attention TP CPU group, and every rank
writes the same words into the request's checksum row (``carried``)."""

from __future__ import annotations

from typing import Any

from sglang.srt.disaggregation.checksum import is_health_check_req

from ...records import WorkerRecord
from ...views.inputs import RequestBlocks
from .carried import (
    MAX_GROUPS,
    Carried,
    group_row,
    room_bits,
    split_group_row,
    write_carried,
    write_groups,
)
from .inline_state import STATS, log_once, rank_checksummer, write_output
from .ranks import PRODUCER, block_sums, group_sums


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
    status, total, first, end, signature, layers = 0, 0, 0, 0, 0, (0, 0)
    groups = [0] * (2 * MAX_GROUPS)
    record: WorkerRecord | None = None
    blocks: RequestBlocks | None = None
    try:
        summer = rank_checksummer(scheduler, PRODUCER)
        first, end = prefill_range(req, summer.page_size, end_idx)
        blocks = summer.request_range(scheduler.req_to_token_pool, req.kv.req_pool_idx, first, end)
        record = summer.range_record(req.rid, blocks)
        total, _ = block_sums(record, req.rid, None)
        groups = group_row(summer.group_words(record, req.rid))
        signature, layers = summer.signature, summer.layers
    except Exception as error:  # the request is sent, unverified
        status = 1
        log_once(f"prefill checksum not carried: {error}")
    group = getattr(scheduler, "attn_tp_cpu_group", None)
    ((status, total, *summed),) = group_sums([[status, total, *groups]], group)
    if status:
        STATS.not_written += 1
        write_carried(buffers, index, None)
        write_groups(buffers, index, ())
        return None
    # Every rank's signatures are equal (the same description at every rank): the sum
    # over the ranks of a signature word is that word times the ranks; this rank's own.
    words = [w if k % 2 == 0 else summed[k] for k, w in enumerate(groups)]
    carried = Carried(
        total, first, end, signature, layers, room_bits(req.bootstrap_room), split_group_row(words)
    )
    write_carried(buffers, index, carried)
    write_groups(buffers, index, carried.groups)
    STATS.written += 1
    assert blocks is not None
    write_output(scheduler, PRODUCER, req.rid, record, blocks, dump=True)
    return carried
