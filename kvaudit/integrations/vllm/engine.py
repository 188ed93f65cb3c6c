"""What kvaudit's connector reads of the engine: the wrapped connector's transfer config,
this worker's ranks, the audited groups and the model's KV head count."""

from __future__ import annotations

import copy
import dataclasses

from vllm.config import KVTransferConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from .checks import GroupLayout

AUDIT_KEY = "kvaudit"
WRAPPED_KEY = "wrapped"


def wrapped_transfer_config(config: KVTransferConfig) -> KVTransferConfig | None:
    """The wrapped connector's ``KVTransferConfig`` (None: nothing wrapped).

    Args:
        config: kvaudit's connector's transfer config; ``"wrapped"`` in its
            ``kv_connector_extra_config`` names the wrapped connector (any connector
            vLLM's factory loads, by registry name or module path, ``MultiConnector``
            included) and its settings.

    Returns:
        ``"wrapped"``'s fields laid over this connector's other fields (role, engine id,
        ports, ...), so that the wrapped connector sees the config it would see alone.

    Raises:
        ValueError: ``"wrapped"`` is not a mapping with ``kv_connector``.

    Example:
        >>> outer = KVTransferConfig(kv_connector="KVAuditConnector", kv_role="kv_consumer",
        ...     kv_connector_extra_config={"wrapped": {"kv_connector": "NixlConnector"}})
        >>> wrapped_transfer_config(outer).kv_connector  # doctest: +SKIP
        'NixlConnector'
    """
    wrapped = config.kv_connector_extra_config.get(WRAPPED_KEY)
    if wrapped is None:
        return None
    if not isinstance(wrapped, dict) or not wrapped.get("kv_connector"):
        raise ValueError(
            "kv_connector_extra_config.wrapped: expected a mapping with kv_connector, "
            f"got {wrapped!r}"
        )
    own = ("kv_connector", "kv_connector_module_path", "kv_connector_extra_config")
    base = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.init and f.name not in own
    }
    return KVTransferConfig(**{**base, **wrapped})


# vLLM's connectors whose loads are synchronous by design (they load in start_load_kv,
# before the forward that samples from the loaded KV).
SYNC_LOADING = ("ExampleConnector", "DecodeBenchConnector")


def refuse_sync_loading(config: KVTransferConfig) -> None:
    """Refuse policy ``fail`` around a connector that loads synchronously.

    Raises:
        ValueError: ``config`` names (or, as MultiConnector, holds) such a connector.

    """
    names = [config.kv_connector]
    if config.kv_connector == "MultiConnector":
        names += [
            c.get("kv_connector") for c in config.kv_connector_extra_config.get("connectors", [])
        ]
    for name in names:
        if name in SYNC_LOADING:
            raise ValueError(
                f"kvaudit: policy fail cannot hold a synchronous load ({name} loads before "
                "the forward that samples from it, and the check needs every worker's "
                'checksums, which meet only after that step): use policy "log" with '
                f"{name}, or an asynchronous connector (docs/vllm.md)"
            )


def with_transfer_config(vllm_config: VllmConfig, config: KVTransferConfig) -> VllmConfig:
    """A shallow copy of ``vllm_config`` with ``config`` as its transfer config."""
    out = copy.copy(vllm_config)
    out.kv_transfer_config = config
    return out


def worker_ranks(vllm_config: VllmConfig) -> tuple[int, int, int, int]:
    """``(tp_rank, tp_size, pp_rank, pp_size)`` of this worker."""
    from vllm.distributed import parallel_state

    parallel = vllm_config.parallel_config
    if not parallel_state.model_parallel_is_initialized():
        return 0, parallel.tensor_parallel_size, 0, parallel.pipeline_parallel_size
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pp_group().rank_in_group,
        parallel_state.get_pp_group().world_size,
    )


def group_layouts(kv_cache_config: KVCacheConfig) -> dict[int, GroupLayout]:
    """The transfer groups of attention layers, with their block sizes."""
    out = {}
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        if not group.enable_kv_transfer or not all(isinstance(s, AttentionSpec) for s in specs):
            continue
        windowed = any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) for s in specs)
        window = max((s.sliding_window for s in specs if isinstance(s, SlidingWindowSpec)),
                     default=0)  # fmt: skip
        chunk = max((s.attention_chunk_size for s in specs
                     if isinstance(s, ChunkedLocalAttentionSpec)), default=0)  # fmt: skip
        out[group_id] = GroupLayout(int(spec.block_size), windowed, int(window), int(chunk))
    return out


def model_kv_heads(vllm_config: VllmConfig) -> int | None:
    """The model's KV head count when every attention layer has it (None: unknown)."""
    model = vllm_config.model_config
    if model is None:
        return None
    try:
        total = model.get_total_num_kv_heads()
    except (AttributeError, ValueError):
        return None
    global_heads = getattr(model.hf_text_config, "num_global_key_value_heads", None)
    return total if global_heads in (None, total) else None
