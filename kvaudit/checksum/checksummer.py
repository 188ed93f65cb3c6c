"""The library's entry point: a worker's checksums of some requests' blocks.

``Checksummer`` takes a cache description, the worker's layer tensors (live, any strides,
on the CPU or a GPU; or a dump's memory-mapped rows) and its rank, builds the views and
plans once, then checksums requests into a ``WorkerRecord``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..core.errors import KvauditError
from ..core.scheme import valid_tokens
from ..core.validation import (
    MAX_POSITION_TOKEN,
    MAX_TOKENS,
    POSITION_NUMBERINGS,
    Positions,
    Role,
    check_worker,
    is_int,
    short,
)
from ..description import CacheDescription
from ..records import (
    GroupChecksums,
    LayerSums,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
)
from ..records.layers import layer_facts
from ..views import GroupViews, build_group_views
from ..views.inputs import LayerTensors, RequestBlocks, plain_requests, tensors_by_name
from .plans import GroupPlan, fuses_lanes, launch_fused, launch_torch, on_cuda

if TYPE_CHECKING:
    import torch

    from ..core.arrays import Array


class Checksummer:
    """Checksums one worker's KV cache blocks, as its description and rank say.

    A producer checksums replica 0 of each layer (any replica describes the same KV);
    a consumer or offload tier checksums every replica, so each can be checked.
    Example:
        One layer of 4 blocks of 2 tokens, 2 KV heads of 8 bf16 elements, layout ``NHTC``; a
        request's 4 tokens in blocks 2 and 0, then the same KV moved to blocks 3 and 1:

        >>> import numpy as np, torch
        >>> from kvaudit import Checksummer, RequestBlocks
        >>> from kvaudit.description import parse_description
        >>> description = parse_description({"kvaudit": 1, "num_blocks": 4, "groups": [{
        ...     "spec": {"type": "full_attention", "block_size": 2, "num_kv_heads": 2,
        ...              "head_size": 8, "dtype": "bfloat16", "layout": "NHTC"},
        ...     "layers": ["model.layers.0.self_attn.attn"]}]}, "example")
        >>> cache = torch.randn(4, 2, 2, 16).to(torch.bfloat16)  # [blocks, heads, tokens, K|V]
        >>> summer = Checksummer(description, {"model.layers.0.self_attn.attn": cache})
        >>> first = summer.checksum({"req-1": RequestBlocks(4, {0: (0, [2, 0])})})
        >>> first.requests["req-1"].groups[0].values.shape  # per block position, per replica key
        (2, 1)
        >>> cache[[3, 1]] = cache[[2, 0]]  # the views are over the live tensor
        >>> moved = summer.checksum({"req-1": RequestBlocks(4, {0: (0, [3, 1])})})
        >>> np.array_equal(moved.requests["req-1"].groups[0].values,
        ...                first.requests["req-1"].groups[0].values)
        True

    """

    @classmethod
    def of_worker(
        cls,
        description: CacheDescription,
        tensors: LayerTensors,
        worker: WorkerInfo,
        *,
        backend: str = "auto",
        num_blocks: int | Mapping[int, int] | None = None,
        source: str = "",
        layer_sums: bool = False,
    ) -> Checksummer:
        """A checksummer over ``tensors`` in ``worker``'s place (ranks, role, engine).

        Args:
            description: The worker's cache description.
            tensors: The worker's layer tensors, as ``Checksummer`` takes them.
            worker: The worker's ranks, sizes, role and engine.
            backend: As ``Checksummer`` takes it.
            num_blocks: As ``Checksummer`` takes it.
            source: What names the tensors in errors and in the record.
            layer_sums: As ``Checksummer`` takes it.

        Returns:
            The checksummer, its views and plans built.

        Raises:
            KvauditError: As ``Checksummer`` raises it.
            ValueError: As ``Checksummer`` raises it.

        """
        return cls(
            description,
            tensors,
            tp_rank=worker.tp_rank,
            tp_size=worker.tp_size,
            pp_rank=worker.pp_rank,
            pp_size=worker.pp_size,
            role=worker.role,
            backend=backend,
            num_blocks=num_blocks,
            engine=worker.engine,
            source=source,
            layer_sums=layer_sums,
        )

    def __init__(
        self,
        description: CacheDescription,
        tensors: LayerTensors,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        role: Role = "consumer",
        backend: str = "auto",
        num_blocks: int | Mapping[int, int] | None = None,
        engine: str = "",
        source: str = "",
        left_out: Mapping[int, str] | None = None,
        strong_lane: bool = True,
        layer_sums: bool = False,
    ) -> None:
        """Build the worker's views and plans once (and warm up their kernels).

        A group whose tensors cannot be checksummed is not an error: ``not_covered``
        gives the reason.

        Args:
            description: The worker's cache description.
            tensors: ``{layer name: tensor}`` (or ``{name: (k, v)}``) in the layouts the
                description gives, any strides, on the CPU or a GPU; or vLLM's
                ``kv_caches`` list, one tensor per layer in the description's layer order.
            tp_rank: The worker's TP rank.
            tp_size: The engine's TP size.
            pp_rank: The worker's PP rank.
            pp_size: The engine's PP size.
            role: ``"producer"`` checksums replica 0 of each layer; ``"consumer"`` and
                ``"offload"`` checksum every replica.
            backend: ``"auto"`` (Triton on CUDA tensors, numpy on the CPU), ``"numpy"``,
                ``"torch"``, ``"triton"`` or one ``register_backend`` added.
            num_blocks: The number of manager blocks the tensors hold, for every group or
                per group id; None for each group's block space (its own ``num_blocks``,
                else the description's).
            engine: The engine's name, kept in the record.
            source: What names the tensors in errors and in the record.
            left_out: The worker's groups that the description does not hold, with the
                reason (an engine's group its integration cannot describe); every record
                reports them as not covered.
            strong_lane: Whether records carry the strong lane beside the seed lane
                (docs/checksum.md); False computes the seed lane alone, as the seed
                engine's records hold it.
            layer_sums: Also split each block's seed-lane total per layer and K or V plane
                (``GroupChecksums.layer_sums``), in the same pass over the KV.

        Raises:
            KvauditError: An unknown role, a rank outside its size, a left-out group that
                the description holds, a ``kv_caches`` list of the wrong length, tensors
                that are neither a mapping nor a list, or a layer whose heads contradict
                the description's ``model_kv_heads``.
            ValueError: An unknown ``backend``, once a group can be checksummed.

        """
        self.left_out = dict(left_out or {})
        self.strong_lane = strong_lane
        self.worker = WorkerInfo(tp_rank, tp_size, pp_rank, pp_size, role, engine, source)
        check_worker(self.worker, role, source or None)
        self.description = description
        # Kept in every record: what the checksums cannot show (the scales of a quantized
        # cache) and what names the field behind a differing fingerprint.
        self.layer_facts = layer_facts(description)
        described = {group.id for group in description.groups} & self.left_out.keys()
        if described:
            raise KvauditError(
                f"group {min(described)} is left out, but the description holds it",
                source or None,
            )
        # Each group's rows (groups may have block spaces of their own); ``num_blocks``
        # is the top-level space's, or the one count given for every group.
        self.group_rows = description.group_rows(num_blocks)
        self.num_blocks = num_blocks if isinstance(num_blocks, int) else description.num_blocks
        self.groups: dict[int, GroupViews] = build_group_views(
            description,
            tensors_by_name(description, tensors, source or None),
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_blocks=self.group_rows,
        )
        self.plans: dict[int, GroupPlan] = {}
        for group_id, group_views in self.groups.items():
            if not group_views.covered:
                continue
            plan = GroupPlan.create(
                group_views.views,
                first_replica_only=role == "producer",
                backend=backend,
                layer_sums=layer_sums,
            )
            if plan is not None:
                plan.warm_up()
                if strong_lane and fuses_lanes(plan):
                    from .kernels import triton_strong

                    triton_strong.warm_up(plan, fused=True)
                self.plans[group_id] = plan

    @property
    def fingerprints(self) -> dict[int, int]:
        """Each group's fingerprint on this worker."""
        return {group_id: views.fingerprint for group_id, views in self.groups.items()}

    @property
    def not_covered(self) -> dict[int, str]:
        """The groups that cannot be checksummed, with the reason (``left_out`` too)."""
        reasons = {
            group_id: views.reason
            for group_id, views in self.groups.items()
            if views.reason is not None
        }
        return {**self.left_out, **reasons}

    def checksum(
        self, requests: Mapping[str, RequestBlocks], positions: Positions = "request"
    ) -> WorkerRecord:
        """This worker's partial checksums of the requests' blocks in every covered group.

        ``positions="block"`` numbers pieces from each block's first token instead of the
        request's. Block ids may be lists of ints, numpy arrays or torch tensors.

        Args:
            requests: Per request id, its token count and, per group, the position of the
                first listed block and the block ids of consecutive positions.
            positions: ``"request"`` or ``"block"``: how pieces are numbered.

        Returns:
            The worker's record: per request, each covered group's checksums per block
            position and replica key.

        Raises:
            KvauditError: An unknown position numbering, or a request whose token count,
                group, start position or block ids cannot be right (a block id outside
                the cache or listed twice).

        """
        if positions not in POSITION_NUMBERINGS:
            raise KvauditError(
                f"unknown position numbering {positions!r}, expected request or block"
            )
        return self.launch(requests, positions).result()

    def launch(
        self, requests: Mapping[str, RequestBlocks], positions: Positions = "request"
    ) -> PendingChecksums:
        """Start the checksums of the requests' blocks without waiting for them.

        The checksums are queued on the current device stream and their asynchronous
        copy to the host started; ``result()`` of what it returns waits for that copy.
        On the CPU everything is computed before it returns.

        Args:
            requests: As ``checksum`` takes them.
            positions: As ``checksum`` takes it.

        Returns:
            The pending checksums, whose ``result()`` is what ``checksum`` returns.

        Raises:
            KvauditError: As ``checksum`` raises it.

        """
        if positions not in POSITION_NUMBERINGS:
            raise KvauditError(
                f"unknown position numbering {positions!r}, expected request or block"
            )
        record = WorkerRecord(
            self.worker,
            positions,
            self.fingerprints,
            self.not_covered,
            requests={},
            layers=self.layer_facts,
        )
        # One pass per group over the rows of all requests.
        batches: dict[int, list[tuple[str, int, list[int], int]]] = {}
        for req_id, blocks in plain_requests(requests, self.worker.source or None).items():
            _check_request(req_id, blocks, self.groups, self.group_rows, self.worker.source)
            record.requests[req_id] = RequestChecksums(blocks.num_tokens)
            for group_id, (start, block_ids) in blocks.groups.items():
                if group_id in self.plans:
                    batches.setdefault(group_id, []).append(
                        (req_id, start, list(block_ids), blocks.num_tokens)
                    )
        # Queue every group's launches before reading any result back: one wait in all.
        launched: list[Launched] = []
        for group_id, segments in batches.items():
            plan = self.plans[group_id]
            rows = np.stack(_rows(segments, self.groups[group_id].group.block_size, positions))
            strong: Array | None = None
            if self.strong_lane and fuses_lanes(plan):
                host, strong = launch_fused(plan, rows)
            else:
                host = plan.checksum(*rows) if not plan.uses_torch else launch_torch(plan, rows)
                strong = plan.strong(*rows) if self.strong_lane else None
            launched.append(Launched(group_id, segments, host, strong))
        done = None
        if any(on_cuda(self.plans[item.group_id].device) for item in launched):
            import torch

            done = torch.cuda.Event()
            done.record()
        return PendingChecksums(record, launched, self, done)


@dataclass(frozen=True)
class Launched:
    """One group's rows on their way: the segments (request, start, block ids, tokens),
    the seed lane's values (host or device) and the strong lane's residues (or None)."""

    group_id: int
    segments: list[tuple[str, int, list[int], int]]
    host: Array
    strong: Array | None


@dataclass(eq=False)
class PendingChecksums:
    """A worker's checksums on their way to the host.

    ``ready()`` says whether the copy finished, ``result()`` waits for it and gives the
    ``WorkerRecord``.
    """

    _record: WorkerRecord
    _launched: list[Launched]
    _checksummer: Checksummer
    _done: torch.cuda.Event | None
    _result: WorkerRecord | None = field(default=None, init=False)

    def ready(self) -> bool:
        """Whether ``result()`` would return without waiting."""
        return self._result is not None or self._done is None or self._done.query()

    def result(self) -> WorkerRecord:
        """The worker's record, once the values reached the host.

        Returns:
            The record ``launch`` started; every call returns the same one.

        """
        if self._result is not None:
            return self._result
        if self._done is not None:
            self._done.synchronize()
        record, summer = self._record, self._checksummer
        for launched in self._launched:
            group_id, host, strong = launched.group_id, launched.host, launched.strong
            wide = (host if isinstance(host, np.ndarray) else host.numpy()).view(np.uint64)
            if strong is not None and not isinstance(strong, np.ndarray):
                strong = strong.numpy().view(np.uint64)
            plan = summer.plans[group_id]
            values, sums = plan.split(wide)
            parts = plan.layer_parts
            row = 0
            for req_id, start, block_ids, _ in launched.segments:
                end = row + len(block_ids)
                record.requests[req_id].groups[group_id] = GroupChecksums(
                    block_size=summer.groups[group_id].group.block_size,
                    start=start,
                    replica_keys=list(summer.plans[group_id].replica_keys),
                    values=values[row:end].copy(),
                    fingerprint=summer.groups[group_id].fingerprint,
                    strong=None if strong is None else strong[row:end].copy(),
                    layer_sums=None
                    if sums is None
                    else LayerSums(list(parts), sums[row:end].copy()),
                )
                row = end
        self._result, self._launched = record, []
        return record


def _rows(
    segments: list[tuple[str, int, list[int], int]], block_size: int, positions: Positions
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``block_ids, first_tokens, valid_tokens`` of a group's rows."""
    ids = np.array([i for _, _, block_ids, _ in segments for i in block_ids], dtype=np.int64)
    lengths = np.array([len(block_ids) for _, _, block_ids, _ in segments], dtype=np.int64)
    starts = np.repeat(np.array([s for _, s, _, _ in segments], dtype=np.int64), lengths)
    num_tokens = np.repeat(np.array([n for _, _, _, n in segments], dtype=np.int64), lengths)
    first_rows = np.repeat(np.cumsum(lengths) - lengths, lengths)
    block_positions = starts + np.arange(len(ids), dtype=np.int64) - first_rows
    first_tokens = block_positions * block_size
    valid = valid_tokens(num_tokens, block_size, block_positions)
    if positions == "block":
        first_tokens = np.zeros_like(first_tokens)
    return ids, first_tokens, valid


def _check_request(
    req_id: str,
    blocks: RequestBlocks,
    groups: Mapping[int, GroupViews],
    group_rows: Mapping[int, int],
    source: str,
) -> None:
    """Reject a request whose token count, positions or block ids cannot be right."""
    where = source or None
    if not is_int(blocks.num_tokens) or not 0 <= blocks.num_tokens <= MAX_TOKENS:
        raise KvauditError(
            f"request {req_id}: num_tokens must be an integer from 0 to {MAX_TOKENS}, "
            f"got {short(blocks.num_tokens)}",
            where,
        )
    for group_id, (start, block_ids) in blocks.groups.items():
        if group_id not in groups:
            raise KvauditError(f"request {req_id}: unknown group {group_id}", where)
        if not is_int(start) or start < 0:
            raise KvauditError(
                f"request {req_id} group {group_id}: start position must be a non-negative "
                f"integer, got {short(start)}",
                where,
            )
        # A trimmed source lists positions past its tokens (they count none); positions
        # are only kept from overflowing 64-bit integers here.
        end = (int(start) + len(block_ids)) * groups[group_id].group.block_size
        if end > MAX_POSITION_TOKEN:
            raise KvauditError(
                f"request {req_id} group {group_id}: {len(block_ids)} positions from {start} "
                f"reach past token {MAX_POSITION_TOKEN}",
                where,
            )
        seen: set[int] = set()
        num_blocks = group_rows[group_id]
        for block_id in block_ids:
            if not is_int(block_id) or not 0 <= block_id < num_blocks:
                raise KvauditError(
                    f"request {req_id} group {group_id}: block id {block_id!r} is not in the "
                    f"cache (0..{num_blocks - 1})",
                    where,
                )
            if block_id in seen:
                raise KvauditError(
                    f"request {req_id} group {group_id}: block {block_id} is listed at two "
                    "positions",
                    where,
                )
            seen.add(block_id)
