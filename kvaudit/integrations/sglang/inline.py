"""kvaudit's verification of an SGLang prefill/decode KV transfer, inline, at the points
SGLang's own ``--disaggregation-enable-kv-checksum`` uses (docs/sglang.md, "Inline
verification").

SGLang's own digest (Adler-32 of one rank's bytes plus a layout signature) compares only
when the prefill's layout equals the decode's; any other TP width is admitted unverified.
kvaudit's checksum adds up across TP ranks and ignores pages and layout, so:

* on the prefill, before a request's last chunk is sent (``send_kv_chunk``), every
  attention TP rank checksums its part of the request's tokens, the per-block totals
  over the range are summed and all-reduced (mod 2**64) over the attention TP CPU group,
  and every rank writes the same value into the spare words of the request's checksum
  row of the metadata buffers, which travels with the last chunk;
* on the decode, the row is read when the transfer is committed (``_commit_transfer_to_
  req``, before ``clear_slot`` zeroes it), and before the request joins a batch
  (``_verify_kv_checksums``) every decode TP rank checksums its part of the same range,
  the sums are all-reduced and compared; a mismatch goes through SGLang's own
  ``_handle_kv_checksum_mismatch`` (abort, transfer-failed counter).

Checksum row (8 uint64 per request; SGLang uses words 0 and 1):

====  =====================================================================
word  content
====  =====================================================================
2     ``MARKER`` (0: nothing written; the request is unverified on decode)
3     the sum over the range's blocks of kvaudit's block checksums (uint64)
4     the range's first token (a page boundary of the prefill)
5     the range's end (exclusive)
6     ``content_signature``: layer names, model KV heads, head sizes, dtype
====  =====================================================================

The hooks are installed with ``register()``, an ``sglang.srt.plugins`` entry point.
This module imports SGLang; kvaudit's own modules never import it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.disaggregation.checksum import is_health_check_req

from ...description import parse_description
from ...views.inputs import RequestBlocks
from .describe import (
    DEFAULT_LAYER_NAME,
    NotDescribable,
    describe_sglang_cache,
    request_blocks,
    sglang_layer_caches,
)

logger = logging.getLogger(__name__)

MOD64 = 1 << 64
MARKER = 0x6B76_6175_6469_7401
"""Word 2 of the checksum row: kvaudit wrote words 3..6 (``"kvaudit"``, version 1)."""
SLOT_MARKER, SLOT_SUM, SLOT_FIRST, SLOT_END, SLOT_SIGNATURE = 2, 3, 4, 5, 6
ATTRIBUTE = "kvaudit_carried"
"""The attribute of a decode ``Req`` that holds what its checksum row carried."""

PREFILL_TARGET = (
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk"
)
COMMIT_TARGET = "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req"
VERIFY_TARGET = (
    "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._verify_kv_checksums"
)


@dataclass(frozen=True)
class Carried:
    """What a prefill wrote into a request's checksum row: the summed checksum of tokens
    ``first .. end - 1`` under ``signature``."""

    total: int
    first: int
    end: int
    signature: int


@dataclass(frozen=True)
class Unverified:
    """A request that arrived without a kvaudit checksum, and why."""

    reason: str


@dataclass
class InlineStats:
    """This process's counts: requests verified, caught (aborted), unverified (with
    reasons) and health checks skipped; prefill rows written and left empty."""

    verified: int = 0
    mismatched: int = 0
    unverified: int = 0
    skipped: int = 0
    written: int = 0
    not_written: int = 0
    reasons: Counter = field(default_factory=Counter)


STATS = InlineStats()
_logged: set[str] = set()


def inline_stats() -> dict[str, Any]:
    """A snapshot of this process's counts (``InlineStats`` as a dict)."""
    return {
        "verified": STATS.verified,
        "mismatched": STATS.mismatched,
        "unverified": STATS.unverified,
        "skipped": STATS.skipped,
        "written": STATS.written,
        "not_written": STATS.not_written,
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


def content_signature(raw: dict[str, Any]) -> int:
    """A 63-bit nonzero hash of what a description's checksum covers, independent of TP
    width, page size and block count: kind, global layer names, model KV heads, head
    sizes and dtype.

    Args:
        raw: ``describe_sglang_cache``'s dict.

    Returns:
        The signature (positive, never 0).

    """
    (group,) = raw["groups"]
    spec = group["spec"]
    identity = (
        "kvaudit-sglang-inline",
        1,
        spec["type"],
        tuple(group["layers"]),
        raw.get("model_kv_heads"),
        spec["head_size"],
        spec.get("head_size_v"),
        spec["dtype"],
    )
    digest = hashlib.blake2b(repr(identity).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) | 1


class RankChecksummer:
    """kvaudit's checksummer over one rank's SGLang pool, with its description's
    ``content_signature``."""

    def __init__(
        self,
        pool: Any,
        *,
        tp_rank: int,
        tp_size: int,
        total_kv_heads: int | None,
        role: str,
        names: Any = DEFAULT_LAYER_NAME,
    ) -> None:
        from ...checksum.checksummer import Checksummer

        raw = describe_sglang_cache(
            pool, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=total_kv_heads, names=names
        )
        self.page_size = int(pool.page_size)
        self.signature = content_signature(raw)
        self.checksummer = Checksummer(
            parse_description(raw, "sglang"),
            sglang_layer_caches(pool, names),
            tp_rank=tp_rank,
            tp_size=tp_size,
            role=role,
        )
        if self.checksummer.not_covered:
            raise NotDescribable(
                f"kvaudit cannot checksum the pool: {self.checksummer.not_covered}"
            )

    def range_sums(self, row: torch.Tensor, first: int, end: int) -> tuple[int, int]:
        """This rank's part of the checksum of tokens ``first .. end - 1`` of a request
        whose ``req_to_token`` row is ``row``, and its replica residual.

        The total is the sum over the range's blocks of the replica-0 columns. The
        residual is the sum of the other replicas' columns minus ``R - 1`` times the
        replica-0 columns: summed over the ranks it is 0 when every replica holds the
        same KV (always 0 for a producer, which checksums replica 0 only).

        Args:
            row: The request's ``req_to_token`` row.
            first: The first token, a multiple of the page size.
            end: One past the last token.

        Returns:
            ``(total, residual)``, each mod 2**64.

        Raises:
            NotDescribable: A range not on a page boundary, or slots not where the pages
                put them.

        """
        page = self.page_size
        if first % page:
            raise NotDescribable(f"the range starts at token {first}, not a {page}-token page")
        part = request_blocks(row[first:end], end - first, page)
        pages = part.groups[0][1]
        blocks = RequestBlocks(num_tokens=end, groups={0: (first // page, pages)})
        record = self.checksummer.checksum({"r": blocks})
        checksums = record.requests["r"].groups[0]
        columns = checksums.values.sum(axis=0, dtype="uint64").tolist()
        total = residual = 0
        for (replicas, index), value in zip(checksums.replica_keys, columns, strict=True):
            if index == 0:
                total += int(value)
                residual -= (replicas - 1) * int(value)
            else:
                residual += int(value)
        return total % MOD64, residual % MOD64


def gather_ranks(rows: list[list[int]], group: Any) -> list[list[list[int]]]:
    """Every rank's ``rows`` (all ranks pass the same shape, values in ``0 .. 2**64 -
    1``), by one all-gather of int64 (two's complement) over a CPU (gloo) group.

    Args:
        rows: This rank's values.
        group: A CPU process group, or None for this rank alone.

    Returns:
        Per rank of the group, its rows (values in ``0 .. 2**64 - 1``), the same on
        every rank.

    """
    if not rows or group is None or dist.get_world_size(group) == 1:
        return [[[v % MOD64 for v in row] for row in rows]]
    signed = [[v - MOD64 if v >= 1 << 63 else v for v in row] for row in rows]
    mine = torch.tensor(signed, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [[[v % MOD64 for v in row] for row in part.tolist()] for part in gathered]


def group_sums(rows: list[list[int]], group: Any) -> list[list[int]]:
    """Per entry, the sum mod 2**64 over the group's ranks of every rank's ``rows``
    (``gather_ranks``)."""
    parts = gather_ranks(rows, group)
    return [
        [sum(part[i][j] for part in parts) % MOD64 for j in range(len(row))]
        for i, row in enumerate(rows)
    ]


def write_carried(metadata_buffers: Any, index: int, carried: Carried | None) -> None:
    """Words 2..6 of checksum row ``index``: ``carried``, or zeros (nothing written)."""
    words = metadata_buffers.kv_checksum.view(torch.int64)[index]
    if carried is None:
        words[SLOT_MARKER : SLOT_SIGNATURE + 1] = 0
        return
    values = (MARKER, carried.total, carried.first, carried.end, carried.signature)
    for slot, value in zip(range(SLOT_MARKER, SLOT_SIGNATURE + 1), values, strict=True):
        words[slot] = value - MOD64 if value >= 1 << 63 else value


def read_carried(metadata_buffers: Any, index: int) -> Carried | Unverified:
    """What checksum row ``index`` carries from a kvaudit prefill."""
    if getattr(metadata_buffers, "kv_checksum", None) is None:
        return Unverified("no checksum row (needs --disaggregation-enable-kv-checksum)")
    words = [v % MOD64 for v in metadata_buffers.kv_checksum.view(torch.int64)[index].tolist()]
    marker = words[SLOT_MARKER]
    if marker == 0:
        return Unverified("no kvaudit checksum from the prefill")
    if marker != MARKER:
        return Unverified(f"unknown kvaudit marker {marker:#x}")
    return Carried(words[SLOT_SUM], words[SLOT_FIRST], words[SLOT_END], words[SLOT_SIGNATURE])


def _tp(scheduler: Any) -> tuple[Any, int, int]:
    group = scheduler.attn_tp_cpu_group
    return group, dist.get_rank(group), dist.get_world_size(group)


def _pp_size() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().pp_size or 1)
    except Exception:  # not published (tests): no PP
        return 1


def rank_checksummer(scheduler: Any, role: str) -> RankChecksummer:
    """The scheduler's ``RankChecksummer``, built once (the pool's buffers stay put)."""
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    cached = getattr(scheduler, "_kvaudit_rank_checksummer", None)
    if cached is not None and cached[0] is pool:
        return cached[1]
    _, tp_rank, tp_size = _tp(scheduler)
    total = scheduler.model_config.get_total_num_kv_heads()
    built = RankChecksummer(
        pool, tp_rank=tp_rank, tp_size=tp_size, total_kv_heads=int(total), role=role
    )
    scheduler._kvaudit_rank_checksummer = (pool, built)
    return built


def prefill_range(req: Any, page_size: int, end_idx: int | None) -> tuple[int, int]:
    """The tokens a prefill checksums: from the decode's prefix rounded down to a page,
    to the end SGLang's own digest uses."""
    end = end_idx if end_idx is not None else min(req.extend_end, len(req.origin_input_ids))
    first = (int(req.disagg_decode_prefix_len) // page_size) * page_size
    return first, int(end)


def prefill_checksum(scheduler: Any, req: Any, end_idx: int | None = None) -> Carried | None:
    """On every prefill attention TP rank (a collective over ``attn_tp_cpu_group``):
    checksum this rank's part of the request's range, sum over the ranks, and write the
    result into the request's checksum row (zeros where nothing can be carried).

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
    status, total, first, end, signature = 0, 0, 0, 0, 0
    try:
        if _pp_size() > 1:
            raise NotDescribable("PP > 1 is not verified inline yet")
        summer = rank_checksummer(scheduler, "producer")
        first, end = prefill_range(req, summer.page_size, end_idx)
        row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        total, _ = summer.range_sums(row, first, end)
        signature = summer.signature
    except Exception as error:  # the request is sent, unverified
        status = 1
        _log_once(f"prefill checksum not carried: {error}")
    group = getattr(scheduler, "attn_tp_cpu_group", None)
    ((status, total),) = group_sums([[status, total]], group)
    if status:
        STATS.not_written += 1
        write_carried(buffers, index, None)
        return None
    carried = Carried(total, first, end, signature)
    write_carried(buffers, index, carried)
    STATS.written += 1
    return carried


def commit_carried(queue: Any, decode_req: Any) -> None:
    """On the decode, when a transfer is committed: keep what the row carries on the
    request (before SGLang's ``clear_slot`` zeroes it)."""
    try:
        carried = read_carried(queue.metadata_buffers, decode_req.metadata_buffer_index)
    except Exception as error:
        carried = Unverified(f"checksum row unreadable: {error}")
    setattr(decode_req.req, ATTRIBUTE, carried)


def _unverified(req: Any, reason: str) -> None:
    STATS.unverified += 1
    STATS.reasons[reason] += 1
    _log_once(f"request {req.rid} admitted unverified: {reason} (logged once per reason)")


def decode_verify(scheduler: Any, batch: Any) -> list[int]:
    """On every decode attention TP rank (a collective over ``attn_tp_cpu_group``, also
    when nothing is to verify, so the ranks stay in step): verify each request of the
    batch that carries a kvaudit checksum, once; abort a mismatch through SGLang's
    ``_handle_kv_checksum_mismatch`` and filter it from the batch.

    Returns:
        The indices (into the batch before filtering) of the aborted requests.

    """
    reqs = list(batch.reqs)
    if not reqs:
        return []
    # Per request: status (0 nothing to do, 1 verify, 2 unverified), total, residual.
    local: list[list[int]] = []
    reasons: dict[int, str] = {}
    ranges: dict[int, Carried] = {}
    for i, req in enumerate(reqs):
        carried = getattr(req, ATTRIBUTE, None)
        setattr(req, ATTRIBUTE, None)  # verified once (a retraction re-enters)
        if carried is None:
            local.append([0, 0, 0])
            continue
        if is_health_check_req(req):
            STATS.skipped += 1
            local.append([0, 0, 0])
            continue
        if isinstance(carried, Unverified):
            reasons[i] = carried.reason
            local.append([2, 0, 0])
            continue
        try:
            summer = rank_checksummer(scheduler, "consumer")
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
            if not carried.first < carried.end <= len(req.origin_input_ids):
                raise NotDescribable(
                    f"range {carried.first}..{carried.end} is not within the request's "
                    f"{len(req.origin_input_ids)} tokens"
                )
            row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            total, residual = summer.range_sums(row, carried.first, carried.end)
        except Exception as error:  # admitted unverified, with the reason
            reasons[i] = str(error)
            local.append([2, 0, 0])
            continue
        ranges[i] = carried
        local.append([1, total, residual])
    group = getattr(scheduler, "attn_tp_cpu_group", None)
    parts = gather_ranks(local, group)  # one collective: statuses and sums together
    statuses = [max(part[i][0] for part in parts) for i in range(len(reqs))]
    summed = [[sum(part[i][j] for part in parts) % MOD64 for j in (1, 2)] for i in range(len(reqs))]
    aborted: list[int] = []
    for i, req in enumerate(reqs):
        if statuses[i] == 0:
            continue
        if statuses[i] == 2 or i not in ranges:
            _unverified(req, reasons.get(i, "unverified on a peer rank"))
            continue
        carried = ranges[i]
        total, residual = summed[i]
        if total == carried.total and residual == 0:
            STATS.verified += 1
            continue
        what = "replicas disagree" if total == carried.total else "mismatch"
        msg = (
            f"kvaudit KV checksum {what} req={req.rid} tokens={carried.first}..{carried.end} "
            f"expected={carried.total:#018x} got={total:#018x} replica_residual={residual:#x}"
        )
        logger.error(msg)
        STATS.mismatched += 1
        aborted.append(i)
        scheduler._handle_kv_checksum_mismatch(req, msg)
    if aborted:
        batch.filter_batch(keep_indices=[i for i in range(len(reqs)) if i not in aborted])
    return aborted


def around_send_kv_chunk(original, self, req, last_chunk=False, end_idx=None):
    """AROUND hook of ``send_kv_chunk``: carry kvaudit's checksum with the last chunk."""
    if last_chunk:
        prefill_checksum(self, req, end_idx)
    return original(self, req, last_chunk=last_chunk, end_idx=end_idx)


def around_commit_transfer_to_req(original, self, decode_req, *args, **kwargs):
    """AROUND hook of ``DecodeTransferQueue._commit_transfer_to_req``: keep the row."""
    commit_carried(self, decode_req)
    return original(self, decode_req, *args, **kwargs)


def around_verify_kv_checksums(original, self, batch, *args, **kwargs):
    """AROUND hook of ``_verify_kv_checksums``: SGLang's own check, then kvaudit's on
    the requests it kept."""
    result = original(self, batch, *args, **kwargs)
    decode_verify(self, batch)
    return result


def register() -> None:
    """Register the three hooks with SGLang's ``HookRegistry`` when ``KVAUDIT_SGLANG_INLINE=1``.

    This is kvaudit's ``sglang.srt.plugins`` entry point, which SGLang's ``load_plugins()``
    runs in every scheduler process. Installing kvaudit beside SGLang turns nothing on:
    without the variable it registers nothing.
    """
    if os.environ.get("KVAUDIT_SGLANG_INLINE", "0") != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in (
        (PREFILL_TARGET, around_send_kv_chunk),
        (COMMIT_TARGET, around_commit_transfer_to_req),
        (VERIFY_TARGET, around_verify_kv_checksums),
    ):
        HookRegistry.register(target, hook, HookType.AROUND)
