"""Every method of vLLM's KVConnectorBase_V1, called on kvaudit's connector, reaches the
wrapped connector (loaded through vLLM's factory) with the same arguments, and its result
comes back unchanged (inside kvaudit's own metadata and stats, where vLLM passes those
through the connector)."""

from __future__ import annotations

import inspect
from typing import Any

import harness as h
import pytest
import recording
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvaudit.integrations.vllm import KVAuditConnector, KVAuditHMAConnector
from kvaudit.integrations.vllm.class_queries import ClassQueries
from kvaudit.integrations.vllm.messages import (
    KVAuditMetadata,
    KVAuditPromMetrics,
    KVAuditStats,
    KVAuditWorkerMetadata,
)
from kvaudit.integrations.vllm.scheduler_hooks import SchedulerHooks
from kvaudit.integrations.vllm.worker_hooks import WorkerHooks

WRAPPED = {"kv_connector": "RecordingConnector", "kv_connector_module_path": "recording"}
PLUMBING = {"role", "has_connector_metadata", "_get_connector_metadata"}


class Marker:
    """A distinct object a method returns."""

    def __init__(self, name: str) -> None:
        self.name = name


class Stats(KVConnectorStats):
    def is_empty(self) -> bool:
        return False

    def reduce(self) -> dict[str, int | float]:
        return {"inner_n": self.data["n"]}


def connector(role: KVConnectorRole, cls: str = "KVAuditConnector") -> Any:
    ktc = h.transfer_config({}, WRAPPED, role="kv_consumer")
    ktc.kv_connector = cls
    config = h.vllm_config(ktc, 16)
    spec = h.attention_spec(16, 2, 8)
    return KVConnectorFactory.create_connector(
        config, role, h.cache_config(spec, 1, 8, h.KVCacheLayout.LBHNC)
    )


def last_call(name: str) -> tuple[tuple, dict]:
    calls = [(args, kwargs) for called, args, kwargs in recording.CALLS if called == name]
    assert calls, f"{name} was not delegated"
    return calls[-1]


def test_every_base_method_is_overridden() -> None:
    """The table below covers every public method and property of the base class."""
    names = {
        name
        for name, value in vars(KVConnectorBase_V1).items()
        if not name.startswith("__")
        and (callable(value) or isinstance(value, (property, classmethod)))
    } - PLUMBING
    tested = (
        set(recording.INSTANCE_METHODS) | set(recording.CLASS_METHODS) | set(recording.PROPERTIES)
    )
    assert names <= tested
    own = set(vars(KVAuditConnector)) | set(vars(KVAuditHMAConnector))
    own |= set(vars(ClassQueries))  # the class methods, asked of the wrapped class
    own |= set(vars(SchedulerHooks)) | set(vars(WorkerHooks))  # the hooks of each side
    assert names | {"request_finished_all_groups"} <= own
    assert issubclass(KVAuditHMAConnector, SupportsHMA)
    assert not issubclass(KVAuditConnector, SupportsHMA)


def request() -> Request:
    return Request("r1", [1, 2, 3], SamplingParams(max_tokens=1), None)


def test_scheduler_side_delegation() -> None:
    recording.CALLS.clear()
    conn = connector(KVConnectorRole.SCHEDULER, "KVAuditHMAConnector")
    assert type(conn.wrapped).__name__ == "RecordingConnector"
    req = request()
    blocks = KVCacheBlocks(((),))
    output = SchedulerOutput.make_empty()
    cases: list[tuple[str, tuple, Any]] = [
        ("on_new_request", (req,), None),
        ("get_num_new_matched_tokens", (req, 5), (7, True)),
        ("get_external_cache_hit_sources", (req, 3), {"x": 3}),
        ("update_state_after_alloc", (req, blocks, 0), None),
        ("get_loaded_kv_cache_group_ids", (req,), (0,)),
        ("register_finished_partial_tail", (req, ([1],), [(0, 1, 2)]), True),
        ("take_events", (), Marker("events")),
        ("has_pending_block_frees", (), True),
        ("has_pending_push_work", (), True),
        ("get_finished_count", (), 3),
        ("set_xfer_handshake_metadata", ({0: Marker("hs")},), None),
        ("set_xfer_handshake_metadata_pp_aware", ({(0, 0): Marker("hs")},), None),
        ("reset_cache", (), True),
        ("bind_gpu_block_pool", (Marker("pool"),), None),
        ("request_finished", (req, [4, 5]), (True, {"remote": 1})),
        ("request_finished_all_groups", (req, ([4, 5],)), (True, {"remote": 2})),
    ]
    for name, args, value in cases:
        recording.RETURNS[name] = value
        result = getattr(conn, name)(*args)
        assert last_call(name) == (args, {}), name
        assert result == value and (value is None or type(result) is type(value)), name
    manager = Marker("manager")
    conn.bind_kv_cache_manager(manager)
    assert last_call("bind_kv_cache_manager") == ((manager,), {})

    inner_meta = Marker("meta")
    recording.RETURNS["build_connector_meta"] = inner_meta
    meta = conn.build_connector_meta(output)
    assert last_call("build_connector_meta") == ((output,), {})
    assert isinstance(meta, KVAuditMetadata) and meta.inner is inner_meta

    worker_meta = Marker("worker meta")
    sent = KVConnectorOutput(
        finished_sending={"a"},
        invalid_block_ids={9},
        kv_connector_worker_meta=KVAuditWorkerMetadata(worker_meta),
    )
    conn.update_connector_output(sent)
    (got,), _ = last_call("update_connector_output")
    assert got.kv_connector_worker_meta is worker_meta
    assert (got.finished_sending, got.invalid_block_ids) == ({"a"}, {9})

    inner_stats = Stats(data={"n": 1})
    recording.RETURNS["get_kv_connector_stats"] = inner_stats
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, KVAuditStats) and stats.inner is inner_stats


def test_worker_side_delegation() -> None:
    recording.CALLS.clear()
    conn = connector(KVConnectorRole.WORKER)
    caches = {"other.layer": torch.zeros(1)}
    conn.register_kv_caches(caches)
    assert last_call("register_kv_caches") == ((caches,), {})
    tensor = torch.zeros(2)
    results = KVConnectorTransferResults({"s"}, {"r"}, set())
    cases: list[tuple[str, tuple, dict, Any]] = [
        ("unregister_kv_caches", (), {}, None),
        ("restore_kv_caches", (), {}, None),
        ("set_host_xfer_buffer_ops", (print,), {}, None),
        ("get_mem_pool_context", (), {}, Marker("pool")),
        ("finish_forward", (), {}, None),
        ("reset_capture_state", (), {}, None),
        ("start_load_kv", (Marker("ctx"),), {"extra": 1}, None),
        ("wait_for_layer_load", ("layer",), {}, None),
        ("save_kv_layer", ("layer", tensor, Marker("attn")), {"more": 2}, None),
        ("wait_for_save", (), {}, None),
        ("get_finished", ({"x"},), {}, ({"s"}, {"r"})),
        ("get_transfer_results", ({"x"},), {}, results),
        ("get_block_ids_with_load_errors", (), {}, {3, 4}),
        ("get_kv_connector_kv_cache_events", (), {}, Marker("events")),
        ("get_handshake_metadata", (), {}, Marker("handshake")),
        ("shutdown", (), {}, None),
    ]
    for name, args, kwargs, value in cases:
        recording.RETURNS[name] = value
        result = getattr(conn, name)(*args, **kwargs)
        assert last_call(name) == (args, kwargs), name
        assert result == value, name
    inner = Marker("inner meta")
    conn.bind_connector_metadata(KVAuditMetadata(inner))
    assert last_call("bind_connector_metadata") == ((inner,), {})
    conn.handle_preemptions(KVAuditMetadata(inner))
    assert last_call("handle_preemptions") == ((inner,), {})
    conn.clear_connector_metadata()
    assert last_call("clear_connector_metadata") == ((), {})
    worker_meta = Marker("worker meta")
    recording.RETURNS["build_connector_worker_meta"] = worker_meta
    built = conn.build_connector_worker_meta()
    assert isinstance(built, KVAuditWorkerMetadata) and built.inner is worker_meta


@pytest.mark.parametrize("name", recording.PROPERTIES)
def test_properties(name: str) -> None:
    conn = connector(KVConnectorRole.SCHEDULER)
    recording.RETURNS[name] = Marker(name)
    assert getattr(conn, name) is recording.RETURNS[name]


def test_class_methods() -> None:
    recording.CALLS.clear()
    ktc = h.transfer_config({}, WRAPPED)
    config = h.vllm_config(ktc, 16)
    recording.RETURNS.update(supports_sleep_mode=False, get_required_kvcache_layout="HND",
                             requires_piecewise_for_cudagraph=True)  # fmt: skip
    assert KVAuditConnector.supports_sleep_mode(ktc) is False
    (inner_ktc,), _ = last_call("supports_sleep_mode")
    assert inner_ktc.kv_connector == "RecordingConnector" and inner_ktc.kv_role == ktc.kv_role
    assert KVAuditConnector.get_required_kvcache_layout(config) == "HND"
    (inner_config,), _ = last_call("get_required_kvcache_layout")
    assert inner_config.kv_transfer_config.kv_connector == "RecordingConnector"
    assert KVAuditConnector.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config)
    assert last_call("requires_piecewise_for_cudagraph") == (({},), {})
    recording.RETURNS["build_kv_connector_stats"] = Stats(data={"n": 2})
    rebuilt = KVAuditConnector.build_kv_connector_stats(
        {"kvaudit": {"mismatched_blocks": 3}, "wrapped": {"n": 2},
         "wrapped_class": "recording:RecordingConnector"}
    )  # fmt: skip
    assert last_call("build_kv_connector_stats") == (({"n": 2},), {})
    assert rebuilt.inner.data == {"n": 2}
    reduced = rebuilt.reduce()
    assert (reduced["kvaudit_mismatched_blocks"], reduced["inner_n"]) == (3, 2)
    recording.RETURNS["build_prom_metrics"] = None
    registry = CollectorRegistry()
    types = {cls: h.bound_metric(cls, registry) for cls in (Counter, Gauge, Histogram)}
    metrics = KVAuditConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})
    assert last_call("build_prom_metrics")[0][1:] == (types, ["engine"], {0: ["0"]})
    # kvaudit's own counters, with or without the wrapped connector's metrics.
    assert isinstance(metrics, KVAuditPromMetrics) and metrics.inner is None
    metrics.observe({"kvaudit": {"checked_blocks": 4}, "wrapped": {"n": 1}}, 0)
    assert registry.get_sample_value("vllm:kvaudit_checked_blocks_total", {"engine": "0"}) == 4
    assert inspect.signature(KVAuditConnector.build_prom_metrics)
