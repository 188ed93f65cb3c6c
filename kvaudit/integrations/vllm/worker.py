"""The worker side of the audit: checksums of the blocks the scheduler names, taken when
the KV is complete, without blocking the forward pass (docs/vllm.md).

On a GPU the checksums run on a side stream that waits for the forward's stream, and their
values are copied to pinned host memory asynchronously; the next step's stream waits for
the side stream before it can overwrite a block. On the CPU they are computed directly.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import torch

from ... import output_folders as output
from ...checksum.checksummer import Checksummer, RequestBlocks
from ...core.errors import KvauditError
from ...description import CacheDescription
from ...dumps import write_dump
from ...dumps.writing import dump_bytes
from ...live import Agent
from ...records import WorkerInfo
from ...views import LayerTensor
from .config import AuditConfig
from .jobs import CONSUMER, PRODUCER, AuditJob, AuditStep, WorkerPartials

logger = logging.getLogger("kvaudit.vllm")

HOLD_LIMIT_S = 120.0
"""The longest a worker holds a finished load for the scheduler's verdict (policy
``fail``): past it the load is let go and the request reported unverified, so that no
request waits forever on a verdict that cannot come."""


class WorkerAudit:
    """One worker's audit: its checksummers, the jobs waiting for their KV, the checksums
    on their way to the scheduler and to the output folder."""

    def __init__(
        self,
        description: CacheDescription,
        description_dict: Mapping[str, object],
        tensors: Mapping[str, LayerTensor],
        worker: WorkerInfo,
        config: AuditConfig,
        left_out: Mapping[int, str] | None = None,
    ) -> None:
        """``left_out``: the engine's groups the description could not hold, with why
        (``describe_vllm_cache``): not covered in every record."""
        self.config = config
        self.worker = worker
        self.description = description
        self.tensors = dict(tensors)
        common = {
            "tp_rank": worker.tp_rank,
            "tp_size": worker.tp_size,
            "pp_rank": worker.pp_rank,
            "pp_size": worker.pp_size,
            "backend": config.backend,
            "engine": worker.engine,
            "source": f"worker pp{worker.pp_rank} tp{worker.tp_rank}",
            "left_out": left_out,
            # Only the output folder's lines carry them (the wire and the verdict do not).
            "layer_sums": config.layer_sums and config.output is not None,
        }
        self.checksummers = {
            PRODUCER: Checksummer(description, self.tensors, role="producer", **common),
            CONSUMER: Checksummer(description, self.tensors, role="consumer", **common),
        }
        devices = {
            torch.device(p.device) for c in self.checksummers.values() for p in c.plans.values()
        }
        self.stream = (
            torch.cuda.Stream(device=next(iter(devices)))
            if any(d.type == "cuda" for d in devices)
            else None
        )
        for group_id, reason in self.checksummers[CONSUMER].not_covered.items():
            logger.warning("kvaudit: KV cache group %d is not audited: %s", group_id, reason)
        if config.output is not None:
            output.write_description(config.output, description_dict, worker)
        self._due: list[AuditJob] = []
        self._waiting_loads: dict[str, AuditJob] = {}
        self._held: set[str] = set()
        self._held_since: dict[str, float] = {}
        self._unverified: set[str] = set()
        self._warned_write = False
        self._released: set[str] = set()
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()
        self._outgoing: list[WorkerPartials] = []
        self._unwritten: list[WorkerPartials] = []
        self._budget = output.DumpBudget(config.max_dump_bytes)
        self._dumped: set[tuple[str, str]] = set()
        self._failed_here: set[str] = set()
        self.dumps_written = 0
        self.overhead_seconds = 0.0
        self._live: dict[str, RequestBlocks] = {}
        self.agent = None
        if config.live_socket is not None:
            name = f"pp{worker.pp_rank}-tp{worker.tp_rank}.sock"
            self.agent = Agent(
                os.path.join(config.live_socket, name),
                description,
                self.tensors,
                lambda: self._live,
                **{key: common[key] for key in ("tp_rank", "tp_size", "pp_rank", "pp_size")},
                engine=worker.engine,
                backend=config.backend,
            )

    def bind(self, step: AuditStep | None) -> None:
        """Take the scheduler's work for this step; order this step's stream after the
        checksums still reading blocks."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        if step is None:
            return
        for request in step.released - self._held:
            # Its comparison was dropped before this worker's part finished (another
            # worker's failed): never held, never checksummed.
            self._waiting_loads.pop(request, None)
        for job in step.jobs:
            if job.role == CONSUMER and job.load == "async":
                self._waiting_loads[job.request] = job
            else:
                self._due.append(job)
        self._load_errors |= step.load_errors
        self._failed |= step.failed_loads & self._held
        self._released |= step.released & self._held
        for job in step.dumps:
            # Its check failed: dumped now, before this step's forward or loads write.
            self._dump(job)
        if step.live is not None:
            self._live = {rid: RequestBlocks(n, groups) for rid, (n, groups) in step.live.items()}

    def forward_done(self) -> None:
        """Checksum this step's producer jobs and sync loads (their KV is complete)."""
        jobs, self._due = self._due, []
        self._launch(jobs)
        if self.agent is not None:
            self.agent.poll()  # the step boundary: this step's blocks are written

    def transfer_results(
        self, finished_recving: set[str], failed_recving: set[str], ended: set[str]
    ) -> tuple[set[str], set[str]]:
        """Checksum the loads reported finished; under policy ``fail`` hold them until
        the scheduler's verdict. A request that ended (``finished_req_ids``: finished,
        aborted) is never held: vLLM frees a loading request's blocks only when its
        receive is reported. Returns the finished and failed receives to report."""
        self.forward_done()
        for request in ended:
            self._waiting_loads.pop(request, None)
        loaded = []
        for request in finished_recving:
            job = self._waiting_loads.pop(request, None)
            if job is not None and request in failed_recving:
                self._failed_here.add(request)  # the other workers' parts are let go
            elif job is not None:
                loaded.append(job)
        self._launch(loaded)
        finished = set(finished_recving)
        failed = set(failed_recving)
        if self.config.policy != "fail":
            return finished, failed
        held_now = {job.request for job in loaded}
        self._held |= held_now
        now = time.monotonic()
        self._held_since.update((request, now) for request in held_now)
        finished -= held_now
        overdue = {r for r in self._held if now - self._held_since.get(r, now) > HOLD_LIMIT_S}
        if overdue:
            logger.warning(
                "kvaudit: no verdict for requests %s within %.0f s: let go, unverified",
                sorted(overdue), HOLD_LIMIT_S,
            )  # fmt: skip
            self._unverified |= overdue
        verdicts = (self._released | self._failed | ended | overdue) & self._held
        finished |= verdicts
        failed |= (self._failed & verdicts) - ended
        self._held -= verdicts
        for request in verdicts:
            self._held_since.pop(request, None)
        self._released -= verdicts
        self._failed -= verdicts
        return finished, failed

    def waiting_load(self, request: str) -> AuditJob | None:
        """The job of a load this worker waits to checksum (None: none waiting).

        Args:
            request: The engine's request id.

        Returns:
            The job: its audit id and, per group, the first position and block ids.
        """
        return self._waiting_loads.get(request)

    def load_errors(self) -> set[int]:
        """Blocks the scheduler found corrupted (policy ``fail``), reported once."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def partials(self) -> list[WorkerPartials]:
        """This step's checksums for the scheduler; writes those that reached the host."""
        out, self._outgoing = self._outgoing, []
        if self._unwritten:
            began = time.perf_counter()
            self._write(final=False)
            self.overhead_seconds += time.perf_counter() - began
        return out

    def failed_loads(self) -> set[str]:
        """This worker's audited loads its connector reported failed, for the scheduler."""
        failed, self._failed_here = self._failed_here, set()
        return failed

    def unverified(self) -> set[str]:
        """Requests this worker gave up checking since the last call (an internal error,
        a verdict that did not come in time), for the scheduler to report unverified.

        Returns:
            Engine request ids.
        """
        out, self._unverified = self._unverified, set()
        return out

    def abandon(self) -> set[str]:
        """Drop every request in flight after an internal error: each is reported
        unverified to the scheduler; loads held for a verdict are let go.

        Returns:
            The held loads to report finished to vLLM now.
        """
        touched = {job.request for job in self._due}
        touched |= set(self._waiting_loads) | self._held
        touched |= {job.request for p in self._outgoing + self._unwritten for job in p.jobs}
        held = set(self._held)
        self._due, self._outgoing, self._unwritten = [], [], []
        self._waiting_loads.clear()
        self._held.clear()
        self._held_since.clear()
        self._released.clear()
        self._failed.clear()
        self._unverified |= touched
        return held

    def take_counters(self) -> dict[str, int | float]:
        """The worker's counters since the last call (dumps written, host seconds)."""
        counters = {"dumps_written": self.dumps_written, "overhead_seconds": self.overhead_seconds}
        self.dumps_written, self.overhead_seconds = 0, 0.0
        return counters

    def close(self) -> None:
        """Write every checksum still on its way; stop the live agent."""
        if self.agent is not None:
            self.agent.close()
        self._write(final=True)

    def _launch(self, jobs: list[AuditJob]) -> None:
        if not jobs:
            return
        began = time.perf_counter()
        try:
            self._launch_roles(jobs)
        finally:
            self.overhead_seconds += time.perf_counter() - began

    def _launch_roles(self, jobs: list[AuditJob]) -> None:
        for role in (PRODUCER, CONSUMER):
            chosen = [job for job in jobs if job.role == role]
            if not chosen:
                continue
            summer = self.checksummers[role]
            blocks = {
                job.request: RequestBlocks(
                    job.num_tokens, {g: v for g, v in job.groups.items() if g in summer.groups}
                )
                for job in chosen
            }
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
                with torch.cuda.stream(self.stream):
                    pending = summer.launch(blocks, self.config.positions)
            else:
                pending = summer.launch(blocks, self.config.positions)
            partial = WorkerPartials(chosen, pending)
            self._outgoing.append(partial)
            self._unwritten.append(partial)
            for job in chosen:
                if job.dump:
                    self._dump(job)

    def _dump(self, job: AuditJob) -> None:
        """Dump the request's blocks of the job's role, within ``max_dump_bytes``."""
        if self.config.output is None or (job.request, job.role) in self._dumped:
            return
        began = time.perf_counter()
        try:
            self._write_dump(job)
        finally:
            self.overhead_seconds += time.perf_counter() - began

    def _write_dump(self, job: AuditJob) -> None:
        assert self.config.output is not None
        size = self._job_bytes(job)
        rotating = job.role == PRODUCER and self.config.rotate_dumps
        path = output.dump_path(self.config.output, job.audit_id, self.worker.pp_rank,
                                self.worker.tp_rank)  # fmt: skip
        if not self._budget.admits(path, size, rotating=rotating):
            logger.info("kvaudit: request %s not dumped: max_dump_bytes reached", job.audit_id)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        info = WorkerInfo(
            self.worker.tp_rank, self.worker.tp_size, self.worker.pp_rank, self.worker.pp_size,
            job.role, self.worker.engine,
        )  # fmt: skip
        received = {job.audit_id: job.received} if job.received else None
        groups = {g: v for g, v in job.groups.items() if g in self.checksummers[job.role].groups}
        try:
            write_dump(
                path, self.description, self.tensors,
                {job.audit_id: RequestBlocks(job.num_tokens, groups)},
                worker=info, received=received,
            )  # fmt: skip
        except KvauditError as error:
            logger.warning("kvaudit: request %s not dumped: %s", job.audit_id, error)
            return
        if job.role == CONSUMER:  # a sampled dump and a failed check's: one dump
            self._dumped.add((job.request, job.role))
        self._budget.written(path, size, rotating=rotating)
        self.dumps_written += 1

    def _job_bytes(self, job: AuditJob) -> int:
        """The bytes a dump of the job's blocks holds (every layer's rows)."""
        return dump_bytes(self.description, self.tensors, [RequestBlocks(0, job.groups)])

    def _write(self, final: bool) -> None:
        """Append the checksums that reached the host (all of them if ``final``)."""
        if self.config.output is None:
            self._unwritten = []
            return
        lines = []
        keep = []
        for partial in self._unwritten:
            if not final and not partial.ready():
                keep.append(partial)
                continue
            record = partial.record()
            for job in partial.jobs:
                checksums = record.requests.get(job.request)
                if checksums is not None:
                    lines.append(output.checksum_line(record, checksums, job.audit_id,
                                                      job.role, prompt=job.prompt))  # fmt: skip
        self._unwritten = keep
        if not lines:
            return
        try:
            output.append_checksums(self.config.output, lines, self.worker)
        except OSError as error:  # a full disk: the verdicts stand, the folder lacks them
            if not self._warned_write:
                self._warned_write = True
                logger.warning("kvaudit: checksums not written to %s: %s (logged once)",
                               self.config.output, error)  # fmt: skip
