"""One SGLang rank's part of kvaudit's checksum of a request's tokens, and its sum over
the ranks of a process group: what the inline hooks (``inline``) compute on both sides of
a transfer. Imports SGLang (through ``describe``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from ...core.scheme import STRONG_PRIME
from ...description import parse_description
from ...records import WorkerInfo, WorkerRecord
from ...views.inputs import RequestBlocks
from . import hooked
from .carried import MOD64, MOMENTS, GroupWord, content_signature, group_signature
from .describe import describe_sglang_cache, sglang_layer_caches
from .pages import pool_request_blocks, request_blocks
from .pools import DEFAULT_LAYER_NAME, LayerNames, NotDescribable, hybrid_layer_ids

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.memory_pool import KVCache, ReqToTokenPool

PRODUCER, CONSUMER = "producer", "consumer"
ENGINES = {PRODUCER: "SGLang prefill", CONSUMER: "SGLang decode"}
LayerSpan = tuple[int, int]
"""Global SGLang layer ids ``first .. end - 1``."""


class RankChecksummer:
    """kvaudit's checksummer over some layers (default: all) of one rank's SGLang pool,
    with their ``content_signature``."""

    def __init__(
        self,
        pool: KVCache,
        *,
        tp_rank: int,
        tp_size: int,
        pp_rank: int = 0,
        pp_size: int = 1,
        total_kv_heads: int | None,
        role: str,
        names: LayerNames = DEFAULT_LAYER_NAME,
        layers: LayerSpan | None = None,
        sliding_window: int | None = None,
        attention: Mapping[int, torch.nn.Module] | None = None,
        layer_sums: bool = False,
    ) -> None:
        from ...checksum.checksummer import Checksummer

        raw = describe_sglang_cache(
            pool,
            tp_rank=tp_rank,
            tp_size=tp_size,
            total_kv_heads=total_kv_heads,
            names=names,
            sliding_window=sliding_window,
            attention=attention,
        )
        ids = hybrid_layer_ids(pool)
        held = (ids[0], ids[-1] + 1)
        span = held if layers is None else (int(layers[0]), int(layers[1]))
        if not held[0] <= span[0] < span[1] <= held[1]:
            raise NotDescribable(
                f"layers {span[0]}..{span[1] - 1} are not all on this rank "
                f"(it holds {held[0]}..{held[1] - 1})"
            )
        if span != held and len(raw["groups"]) > 1:
            raise NotDescribable("a hybrid pool's layers are checksummed all together only")
        caches = sglang_layer_caches(pool, names)
        if span != held:
            (group,) = raw["groups"]
            chosen = [
                entry
                for i, entry in zip(ids, group["layers"], strict=True)
                if span[0] <= i < span[1]
            ]
            raw = {**raw, "groups": [{**group, "layers": chosen}]}
            # An entry is a name, or a mapping with its name (a layer with its own scales).
            kept = [entry if isinstance(entry, str) else entry["name"] for entry in chosen]
            caches = {name: caches[name] for name in kept}
        self.raw = raw
        self.description = parse_description(raw, "sglang")
        self.tensors = caches
        self.pool = pool
        self.sliding_window = sliding_window
        self.page_size = int(pool.page_size)
        self.layers = span
        self.signature = content_signature(raw, tp_size=tp_size)
        self.group_ids = [int(group["id"]) for group in raw["groups"]]
        """The description's groups; more than one: the pool is hybrid (group words)."""
        self.state_groups = frozenset(
            int(group["id"]) for group in raw["groups"] if group["spec"]["type"] == "mamba"
        )
        """The groups of states (no positions): weight 0 in the moments."""
        self.group_signatures = {
            g: group_signature(raw, g, tp_size) for g in self.group_ids if len(self.group_ids) > 1
        }
        self.worker = WorkerInfo(tp_rank, tp_size, pp_rank, pp_size, role, ENGINES[role])
        self.checksummer = Checksummer(
            self.description,
            caches,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            role=role,
            engine=ENGINES[role],
            layer_sums=layer_sums,
        )
        if self.checksummer.not_covered:
            raise NotDescribable(
                f"kvaudit cannot checksum the pool: {self.checksummer.not_covered}"
            )

    def range_blocks(self, row: torch.Tensor, first: int, end: int) -> RequestBlocks:
        """The blocks of tokens ``first .. end - 1`` of a request whose ``req_to_token``
        row is ``row``.

        Raises:
            NotDescribable: A range not on a page boundary, or slots not where the pages
                put them.

        """
        page = self.page_size
        if first % page:
            raise NotDescribable(f"the range starts at token {first}, not a {page}-token page")
        part = request_blocks(row[first:end], end - first, page)
        return RequestBlocks(num_tokens=end, groups={0: (first // page, part.groups[0][1])})

    def request_range(
        self, req_to_token_pool: ReqToTokenPool, req_pool_idx: int, first: int, end: int
    ) -> RequestBlocks:
        """The blocks of tokens ``first .. end - 1`` of the request in row
        ``req_pool_idx``, in every group of the pool (``pool_request_blocks``).

        Raises:
            NotDescribable: As ``range_blocks``; a window or state SGLang does not map.

        """
        if len(self.group_ids) == 1:
            return self.range_blocks(req_to_token_pool.req_to_token[req_pool_idx], first, end)
        return pool_request_blocks(
            self.pool,
            req_to_token_pool,
            req_pool_idx,
            first,
            end,
            sliding_window=self.sliding_window,
        )

    def group_words(self, record: WorkerRecord, request: str) -> list[GroupWord]:
        """This rank's ``(group id, group signature, sum)`` per group of a hybrid pool
        (empty for one group); the sums are this rank's part of the group's strong lane
        modulo ``2**64 - 59`` (its part of the moment ``M_0``, ``strong_moments``)."""
        page = self.page_size
        return [
            (g, self.group_signatures[g], self.moments(record, request, page, g)[0][0])
            for g in self.group_ids
            if len(self.group_ids) > 1
        ]

    def moments(
        self, record: WorkerRecord, request: str, unit: int, group: int | None = None
    ) -> tuple[list[int], list[int]]:
        """``strong_moments`` of this rank's record over units of ``unit`` tokens, of
        ``group`` (None: every group), its state groups weighted 0."""
        return strong_moments(record, request, self.page_size, unit, group, self.state_groups)

    def range_record(self, request: str, blocks: RequestBlocks) -> WorkerRecord:
        """This rank's per-block checksums of the request's ``blocks``."""
        return self.checksummer.checksum({request: blocks})


def block_sums(record: WorkerRecord, request: str, group: int | None = 0) -> tuple[int, int]:
    """A rank's part of the request's checksum summed over its blocks, and its replica
    residual.

    The total is the sum over the blocks of the replica-0 columns. The residual is the sum
    of the other replicas' columns minus ``R - 1`` times the replica-0 columns: summed over
    the ranks it is 0 when every replica holds the same KV (always 0 for a producer, which
    checksums replica 0 only; a producer's rank holding only other replicas adds 0).

    Args:
        record: The rank's record of the request (``RankChecksummer.range_record``).
        request: The request.
        group: The group summed, or None for every group of the record.

    Returns:
        ``(total, residual)``, each mod 2**64.

    """
    if group is None:
        parts = [block_sums(record, request, g) for g in record.requests[request].groups]
        return (
            sum(total for total, _ in parts) % MOD64,
            sum(residual for _, residual in parts) % MOD64,
        )
    checksums = record.requests[request].groups.get(group)
    if checksums is None:  # a producer's rank that holds no replica 0 (MLA at TP > 1)
        return 0, 0
    columns = checksums.values.sum(axis=0, dtype="uint64").tolist()
    total = residual = 0
    for (replicas, index), value in zip(checksums.replica_keys, columns, strict=True):
        if index == 0:
            total += int(value)
            residual -= (replicas - 1) * int(value)
        else:
            residual += int(value)
    return total % MOD64, residual % MOD64


def strong_moments(
    record: WorkerRecord,
    request: str,
    page: int,
    unit: int,
    group: int | None = None,
    states: Collection[int] = (),
) -> tuple[list[int], list[int]]:
    """A rank's part of the strong lane's moments over the request's units, and of its
    replica residuals (docs/sglang.md, "Inline verification").

    Per block ``p`` of a paged group (in unit ``j = p * page // unit``, weight ``x = j +
    1``; a hybrid pool's window pages are numbered by their positions as the full pool's
    are), the block's strong lane ``S`` is the sum of its replica-0 columns and its
    residual the other replicas' columns minus ``R - 1`` times replica 0's, all modulo
    ``2**64 - 59``. A state group's block (``states``: the whole request's state, no
    position) has weight ``x = 0``. The moments are ``sum x**m * S`` (m = 0, 1, 2), the
    residual's ``sum x**m * residual`` (m = 0, 1): summed over the ranks, the residuals
    are 0 when every replica holds the same KV, and a difference confined to one or two
    units never cancels.

    Args:
        record: The rank's record of the request (``RankChecksummer.range_record``).
        request: The request.
        page: The paged groups' block size (tokens).
        unit: The tokens of a unit, a multiple of ``page``.
        group: The group summed, or None for every group of the record.
        states: The state groups' ids (weight 0).

    Returns:
        ``(moments, residual moments)``, residues modulo ``2**64 - 59``.

    Raises:
        ValueError: A record without the strong lane.

    """
    prime = STRONG_PRIME
    moments, residuals = [0] * MOMENTS, [0, 0]
    held = record.requests[request].groups
    for g in sorted(held) if group is None else [group]:
        checksums = held.get(g)
        if checksums is None:  # a producer's rank that holds no replica 0 (MLA at TP > 1)
            continue
        if checksums.strong is None:
            raise ValueError("the rank's checksums hold no strong lane")
        first = np.uint64(checksums.start)
        positions = np.arange(checksums.count, dtype=np.uint64) + first
        if g in states:
            x = np.zeros_like(positions)
        else:
            x = positions * np.uint64(page) // np.uint64(unit) + np.uint64(1)  # below 2**32
        weights = [np.ones_like(x), x, x * x]  # x**2 below 2**64: exact
        for (replicas, index), column in zip(
            checksums.replica_keys, checksums.strong.T, strict=True
        ):
            # The moments are linear: each column's, exact, then added with its coefficient.
            sums = [exact_dot(column, w) for w in weights]
            if index == 0:
                moments = [(a + b) % prime for a, b in zip(moments, sums, strict=True)]
                factor = -(replicas - 1)
            else:
                factor = 1
            residuals = [(r + factor * v) % prime for r, v in zip(residuals, sums, strict=False)]
    return moments, residuals


def exact_dot(values: np.ndarray, weights: np.ndarray) -> int:
    """``sum(values * weights)`` as an exact Python integer, for uint64 arrays: each
    product split into 32-bit limbs, whose sums stay below 2**64 for fewer than 2**32
    entries."""
    mask, shift = np.uint64(0xFFFF_FFFF), np.uint64(32)
    v = np.ascontiguousarray(values, dtype=np.uint64)
    w = np.ascontiguousarray(weights, dtype=np.uint64)
    total = 0
    for a, a_shift in ((v & mask, 0), (v >> shift, 32)):
        for b, b_shift in ((w & mask, 0), (w >> shift, 32)):
            product = a * b  # both below 2**32: exact
            low = int((product & mask).sum(dtype=np.uint64))
            high = int((product >> shift).sum(dtype=np.uint64))
            total += (low + (high << 32)) << (a_shift + b_shift)
    return total


def gather_ranks(rows: list[list[int]], group: dist.ProcessGroup | None) -> list[list[list[int]]]:
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


def group_sums(
    rows: list[list[int]], group: dist.ProcessGroup | None, modulus: int = MOD64
) -> list[list[int]]:
    """Per entry, the sum modulo ``modulus`` over the group's ranks of every rank's
    ``rows`` (``gather_ranks``): 2**64 for the seed lane, ``2**64 - 59`` for the strong
    lane's residues (gathered whole and added as Python integers, never wrapped)."""
    parts = gather_ranks(rows, group)
    return [
        [sum(part[i][j] for part in parts) % modulus for j in range(len(row))]
        for i, row in enumerate(rows)
    ]


def attention_tp(scheduler: Scheduler) -> tuple[dist.ProcessGroup, int, int]:
    """A scheduler's attention TP CPU group, its rank in it and the group's size.

    Args:
        scheduler: The SGLang scheduler.

    Returns:
        ``(group, rank, size)``.

    Raises:
        NotInThisSglang: A scheduler without ``attn_tp_cpu_group``.

    """
    group = hooked.read(scheduler, hooked.ATTN_TP_CPU_GROUP)
    return group, dist.get_rank(group), dist.get_world_size(group)


def pipeline_ranks() -> tuple[int, int]:
    """This process's PP rank and size as SGLang publishes them."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return int(parallel.pp_rank or 0), int(parallel.pp_size or 1)
    except Exception:  # not published (a pool used outside a scheduler): no PP
        return 0, 1
