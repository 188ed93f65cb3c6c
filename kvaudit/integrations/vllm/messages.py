"""The connector's messages through vLLM: metadata to the workers, worker metadata back
to the scheduler, and connector stats; each carries the wrapped connector's own."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from .checks import AuditCounters
from .jobs import AuditStep, WorkerPartials

STATS_KEY = "kvaudit"


@dataclass
class KVAuditMetadata(KVConnectorMetadata):
    """Scheduler to workers: the wrapped connector's metadata and this step's audit work."""

    inner: KVConnectorMetadata | None
    audit: AuditStep = field(default_factory=AuditStep)


@dataclass
class KVAuditWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers to scheduler: the wrapped connector's worker metadata, the workers'
    partial checksums (summed by the scheduler over TP ranks and PP stages), the
    audited loads a worker's connector reported failed, and the requests a worker could
    not check (``unverified``: kvaudit's own failure, a verdict that did not come)."""

    inner: KVConnectorWorkerMetadata | None = None
    partials: list[WorkerPartials] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    unverified: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """This worker's and another's, together (vLLM calls it once per worker)."""
        assert isinstance(other, KVAuditWorkerMetadata)
        if self.inner is None:
            inner = other.inner
        elif other.inner is None:
            inner = self.inner
        else:
            inner = self.inner.aggregate(other.inner)
        return KVAuditWorkerMetadata(
            inner,
            [*self.partials, *other.partials],
            self.failed | other.failed,
            self.unverified | other.unverified,
        )


def class_path(cls: type | None) -> str | None:
    """``module:qualname`` of a class, to find it again in another process."""
    return None if cls is None else f"{cls.__module__}:{cls.__qualname__}"


def load_class(path: str | None) -> type | None:
    """The class at a ``class_path``."""
    if not path:
        return None
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass
class KVAuditStats(KVConnectorStats):
    """The audit's counters (requests audited, mismatches, groups not comparable) beside
    the wrapped connector's stats."""

    inner: KVConnectorStats | None = None
    inner_class: str | None = None

    def __post_init__(self) -> None:
        self.data.setdefault(STATS_KEY, AuditCounters().as_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            STATS_KEY: dict(self.data[STATS_KEY]),
            "wrapped": None if self.inner is None else self.inner.to_dict(),
            "wrapped_class": self.inner_class,
        }

    def reset(self) -> None:
        self.data[STATS_KEY] = AuditCounters().as_dict()
        if self.inner is not None:
            self.inner.reset()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        assert isinstance(other, KVAuditStats)
        counts = self.data[STATS_KEY]
        for key, value in other.data[STATS_KEY].items():
            counts[key] = counts.get(key, 0) + value
        if self.inner is None:
            self.inner, self.inner_class = other.inner, other.inner_class
        elif other.inner is not None:
            self.inner = self.inner.aggregate(other.inner)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            f"kvaudit_{key}": value for key, value in self.data[STATS_KEY].items()
        }
        if self.inner is not None and not self.inner.is_empty():
            out.update(self.inner.reduce())
        return out

    def is_empty(self) -> bool:
        return not any(self.data[STATS_KEY].values()) and (
            self.inner is None or self.inner.is_empty()
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> KVAuditStats:
        """The stats ``to_dict`` gave, the wrapped connector's rebuilt by its class."""
        data = data or {}
        inner = None
        inner_class = data.get("wrapped_class")
        wrapped_cls = load_class(inner_class)
        if wrapped_cls is not None and data.get("wrapped") is not None:
            inner = wrapped_cls.build_kv_connector_stats(data["wrapped"])
        counts = dict(AuditCounters().as_dict(), **data.get(STATS_KEY, {}))
        return cls(data={STATS_KEY: counts}, inner=inner, inner_class=inner_class)


class KVAuditPromMetrics(KVConnectorPromMetrics):
    """kvaudit's counters as Prometheus counters (``vllm:kvaudit_<counter>``, per engine),
    and the wrapped connector's part of the stats handed to its own metrics."""

    def __init__(self, inner: KVConnectorPromMetrics | None, *args: Any) -> None:
        super().__init__(*args)
        self.inner = inner
        self.counters = {
            key: create_metric_per_engine(self._counter(key), self.per_engine_labelvalues)
            for key in AuditCounters().as_dict()
        }

    def _counter(self, key: str) -> Any:
        """One counter per stat logger, shared by the kvaudit connectors it builds metrics
        for (prometheus refuses a second metric of one name): vLLM hands them all the
        same ``per_engine_labelvalues``, and a new logger, new ones."""
        shared = (self._counter_cls, key)
        built = _COUNTERS.get(shared)
        if built is None or built[0] is not self.per_engine_labelvalues:
            metric = self._counter_cls(
                name=f"vllm:kvaudit_{key}",
                documentation=f"kvaudit: {COUNTER_HELP[key]}",
                labelnames=self._labelnames,
            )
            _COUNTERS[shared] = built = (self.per_engine_labelvalues, metric)
        return built[1]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data[STATS_KEY].items():
            if key in self.counters and value:
                self.counters[key][engine_idx].inc(value)
        wrapped = transfer_stats_data.get("wrapped")
        if wrapped is not None and self.inner is not None:
            self.inner.observe(wrapped, engine_idx)


_COUNTERS: dict[tuple[type, str], tuple[dict[int, list[object]], Any]] = {}


COUNTER_HELP = {
    "producer_requests": "requests whose checksums the producer sent",
    "consumer_requests": "loaded requests the consumer checked",
    "mismatched_requests": "loaded requests with a block that differs from the producer's",
    "mismatched_blocks": "loaded blocks that differ from the producer's",
    "not_comparable_groups": "groups whose layers, specs or dtypes differ between engines",
    "unverified_requests": "loaded requests with a block not compared",
    "checked_blocks": "loaded blocks compared with the producer's",
    "unverified_blocks": "loaded blocks not compared",
    "local_blocks": "blocks held in the consumer's prefix cache, not transferred",
    "declined_sync_loads": "synchronous loads declined under policy fail",
    "dumps_written": "dumps written to the output folder",
    "overhead_seconds": "host seconds spent in kvaudit's calls on the workers",
    "internal_errors": "failures of kvaudit's own code, caught (the engine went on)",
}
