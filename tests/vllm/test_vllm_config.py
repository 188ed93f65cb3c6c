"""kvaudit's connector outermost, configured one way (``"kv_connector":
"KVAuditConnector"``, the deployment's connector under ``"wrapped"``): vLLM's
``VllmConfig`` after its own post-initialisation is the same as without kvaudit but for
the transfer config, for NIXL, Mooncake, SimpleCPUOffload and MultiConnector
deployments; vLLM's name-based decisions (``has_connector``) do not see the wrapped
connector, and kvaudit's connector refuses at start-up what they would refuse."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import cpu_engine as r
import pytest
from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig

from kvaudit.integrations.vllm import KVAuditConnector
from kvaudit.integrations.vllm.engine import wrapped_transfer_config

SETTINGS = {"output": "/var/tmp/kvaudit", "policy": "fail"}
DEPLOYMENTS: dict[str, dict[str, Any]] = {
    "nixl": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
    "mooncake": {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "rdma"},
    },
    "cpu-offload": {
        "kv_connector": "SimpleCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
    },
    "multi": {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
                {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_consumer"},
            ]
        },
    },
}


def audited(plain: dict[str, Any]) -> dict[str, Any]:
    """The same deployment with kvaudit on, as docs/vllm.md says to turn it on: the
    deployment's connector under ``"wrapped"``, kvaudit's HMA class where it supports
    vLLM's hybrid memory allocator."""
    wrapped = {k: v for k, v in plain.items() if k != "kv_role"}
    hma = KVConnectorFactory.supports_hma_config(KVTransferConfig(**plain))
    return {
        "kv_connector": "KVAuditHMAConnector" if hma else "KVAuditConnector",
        "kv_connector_module_path": r.MODULE,
        "kv_role": plain["kv_role"],
        "kv_connector_extra_config": {"kvaudit": SETTINGS, "wrapped": wrapped},
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-model")


def config(model: Path, transfer: dict[str, Any], **parallel: int) -> VllmConfig:
    built = r.engine_config(r.model_config(model / "model"), KVTransferConfig(**transfer))
    if parallel:
        built = VllmConfig(
            model_config=built.model_config,
            cache_config=built.cache_config,
            scheduler_config=built.scheduler_config,
            device_config=built.device_config,
            parallel_config=ParallelConfig(**parallel),
            kv_transfer_config=built.kv_transfer_config,
        )
    return built


def described(built: VllmConfig) -> dict[str, str]:
    """Every part of a config as text, the transfer config as the wrapped connector's."""
    out = {}
    for f in dataclasses.fields(built):
        value = getattr(built, f.name)
        if f.name == "kv_transfer_config":
            value = wrapped_transfer_config(value) or value
            value.engine_id = "same"
        if f.name == "instance_id":
            continue
        out[f.name] = repr(value)
    return out


def kv_cache(spec: Any = None) -> KVCacheConfig:
    return r.cache_config(spec or r.attention_spec(16, 4, 8), 2, 8, r.KVCacheLayout.LBHNC)


def scheduler_connector(built: VllmConfig, spec: Any = None) -> Any:
    return KVConnectorFactory.create_connector(built, KVConnectorRole.SCHEDULER, kv_cache(spec))


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_vllm_configures_itself_alike_with_kvaudit(model: Path, name: str) -> None:
    """The same config but for the transfer config; the names vLLM's ``has_connector``
    answers True for without kvaudit are exactly kvaudit's ``wrapped_connector_names``
    (what the upstream hook of docs/vllm.md would hand it)."""
    plain = config(model, DEPLOYMENTS[name])
    wrapped = config(model, audited(DEPLOYMENTS[name]))
    assert described(wrapped) == described(plain)
    behind = KVAuditConnector.wrapped_connector_names(wrapped.kv_transfer_config)
    for connector in KVConnectorFactory._registry:
        assert plain.kv_transfer_config.has_connector(connector) == (connector in behind)
        assert not wrapped.kv_transfer_config.has_connector(connector) or connector in (
            "KVAuditConnector", "KVAuditHMAConnector"
        )  # fmt: skip


def test_nixls_context_parallel_check_is_kvaudits_at_start_up(model: Path) -> None:
    """vLLM refuses NIXL with a decode context parallel size that is neither 1 nor the
    transfer's TP size when it sees NIXL by name; behind kvaudit it does not, and
    kvaudit's connector refuses it in one line when it starts."""
    parallel = {"tensor_parallel_size": 8, "decode_context_parallel_size": 2}
    with pytest.raises(ValueError, match="decode_context_parallel_size=2 must be 1"):
        config(model, DEPLOYMENTS["nixl"], **parallel)
    built = config(model, audited(DEPLOYMENTS["nixl"]), **parallel)
    with pytest.raises(ValueError) as raised:
        scheduler_connector(built)
    assert str(raised.value) == (
        "kvaudit: decode_context_parallel_size=2 must be 1 or equal to the NIXL transfer "
        "parallel size=8 (vLLM's check of NixlConnector)"
    )


def test_routed_experts_over_nixl_are_refused_by_kvaudit(model: Path) -> None:
    """vLLM refuses returning routed experts over NIXL by name (a MoE-only setting: set
    here on a post-initialised config); kvaudit's connector refuses it for the NIXL it
    wraps, directly or inside a wrapped MultiConnector."""
    for name in ("nixl", "multi"):
        built = config(model, audited(DEPLOYMENTS[name]))
        built.aux_output_config.enable_return_routed_experts = True
        with pytest.raises(ValueError) as raised:
            scheduler_connector(built)
        assert str(raised.value).startswith(
            "kvaudit: --enable-return-routed-experts is incompatible with NixlConnector"
        )


def test_the_cpu_platforms_nixl_layout_is_kvaudits_check(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU platform selects NIXL's conv-state layout when it sees NIXL by name
    (its ``check_and_update_config``, called here directly: this vLLM build detects no
    platform); behind kvaudit it does not, and kvaudit's connector refuses a Mamba group
    on the CPU until the variable says DS."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.kv_cache_interface import MambaSpec

    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    CpuPlatform.check_and_update_config(config(model, DEPLOYMENTS["nixl"]))
    assert os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")
    built = config(model, audited(DEPLOYMENTS["nixl"]))
    CpuPlatform.check_and_update_config(built)
    assert os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") != "DS"
    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())
    mamba = MambaSpec(block_size=16, shapes=((2, 4),), dtypes=(r.torch.float32,))
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    with pytest.raises(ValueError, match="set VLLM_SSM_CONV_STATE_LAYOUT=DS"):
        scheduler_connector(built, mamba)


def test_any_connector_may_be_wrapped_and_nested_kvaudit_is_refused(model: Path) -> None:
    """NIXL and MultiConnector, vLLM's own connectors, are wrapped by name; kvaudit's
    connector inside a wrapped MultiConnector is refused in one line."""
    conn = scheduler_connector(config(model, audited(DEPLOYMENTS["nixl"])))
    assert type(conn).__name__ == "KVAuditHMAConnector"
    assert type(conn.wrapped) is KVConnectorFactory.get_connector_class_by_name("NixlConnector")
    inner = {"kv_connector": "KVAuditConnector", "kv_connector_module_path": r.MODULE,
             "kv_role": "kv_consumer"}  # fmt: skip
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
             "kv_connector_extra_config": {"connectors": [inner]}}  # fmt: skip
    with pytest.raises(ValueError) as raised:
        scheduler_connector(config(model, audited(multi)))
    assert str(raised.value) == (
        "kvaudit: the wrapped connector holds KVAuditConnector: audit once, with kvaudit's "
        "connector outermost (docs/vllm.md)"
    )


def test_the_decisions_that_miss_the_wrapped_connector_are_logged(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SimpleCPUOffload's CPU block count is aligned by vLLM's engine only for a
    connector it sees by name (``_find_simple_cpu_offload_connector`` finds none inside
    kvaudit's): kvaudit's start-up log says so, with the other decisions that miss."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        _find_simple_cpu_offload_connector,
    )

    with caplog.at_level(logging.WARNING, logger="kvaudit.vllm"):
        conn = scheduler_connector(config(model, audited(DEPLOYMENTS["multi"])))
    assert _find_simple_cpu_offload_connector(conn) is None
    [line] = [m.getMessage() for m in caplog.records if "decides some things" in m.getMessage()]
    assert line.startswith(
        "kvaudit: vLLM decides some things from the configured connector's name "
        "(KVAuditConnector), so these do not see the wrapped "
        "MultiConnector/NixlConnector/SimpleCPUOffloadConnector: "
    )
    assert "the CPU block count aligned over the workers" in line
    assert "not done: set num_cpu_blocks in the wrapped connector's settings" in line


def test_hisparse_without_its_attention_config_is_refused(model: Path) -> None:
    """vLLM turns HiSparse's attention config on for a connector named HiSparseConnector;
    behind kvaudit it does not, and kvaudit refuses the wrapped HiSparse without it."""
    from kvaudit.integrations.vllm.name_checks import check_named_decisions

    built = config(model, audited(DEPLOYMENTS["nixl"]))
    assert built.attention_config.hisparse_config is None
    hisparse = KVTransferConfig(kv_connector="HiSparseConnector", kv_role="kv_both")
    with pytest.raises(ValueError, match=r"set attention_config\.hisparse_config"):
        check_named_decisions(built, hisparse, kv_cache())
    nixl = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    missed = check_named_decisions(built, nixl, kv_cache())
    assert [d.names[0] for d in missed][:2] == ["NixlConnector", "NixlConnector"]


def test_the_class_that_keeps_vllms_hybrid_allocator_on_is_named(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM turns its hybrid memory allocator off for ``KVAuditConnector`` (it decides
    from the class alone); wrapping NIXL, which supports it, kvaudit's log names the
    class that keeps it on."""
    transfer = {**audited(DEPLOYMENTS["nixl"]), "kv_connector": "KVAuditConnector"}
    built = config(model, transfer)
    assert built.scheduler_config.disable_hybrid_kv_cache_manager
    with caplog.at_level(logging.INFO, logger="kvaudit.vllm"):
        scheduler_connector(built)
    assert [m.getMessage() for m in caplog.records if "hybrid memory" in m.getMessage()] == [
        "kvaudit: vLLM's hybrid memory allocator is off; NixlConnector supports it: "
        '"kv_connector": "KVAuditHMAConnector" keeps it on (docs/vllm.md)'
    ]


def test_kvaudits_class_loads_by_module_path_and_by_name(model: Path) -> None:
    """``kvaudit.integrations.vllm`` holds the classes; kvaudit's plugin also names
    them in vLLM's registry, so ``"kv_connector": "KVAuditConnector"`` alone loads it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from kvaudit.integrations.vllm import KVAuditHMAConnector, plugin

    plugin.register()
    for name, cls in (("KVAuditConnector", KVAuditConnector),
                      ("KVAuditHMAConnector", KVAuditHMAConnector)):  # fmt: skip
        for module in (r.MODULE, None):
            ktc = KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                                   kv_role="kv_both")  # fmt: skip
            assert KVConnectorFactory.get_connector_class(ktc) is cls
    assert issubclass(KVAuditHMAConnector, SupportsHMA)
    assert not issubclass(KVAuditConnector, SupportsHMA)


def test_kvaudits_plugin_is_one_vllm_loads() -> None:
    """The installed package declares its ``vllm.general_plugins`` entry point, which
    names kvaudit's classes in vLLM's registry."""
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    plugins["kvaudit_connectors"]()
    for name in ("KVAuditConnector", "KVAuditHMAConnector"):
        assert KVConnectorFactory.get_connector_class_by_name(name).__name__ == name
