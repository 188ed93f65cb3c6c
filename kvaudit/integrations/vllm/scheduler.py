"""The scheduler side of the audit: which blocks each worker checksums, the workers'
partial sums added up over TP ranks and PP stages, the producer's wire in
``kv_transfer_params``, and the consumer's comparison on arrival (docs/vllm.md).

It sees vLLM's objects only through the few attributes it reads, so that it is driven in
tests with vLLM's real scheduler output and request objects as well as plain data.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...core.errors import KvauditError
from ...output_folders import prompt_digest
from ...records import RequestChecksums, WorkerRecord, combine_workers
from ...records.wire import decode_wire, decode_wire_base64, encode_wire_base64
from .checks import (
    SEED_ONLY,
    AuditCounters,
    GroupLayout,
    compared_positions,
    compared_text,
    mismatch_line,
    position_span,
    replica_differences,
    strong_lanes,
)
from .config import AuditConfig
from .jobs import CONSUMER, PRODUCER, AuditJob, AuditStep, WorkerPartials

logger = logging.getLogger("kvaudit.vllm")

PARAM_WIRE = "kvaudit"
PARAM_ID = "kvaudit_id"
_STALE_INDEX_SIZE = 1 << 16
NULL_BLOCK = 0  # vLLM's block pool keeps block 0 as the null block of skipped positions


@dataclass
class _Request:
    request: str
    audit_id: str
    prompt_tokens: int
    prompt: str | None = None
    tables: list[list[int]] = field(default_factory=list)
    role: str | None = None
    produced: bool = False
    local_tokens: int = 0
    loaded_tokens: int = 0
    loaded_groups: tuple[int, ...] | None = None
    attempts: int = 0
    reported: bool = False
    load: str | None = None
    received: str | None = None
    consumer_due: bool = False
    params: dict[str, Any] | None = None
    wire: str | None = None
    jobs: dict[str, AuditJob] = field(default_factory=dict)
    partials: dict[str, dict[tuple[int, int], WorkerRecord]] = field(default_factory=dict)


def _prompt(request: Any) -> str | None:
    """The digest of a request's prompt tokens, which pairs it with the other engine's
    request of the same prompt when the engines name it differently (None: no token ids,
    as for a prompt given as embeddings)."""
    tokens = getattr(request, "prompt_token_ids", None)
    if not tokens:
        return None
    return prompt_digest(tokens)


class SchedulerAudit:
    """Audit state of one engine's scheduler."""

    def __init__(
        self,
        config: AuditConfig,
        groups: Mapping[int, GroupLayout],
        *,
        producer: bool,
        world_size: int,
        single_group: bool,
    ) -> None:
        self.config = config
        self.groups = dict(groups)
        self.producer = producer
        self.world_size = world_size
        self.single_group = single_group
        self.counters = AuditCounters()
        self._requests: dict[str, _Request] = {}
        self._step = AuditStep()
        self._stale: OrderedDict[tuple[int, int, int | None], tuple[str, int]] = OrderedDict()
        # Requests whose loaded KV failed its check under policy fail: never loaded again
        # (vLLM would load the same bad copy after recomputing from its first block).
        self.failed_checks: set[str] = set()

    # Requests coming in.

    def new_request(self, request: Any) -> None:
        """Note a request the engine took (``on_new_request``)."""
        rid = request.request_id
        params = request.kv_transfer_params or {}
        state = _Request(rid, str(params.get(PARAM_ID) or rid), int(request.num_prompt_tokens),
                         _prompt(request))  # fmt: skip
        wire = params.get(PARAM_WIRE)
        if isinstance(wire, str):
            state.received = wire
        self._requests[rid] = state

    def has_producer_checksums(self, request: Any) -> bool:
        """Whether the request came with a producer's checksums to compare."""
        state = self._requests.get(request.request_id)
        if state is not None:
            return state.received is not None
        return isinstance((request.kv_transfer_params or {}).get(PARAM_WIRE), str)

    def after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], local_tokens: int,
        external_tokens: int, load: str, loaded_groups: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """A consumer's blocks after vLLM allocated them (``update_state_after_alloc``):
        tokens ``local_tokens .. local_tokens + external_tokens`` are loaded (of the
        groups ``loaded_groups``; None: every audited group), the ones before held in
        its prefix cache."""
        state = self._requests.get(request.request_id)
        if state is None:
            self.new_request(request)
            state = self._requests[request.request_id]
        if external_tokens <= 0:
            if state.received is not None and state.role is None and not state.reported:
                # Nothing loads: its prefix is held here, or the connector has none of it.
                state.reported = True
                self._nothing_loaded(state, local_tokens)
            return
        state.role = CONSUMER
        state.local_tokens = int(local_tokens)
        state.loaded_tokens = int(local_tokens) + int(external_tokens)
        state.load = load
        state.loaded_groups = None if loaded_groups is None else tuple(loaded_groups)
        state.tables = [list(ids) for ids in block_ids]
        state.consumer_due = True

    def _nothing_loaded(self, state: _Request, local_tokens: int) -> None:
        held = {g: -(-local_tokens // layout.block_size) for g, layout in self.groups.items()}
        self.counters.local_blocks += sum(held.values())
        where = ", ".join(
            f"group {g} positions {position_span(0, n)}" for g, n in held.items() if n
        )
        logger.info(
            "kvaudit: request %s: nothing loaded (%s), computed here: not compared",
            state.audit_id,
            f"{local_tokens} tokens held in the prefix cache: {where}" if local_tokens
            else "the connector holds none of its KV",
        )  # fmt: skip

    # One step.

    def build(self, scheduler_output: Any) -> AuditStep:
        """This step's jobs (``build_connector_meta``)."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.tables = [list(ids) for ids in new.block_ids]
            self._maybe_produce(state, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._requests.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids:
                    state.tables = [list(ids) for ids in new_ids]
                else:
                    for table, ids in zip(state.tables, new_ids, strict=False):
                        table.extend(ids)
            self._maybe_produce(state, cached.num_computed_tokens[i], scheduled.get(rid, 0))
        for state in self._requests.values():
            if state.consumer_due:
                state.consumer_due = False
                self._add_consumer_job(state)
        if self.config.live_socket is not None:
            self._step.live = self._live_tables(scheduler_output)
        step, self._step = self._step, AuditStep()
        return step

    def _live_tables(self, scheduler_output: Any) -> dict[str, tuple[int, dict]]:
        """The block tables of this step's requests after its forward, for the agents."""
        scheduled = scheduler_output.num_scheduled_tokens
        computed = {
            new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        tables = {}
        for rid, done in computed.items():
            state = self._requests.get(rid)
            if state is not None and state.tables:
                tokens = int(done) + int(scheduled.get(rid, 0))
                tables[state.audit_id] = (tokens, self._groups_of(state, tokens, done=int(done)))
        return tables

    def _maybe_produce(self, state: _Request, done: int, scheduled: int) -> None:
        """A producer job once this step (``scheduled`` tokens after ``done``) completes
        the request's prompt."""
        if not self.producer or state.role == CONSUMER or state.produced:
            return
        if done + scheduled < state.prompt_tokens or state.prompt_tokens == 0:
            return
        state.role = PRODUCER
        state.produced = True
        job = AuditJob(
            state.request, state.audit_id, PRODUCER, state.prompt_tokens,
            self._groups_of(state, state.prompt_tokens, done=done),
            dump=self.config.rotate_dumps or self.dump_sampled(state.audit_id),
            prompt=state.prompt,
        )  # fmt: skip
        state.jobs[PRODUCER] = job
        self._step.jobs.append(job)

    def _add_consumer_job(self, state: _Request) -> None:
        num_tokens = state.loaded_tokens
        received = None
        if state.received is not None:
            try:
                wire = decode_wire_base64(state.received, f"request {state.request}")
                num_tokens = min(num_tokens, wire.num_tokens)
                received = base64.b64decode(state.received)
            except KvauditError as error:
                logger.warning("kvaudit: %s", error)
                state.received = None
        groups = self._groups_of(state, num_tokens, state.local_tokens)
        if state.loaded_groups is not None:  # the groups the connector's load restores
            groups = {g: v for g, v in groups.items() if g in state.loaded_groups}
        state.attempts += 1
        state.partials.pop(CONSUMER, None)
        job = AuditJob(
            state.request, state.audit_id, CONSUMER, num_tokens, groups, load=state.load,
            dump=self.dump_sampled(state.audit_id), received=received,
            local_tokens=state.local_tokens, attempt=state.attempts, prompt=state.prompt,
        )  # fmt: skip
        state.jobs[CONSUMER] = job
        self._step.jobs.append(job)

    def _groups_of(
        self, state: _Request, num_tokens: int, first_token: int = 0, done: int = 0
    ) -> dict[int, tuple[int, list[int]]]:
        """Per audited group, the first position and block ids of the request's tokens
        ``first_token .. num_tokens - 1`` (a position holding any token before
        ``first_token`` is left out). In a windowed group, positions out of the window
        once ``done`` tokens were computed (at this step's start) are left out too:
        vLLM freed their blocks then without saying so in its scheduler output, so the
        ids the tables still hold there may be another request's, or this one's at a
        later position."""
        out = {}
        for gid, layout in self.groups.items():
            if gid >= len(state.tables):
                continue
            count = -(-num_tokens // layout.block_size)
            ids = state.tables[gid][:count]
            start = max(-(-first_token // layout.block_size), layout.freed_positions(done))
            if layout.windowed:
                while start < len(ids) and ids[start] == NULL_BLOCK:
                    start += 1
            if start < len(ids):
                out[gid] = (start, ids[start:])
        return out

    def dump_sampled(self, audit_id: str) -> bool:
        """Whether both engines dump this request: a fraction ``dump_sample_rate`` of ids,
        chosen by the id's hash so producer and consumer choose alike."""
        rate = self.config.dump_sample_rate
        if rate <= 0 or self.config.max_dump_bytes <= 0 or self.config.output is None:
            return False
        digest = hashlib.sha256(audit_id.encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "little") < rate * 2**64

    # Requests going out.

    def finished(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """The request's ``kv_transfer_params`` with the producer's wire added."""
        state = self._requests.get(request.request_id)
        if state is None or state.role != PRODUCER:
            if state is None or CONSUMER not in state.jobs:
                # A consumer's checksums may still be on their way: kept until they are in.
                self._requests.pop(request.request_id, None)
            return params
        out = dict(params or {})
        out[PARAM_ID] = state.audit_id
        if state.wire is not None:
            out[PARAM_WIRE] = state.wire
            self._requests.pop(request.request_id, None)
        else:
            # The checksums of the step that finished the request arrive in this same
            # update of the scheduler, after request_finished: filled in then.
            state.params = out
        return out

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop requests that ended (``finished_req_ids``). A request that finished
        normally had the checksums of its last step in the update that finished it; one
        aborted meanwhile has its comparison dropped (some workers' checksums may never
        come: a worker drops a load that ends before it finished)."""
        for rid in request_ids:
            self._requests.pop(rid, None)
            self.failed_checks.discard(rid)

    def load_failed(self, request_ids: Iterable[str]) -> None:
        """Loads a worker's connector reported failed: no comparison (the other workers'
        checksums are dropped), and under policy ``fail`` the workers holding their part
        let it go, so that vLLM sees the failure (its aggregator reports a failed
        receive only once every worker reported the receive)."""
        self.give_up(request_ids, "its load failed on a worker", producers=False)

    def give_up(self, request_ids: Iterable[str], why: str, producers: bool = True) -> None:
        """Stop checking these requests: each in flight is counted and logged
        unverified, its workers' checksums are dropped, and a load held for its verdict
        (policy ``fail``) is let go.

        Args:
            request_ids: Engine request ids (ones not in flight are ignored).
            why: What the log line gives as the reason.
            producers: Also drop producer jobs (whose checksums are then not sent).
        """
        dropped = set()
        for rid in request_ids:
            state = self._requests.get(rid)
            if state is None:
                continue
            consumer = state.jobs.pop(CONSUMER, None)
            producer = state.jobs.pop(PRODUCER, None) if producers else None
            if consumer is None and producer is None:
                continue
            dropped.add(rid)
            state.partials.clear()
            if producer is not None and consumer is None:
                logger.warning("kvaudit: request %s: %s: its checksums are not sent",
                               state.audit_id, why)  # fmt: skip
                continue
            self.counters.unverified_requests += 1
            logger.warning("kvaudit: request %s: %s: not compared", state.audit_id, why)
            if self.config.policy == "fail" and state.load == "async":
                self._step.released.add(rid)
        # A job of this step not yet sent would be held after its release: not sent.
        self._step.jobs = [job for job in self._step.jobs if job.request not in dropped]

    def abandon(self) -> None:
        """Give up every request in flight, after an internal error of kvaudit's."""
        self.give_up(list(self._requests), "kvaudit failed while checking it (internal error)")

    # Worker results.

    def update(self, partials: Iterable[WorkerPartials]) -> None:
        """Add up the workers' partial sums; send or compare each request once every
        worker's are in (``update_connector_output``)."""
        for partial in partials:
            record = partial.record()
            worker = (record.worker.pp_rank, record.worker.tp_rank)
            for job in partial.jobs:
                state = self._requests.get(job.request)
                checksums = record.requests.get(job.request)
                if state is None or checksums is None:
                    continue
                current = state.jobs.get(job.role)
                if current is None or current.attempt != job.attempt:
                    continue  # a load that failed or was replaced: its comparison is gone
                single = WorkerRecord(
                    record.worker, record.positions, record.fingerprints, record.not_covered,
                    {job.request: checksums},
                )  # fmt: skip
                collected = state.partials.setdefault(job.role, {})
                collected[worker] = single
                if len(collected) == record.worker.tp_size * record.worker.pp_size:
                    combined = combine_workers(list(collected.values()))
                    del state.partials[job.role]
                    if job.role == PRODUCER:
                        self._produced(state, combined.requests[job.request], combined.positions)
                    else:
                        self._arrived(state, job, combined.requests[job.request])

    def _produced(self, state: _Request, checksums: RequestChecksums, positions: str) -> None:
        self.counters.producer_requests += 1
        state.wire = encode_wire_base64(checksums.to_wire(positions))
        if state.params is not None:
            state.params[PARAM_WIRE] = state.wire
            self._requests.pop(state.request, None)

    def _arrived(self, state: _Request, job: AuditJob, checksums: RequestChecksums) -> None:
        self.counters.consumer_requests += 1
        local = {
            gid: min(start, -(-job.local_tokens // self.groups[gid].block_size))
            for gid, (start, _) in job.groups.items()
        }
        self.counters.local_blocks += sum(local.values())
        if job.received is None:
            self.counters.unverified_requests += 1
            self.counters.unverified_blocks += sum(len(ids) for _, ids in job.groups.values())
            logger.info("kvaudit: request %s: no producer checksums received", state.audit_id)
            self._release(state, [])
            return
        wire = decode_wire(job.received, f"request {state.request}")
        bad_blocks: list[int] = []
        unverified = False
        for group in wire.groups:
            mine = checksums.groups.get(group.group_id)
            if mine is None:
                continue
            if mine.fingerprint != group.fingerprint:
                self.counters.not_comparable_groups += 1
                self.counters.unverified_blocks += mine.end - mine.start
                unverified = True
                logger.warning(
                    "kvaudit: request %s group %d not comparable: the engines' layers, "
                    "specs or dtypes differ (fingerprint %016x here, %016x sent)",
                    state.audit_id, group.group_id, mine.fingerprint, group.fingerprint,
                )  # fmt: skip
                continue
            compared, positions = compared_positions(group, mine, wire.num_tokens, job.num_tokens)
            positions += [p for p in replica_differences(mine) if p not in positions]
            lanes = strong_lanes(group, mine)
            self._index(state.audit_id, group.group_id, group.start, group.totals,
                        None if lanes is None else lanes[0])  # fmt: skip
            self.counters.checked_blocks += len(compared)
            skipped = mine.end - mine.start - len(compared)
            self.counters.unverified_blocks += skipped
            unverified |= skipped > 0
            held = local.get(group.group_id, 0)
            where = compared_text(compared, held, skipped)
            if lanes is None:
                where += f"; {SEED_ONLY}"
            if not positions:
                logger.info("kvaudit: request %s group %d: %s: match", state.audit_id,
                            group.group_id, where)  # fmt: skip
                continue
            start, ids = job.groups[group.group_id]
            blocks = [ids[p - start] for p in sorted(positions)]
            bad_blocks.extend(blocks)
            totals = mine.totals()
            stale = []
            for p in sorted(positions):
                row = p - mine.start
                key = (int(totals[row]), None if lanes is None else int(lanes[1][row]))
                found = self._stale.get((group.group_id, *key))
                if found is not None and found != (state.audit_id, p):
                    stale.append(f"position {p} holds {found[0]} position {found[1]}")
            logger.error(mismatch_line(state.audit_id, group.group_id, sorted(positions), blocks,
                                       where, stale, _STALE_INDEX_SIZE))  # fmt: skip
            self.counters.mismatched_blocks += len(positions)
        if bad_blocks:
            self.counters.mismatched_requests += 1
            if self.config.output is not None and self.config.max_dump_bytes > 0:
                self._step.dumps.append(job)
        elif unverified:
            self.counters.unverified_requests += 1
        self._release(state, bad_blocks)

    def _release(self, state: _Request, bad_blocks: list[int]) -> None:
        """Under policy ``fail``, report the differing blocks as load errors and let a
        held load finish."""
        if self.config.policy != "fail":
            return
        if bad_blocks:
            self.failed_checks.add(state.request)
            if self.single_group:
                self._step.load_errors.update(bad_blocks)
            else:
                self._step.failed_loads.add(state.request)
        if state.load == "async":
            self._step.released.add(state.request)

    def _index(
        self, audit_id: str, group_id: int, start: int, totals: np.ndarray,
        strong: np.ndarray | None,
    ) -> None:  # fmt: skip
        """Remember the producer's totals (both lanes where it sent both), to name the
        source of a stale block."""
        lanes = [None] * len(totals) if strong is None else strong.tolist()
        for offset, (value, residue) in enumerate(zip(totals.tolist(), lanes, strict=True)):
            key = (group_id, int(value), None if residue is None else int(residue))
            self._stale[key] = (audit_id, start + offset)
            self._stale.move_to_end(key)
        while len(self._stale) > _STALE_INDEX_SIZE:
            self._stale.popitem(last=False)

    def take_counters(self) -> AuditCounters:
        """The counters since the last call."""
        counters, self.counters = self.counters, AuditCounters()
        return counters
