"""vLLM's decisions made from the configured connector's name, which do not see the
connector kvaudit wraps: kvaudit's start-up checks in their place (docs/vllm.md, "What
vLLM decides by name").

vLLM asks ``KVTransferConfig.has_connector(name)``, which answers from
``kv_connector`` (and a ``MultiConnector``'s children) alone: with
``"kv_connector": "KVAuditConnector"`` it answers False for the connector under
``"wrapped"``. Until vLLM asks the connector's class (the hook docs/vllm.md proposes),
kvaudit's connector refuses at start-up, in one line, what vLLM would have refused for
the wrapped connector, and logs which of vLLM's name-based decisions do not see it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm.config import KVTransferConfig, VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from .versions import minor_version, vllm_version

logger = logging.getLogger("kvaudit.vllm")

NIXL = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")
KVAUDIT = ("KVAuditConnector", "KVAuditHMAConnector")


@dataclass(frozen=True)
class NamedDecision:
    """One decision vLLM makes when ``has_connector`` answers True for one of ``names``
    (checked against vLLM 0.32 and 0.33: ``since`` is the first minor version with it)."""

    names: tuple[str, ...]
    what: str
    instead: str
    since: tuple[int, int] = (0, 32)
    refuse: Callable[[VllmConfig, KVCacheConfig, str], None] | None = None
    """Raises ValueError where vLLM would refuse (or needs a setting kvaudit cannot make)."""


def _routed_experts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, name: str) -> None:
    """Refuse returning routed experts over a P/D connector, as vLLM does."""
    if vllm_config.aux_output_config.enable_return_routed_experts:
        raise ValueError(
            f"kvaudit: --enable-return-routed-experts is incompatible with {name} (vLLM "
            "refuses it for that connector by name; PD auxiliary output is not supported)"
        )


def _nixl_context_parallel(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, name: str
) -> None:
    """Refuse what vLLM refuses of NIXL under decode context parallelism, and an
    interleave vLLM would have set to the block size."""
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
    if dcp <= 1:
        return
    transfer_tp = max(parallel.tensor_parallel_size, parallel.prefill_context_parallel_size)
    if dcp != transfer_tp:
        raise ValueError(
            f"kvaudit: decode_context_parallel_size={dcp} must be 1 or equal to the NIXL "
            f"transfer parallel size={transfer_tp} (vLLM's check of {name})"
        )
    if vllm_config.model_config is not None and not vllm_config.model_config.use_mla:
        raise ValueError(
            f"kvaudit: PD over {name} with decode_context_parallel_size > 1 is only "
            "supported for MLA models (vLLM's check of that connector)"
        )
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    block = min(sizes, default=parallel.cp_kv_cache_interleave_size)
    if parallel.cp_kv_cache_interleave_size != block:
        raise ValueError(
            f"kvaudit: {name} with decode context parallelism needs the cp interleave "
            f"equal to the block size: set --dcp-kv-cache-interleave-size {block} (vLLM "
            "sets it for a connector it sees by name)"
        )


def _cpu_conv_state(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, name: str) -> None:
    """Refuse a Mamba group on the CPU whose conv state is not in NIXL's layout (the
    layout is chosen before the caches exist, too early for kvaudit to set it)."""
    from vllm.platforms import current_platform

    mamba = any(isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups)
    layout = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    if mamba and current_platform.is_cpu() and layout != "DS":
        raise ValueError(
            f"kvaudit: {name} moves Mamba state on the CPU in the DS conv-state layout: "
            "set VLLM_SSM_CONV_STATE_LAYOUT=DS (vLLM sets it for a connector it sees by "
            "name)"
        )


def _hisparse(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, name: str) -> None:
    """Refuse HiSparse's connector without the attention config vLLM would turn on."""
    if vllm_config.attention_config.hisparse_config is None:
        raise ValueError(
            f"kvaudit: {name} needs HiSparse's attention config: set "
            "attention_config.hisparse_config (vLLM sets it for a connector it sees by name)"
        )


DECISIONS = (
    NamedDecision(
        (*NIXL, "MoRIIOConnector", "MooncakeConnector"),
        "--enable-return-routed-experts refused (config/vllm.py)",
        "refused by kvaudit",
        refuse=_routed_experts,
    ),
    NamedDecision(
        ("NixlConnector",),
        "decode context parallel size 1 or the transfer's TP size, MLA only, and the "
        "cp interleave set to the block size (config/vllm.py)",
        "refused by kvaudit unless already so",
        refuse=_nixl_context_parallel,
    ),
    NamedDecision(
        NIXL,
        "the CPU platform's Mamba conv-state layout VLLM_SSM_CONV_STATE_LAYOUT=DS "
        "(platforms/cpu.py)",
        "refused by kvaudit for a Mamba group unless the variable says DS",
        since=(0, 33),
        refuse=_cpu_conv_state,
    ),
    NamedDecision(
        ("SimpleCPUOffloadConnector",),
        "the CPU block count aligned over the workers with prefix caching (v1/engine/core.py)",
        "not done: set num_cpu_blocks in the wrapped connector's settings",
        since=(0, 33),
    ),
    NamedDecision(
        ("HiSparseConnector",),
        "HiSparse's attention config turned on (config/vllm.py)",
        "refused by kvaudit unless attention_config.hisparse_config is set",
        refuse=_hisparse,
    ),
)


def wrapped_connector_names(config: KVTransferConfig | None) -> tuple[str, ...]:
    """The connector names ``has_connector`` would see were the wrapped connector
    configured alone: its own and, for a ``MultiConnector``, its children's.

    Args:
        config: The wrapped connector's transfer config (None: nothing wrapped).

    Returns:
        The names, the wrapped connector's first.

    Example:
        >>> multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
        ...     kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector"}]})
        >>> wrapped_connector_names(multi)  # doctest: +SKIP
        ('MultiConnector', 'NixlConnector')
    """
    if config is None or config.kv_connector is None:
        return ()
    names = [config.kv_connector]
    if config.kv_connector == "MultiConnector":
        children = config.kv_connector_extra_config.get("connectors", [])
        names += [str(c.get("kv_connector")) for c in children if isinstance(c, dict)]
    return tuple(names)


def check_named_decisions(
    vllm_config: VllmConfig, wrapped: KVTransferConfig | None, kv_cache_config: KVCacheConfig
) -> list[NamedDecision]:
    """Refuse what vLLM refuses by name for the wrapped connector; the decisions that
    do not see it.

    Args:
        vllm_config: The engine's config, as kvaudit's connector is given it.
        wrapped: The wrapped connector's transfer config (None: nothing wrapped).
        kv_cache_config: The engine's KV cache groups.

    Returns:
        The decisions of the running vLLM that would apply to the wrapped connector.

    Raises:
        ValueError: A configuration vLLM refuses for the wrapped connector, or kvaudit
            wrapping its own connector, in one line.
    """
    names = wrapped_connector_names(wrapped)
    nested = sorted(set(names) & set(KVAUDIT))
    if nested:
        raise ValueError(
            f"kvaudit: the wrapped connector holds {nested[0]}: audit once, with "
            "kvaudit's connector outermost (docs/vllm.md)"
        )
    running = minor_version(vllm_version()) or (0, 0)
    missed = [
        d for d in DECISIONS if set(d.names) & set(names) and (running >= d.since)
    ]  # fmt: skip
    for decision in missed:
        if decision.refuse is not None:
            name = next(n for n in names if n in decision.names)
            decision.refuse(vllm_config, kv_cache_config, name)
    return missed


def log_missed(missed: Sequence[NamedDecision], names: Sequence[str]) -> None:
    """Log, once per connector, the decisions of vLLM that do not see ``names``."""
    if not missed:
        return
    logger.warning(
        "kvaudit: vLLM decides some things from the configured connector's name "
        "(KVAuditConnector), so these do not see the wrapped %s: %s (docs/vllm.md)",
        "/".join(names),
        "; ".join(f"{d.what}: {d.instead}" for d in missed),
    )
