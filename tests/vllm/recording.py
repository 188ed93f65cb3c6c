"""A connector that records every call and returns a distinct object per method: the
connector kvaudit wraps in the delegation test (loaded through vLLM's factory by module
path)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

CALLS: list[tuple[str, tuple, dict]] = []
RETURNS: dict[str, Any] = {}

INSTANCE_METHODS = (
    "get_mem_pool_context", "bind_connector_metadata", "clear_connector_metadata",
    "register_kv_caches", "unregister_kv_caches", "restore_kv_caches",
    "set_host_xfer_buffer_ops", "finish_forward", "reset_capture_state",
    "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_finished", "get_transfer_results",
    "get_block_ids_with_load_errors", "shutdown", "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events", "get_handshake_metadata",
    "build_connector_worker_meta", "bind_kv_cache_manager", "bind_gpu_block_pool",
    "get_loaded_kv_cache_group_ids", "get_num_new_matched_tokens",
    "get_external_cache_hit_sources", "update_state_after_alloc", "build_connector_meta",
    "on_new_request", "update_connector_output", "request_finished",
    "register_finished_partial_tail", "take_events", "has_pending_block_frees",
    "has_pending_push_work", "get_finished_count", "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware", "reset_cache", "request_finished_all_groups",
)  # fmt: skip
CLASS_METHODS = (
    "supports_sleep_mode", "get_required_kvcache_layout", "requires_piecewise_for_cudagraph",
    "build_prom_metrics", "build_kv_connector_stats",
)  # fmt: skip
PROPERTIES = ("supports_divergent_local_hybrid_hits", "requires_kv_delivery")


def _method(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        CALLS.append((name, args, kwargs))
        return RETURNS.get(name)

    return method


def _class_method(name: str) -> Any:
    def method(cls: type, *args: Any, **kwargs: Any) -> Any:
        CALLS.append((name, args, kwargs))
        return RETURNS.get(name)

    return classmethod(method)


def _property(name: str) -> Any:
    def getter(self: Any) -> Any:
        CALLS.append((name, (), {}))
        return RETURNS.get(name)

    return property(getter)


_body: dict[str, Any] = {name: _method(name) for name in INSTANCE_METHODS}
_body.update({name: _class_method(name) for name in CLASS_METHODS})
_body.update({name: _property(name) for name in PROPERTIES})
RecordingConnector = type("RecordingConnector", (KVConnectorBase_V1, SupportsHMA), _body)
