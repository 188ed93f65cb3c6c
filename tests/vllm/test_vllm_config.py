"""Turning kvaudit on does not change how vLLM configures itself: vLLM's ``VllmConfig``
after its own post-initialisation is the same with and without kvaudit (but for
kvaudit's module path and settings), for NIXL, Mooncake, SimpleCPUOffload and
MultiConnector deployments; every ``has_connector`` answer agrees, and so do the checks
and adjustments vLLM makes from them on this (CPU) platform."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import cpu_engine as r
import pytest
from vllm.config import KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvaudit.integrations.vllm.engine import AUDITED_MODULE

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
    """The same deployment with kvaudit on, as docs/vllm.md says to turn it on."""
    extra = {**plain.get("kv_connector_extra_config", {}), "kvaudit": SETTINGS}
    return {**plain, "kv_connector_module_path": AUDITED_MODULE, "kv_connector_extra_config": extra}


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
    """Every part of a config as text, kvaudit's two fields of the transfer config out."""
    out = {}
    for f in dataclasses.fields(built):
        value = getattr(built, f.name)
        if f.name == "kv_transfer_config":
            extra = {k: v for k, v in value.kv_connector_extra_config.items() if k != "kvaudit"}
            value = dataclasses.replace(
                value, kv_connector_module_path=None, kv_connector_extra_config=extra
            )
            value.engine_id = "same"
        if f.name == "instance_id":
            continue
        out[f.name] = repr(value)
    return out


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_vllm_configures_itself_alike_with_kvaudit(model: Path, name: str) -> None:
    plain = config(model, DEPLOYMENTS[name])
    wrapped = config(model, audited(DEPLOYMENTS[name]))
    assert described(wrapped) == described(plain)
    for connector in KVConnectorFactory._registry:
        assert wrapped.kv_transfer_config.has_connector(connector) == (
            plain.kv_transfer_config.has_connector(connector)
        ), connector


def test_nixls_context_parallel_check_still_applies(model: Path) -> None:
    """vLLM refuses NIXL with a decode context parallel size that is neither 1 nor the
    transfer's TP size, with kvaudit as without."""
    for transfer in (DEPLOYMENTS["nixl"], audited(DEPLOYMENTS["nixl"])):
        with pytest.raises(ValueError, match="decode_context_parallel_size=2 must be 1"):
            config(model, transfer, tensor_parallel_size=8, decode_context_parallel_size=2)


def test_the_cpu_platforms_nixl_layout_still_applies(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU platform selects NIXL's conv-state layout when NIXL is configured
    (its ``check_and_update_config``, called here directly: this vLLM build detects no
    platform)."""
    from vllm.platforms.cpu import CpuPlatform

    for transfer in (DEPLOYMENTS["nixl"], audited(DEPLOYMENTS["nixl"])):
        monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
        CpuPlatform.check_and_update_config(config(model, transfer))
        assert os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"


def test_the_audited_class_is_the_connectors_own_kind(model: Path) -> None:
    """vLLM's factory loads kvaudit's class named as the connector, and it keeps the
    connector's support of the hybrid memory allocator."""
    from kvaudit.integrations.vllm import audited as module
    from kvaudit.integrations.vllm.connector import KVAuditConnector
    from kvaudit.integrations.vllm.hma import KVAuditHMAConnector

    nixl = KVConnectorFactory.get_connector_class(KVTransferConfig(**audited(DEPLOYMENTS["nixl"])))
    assert nixl.__name__ == "NixlConnector" and issubclass(nixl, KVAuditHMAConnector)
    example = module.ExampleConnector
    assert issubclass(example, KVAuditConnector) and not issubclass(example, KVAuditHMAConnector)
    with pytest.raises(AttributeError, match="not in vLLM's registry"):
        module.NoSuchConnector  # noqa: B018


def test_wrapping_one_of_vllms_connectors_by_name_is_refused(model: Path) -> None:
    """``"wrapped": {"kv_connector": "NixlConnector"}`` would hide NIXL from vLLM's
    checks: refused with one line saying what to write instead."""
    transfer = KVTransferConfig(
        kv_connector="KVAuditConnector",
        kv_connector_module_path="kvaudit.integrations.vllm",
        kv_role="kv_consumer",
        kv_connector_extra_config={"kvaudit": {}, "wrapped": {"kv_connector": "NixlConnector"}},
    )
    built = config(model, dataclasses.asdict(transfer))
    kv_cache_config = r.cache_config(r.attention_spec(16, 4, 8), 2, 8, r.KVCacheLayout.LBHNC)
    with pytest.raises(ValueError) as raised:
        KVConnectorFactory.create_connector(built, KVConnectorRole.SCHEDULER, kv_cache_config)
    message = str(raised.value)
    assert "\n" not in message
    assert message == (
        "kv_connector_extra_config.wrapped: NixlConnector is one of vLLM's connectors: "
        'configure "kv_connector": "NixlConnector", "kv_connector_module_path": '
        f'"{AUDITED_MODULE}" (its settings beside "kvaudit" in kv_connector_extra_config), '
        "so that vLLM's checks of it still apply"
    )


def test_vllms_lookup_of_the_cpu_offload_connector_finds_it_inside_kvaudit(model: Path) -> None:
    """With SimpleCPUOffload and prefix caching, vLLM's engine asks its workers for the
    offload connector (``_find_simple_cpu_offload_connector``, which looks into a
    connector's ``_connectors``) to align the CPU block count: it finds the wrapped one."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        SimpleCPUOffloadConnector,
        _find_simple_cpu_offload_connector,
    )

    built = config(model, audited(DEPLOYMENTS["cpu-offload"]))
    kv_cache_config = r.cache_config(r.attention_spec(16, 4, 8), 2, 8, r.KVCacheLayout.LBHNC)
    conn = KVConnectorFactory.create_connector(built, KVConnectorRole.SCHEDULER, kv_cache_config)
    found = _find_simple_cpu_offload_connector(conn)
    assert isinstance(found, SimpleCPUOffloadConnector) and found is conn.wrapped


def test_kvaudits_plugin_is_one_vllm_loads() -> None:
    """The installed package declares its ``vllm.general_plugins`` entry point, which
    names kvaudit's classes in vLLM's registry."""
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    plugins["kvaudit_connectors"]()
    for name in ("KVAuditConnector", "KVAuditHMAConnector"):
        assert KVConnectorFactory.get_connector_class_by_name(name).__name__ == name
