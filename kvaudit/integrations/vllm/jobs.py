"""What the scheduler side tells the workers each step, and what workers send back: plain
data, picklable, without vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...checksum.checksummer import PendingChecksums
from ...records import WorkerRecord

PRODUCER = "producer"
CONSUMER = "consumer"


@dataclass(frozen=True)
class AuditJob:
    """One request to checksum on every worker.

    ``request``: the engine's request id; ``audit_id``: the id records and dumps use (the
    producer's request id, so both engines name a request alike); ``role``: ``producer``
    (after this step's forward) or ``consumer``; ``load``: ``sync`` (loaded before this
    step's forward) or ``async`` (checksummed once the load is reported finished);
    ``groups``: per group, the first position and the block ids of consecutive positions;
    ``local_tokens``: a consumer's tokens held in its prefix cache, not loaded (their
    positions are not in ``groups``); ``attempt``: which load of the request (vLLM loads
    again after a failed one): checksums of an earlier attempt are dropped; ``prompt``:
    the digest of the request's prompt tokens (``output.prompt_digest``), written with its
    checksums so that ``kvaudit diff`` pairs requests the engines name differently.
    """

    request: str
    audit_id: str
    role: str
    num_tokens: int
    groups: dict[int, tuple[int, list[int]]]
    load: str | None = None
    dump: bool = False
    received: bytes | None = None
    local_tokens: int = 0
    attempt: int = 0
    prompt: str | None = None


@dataclass
class AuditStep:
    """The scheduler's audit work for one step: new jobs, blocks to report as load errors
    (policy ``fail``), held loads whose verdict is in, consumer jobs whose check failed
    (``dumps``: dumped before this step's forward); with ``live_socket``, the
    block tables of the requests in the cache after this step (``live``: id to token
    count and, per group, first position and block ids)."""

    jobs: list[AuditJob] = field(default_factory=list)
    load_errors: set[int] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)
    dumps: list[AuditJob] = field(default_factory=list)
    live: dict[str, tuple[int, dict[int, tuple[int, list[int]]]]] | None = None

    def __bool__(self) -> bool:
        return bool(
            self.jobs or self.load_errors or self.failed_loads or self.released or self.dumps
        )


@dataclass
class WorkerPartials:
    """One worker's checksums of one launch, with the jobs they belong to. The values
    reach the host asynchronously: ``record()`` waits; pickling (to the scheduler's
    process) waits too, off the forward's path."""

    jobs: list[AuditJob]
    pending: PendingChecksums | None = None
    _record: WorkerRecord | None = None

    def record(self) -> WorkerRecord:
        """The worker's record of the jobs' requests (keyed by engine request id)."""
        if self._record is None:
            assert self.pending is not None
            self._record = self.pending.result()
            self.pending = None
        return self._record

    def ready(self) -> bool:
        """Whether ``record()`` returns without waiting."""
        return self._record is not None or self.pending is None or self.pending.ready()

    def __getstate__(self) -> dict[str, object]:
        return {"jobs": self.jobs, "pending": None, "_record": self.record()}
