"""The K and V scales of an fp8 KV cache recorded by kvaudit's connector, from vLLM
0.33.0's own ``Attention`` layers: built with ``cache_dtype="fp8_e4m3"`` (the Triton
backend's class: no kernel runs), their scales loaded through vLLM's own
``BaseKVCacheMethod`` as a checkpoint's would be, the KV cache spec from the layers
themselves, the caches allocated by vLLM. The worker's ``cache.yaml``, its record and a
dump written through the public ``write_dump`` carry each layer's scales; an unquantized
cache records none."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import torch
from cpu_engine import LAYER, cache_config, transfer_config
from safetensors import safe_open
from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

import kvaudit.integrations.vllm.worker_hooks as worker_hooks
from kvaudit import RequestBlocks
from kvaudit.description import load_description
from kvaudit.dumps import write_dump
from kvaudit.output_folders import read_output_folder
from kvaudit.records import WorkerInfo

HEADS, HEAD_SIZE, BLOCKS = 4, 16, 8
# (k_scale, v_scale) per layer, as a checkpoint holds them: layer 2's K scale doubled.
SCALES = [(1.0, 0.5), (1.0, 0.5), (2.0, 0.5)]


def engine(tmp_path: Path, cache_dtype: str) -> tuple[VllmConfig, dict[str, torch.Tensor], object]:
    """A one-worker engine of three real Attention layers whose KV cache is of
    ``cache_dtype``, its scales loaded where it is fp8; its caches and worker connector."""
    config = VllmConfig(
        kv_transfer_config=transfer_config({"output": str(tmp_path)}, None),
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
    )
    layers = []
    with set_current_vllm_config(config):
        for i, (k_scale, v_scale) in enumerate(SCALES):
            layer = Attention(
                num_heads=HEADS,
                head_size=HEAD_SIZE,
                scale=HEAD_SIZE**-0.5,
                num_kv_heads=HEADS,
                cache_config=config.cache_config,
                prefix=LAYER.format(i),
                attn_backend=TritonAttentionBackend,
            )
            if cache_dtype != "auto":
                method = BaseKVCacheMethod(None)  # type: ignore[arg-type]
                method.create_weights(layer)
                loaded = {"q_scale": 1.0, "k_scale": k_scale, "v_scale": v_scale}
                for name, value in {**loaded, "prob_scale": 1.0}.items():
                    parameter = getattr(layer, name)
                    parameter.weight_loader(parameter, torch.tensor(value))
                method.process_weights_after_loading(layer)
            layers.append(layer)
        spec = layers[0].get_kv_cache_spec(config)
    kv_cache_config = cache_config(spec, len(layers), BLOCKS, KVCacheLayout.LBHNC)
    with mock.patch.object(worker_hooks, "worker_ranks", return_value=(0, 1, 0, 1)):
        connector = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        connector.register_kv_caches(caches)
    return config, caches, connector


def test_the_connector_records_each_fp8_layers_scales(tmp_path: Path) -> None:
    """The worker's cache.yaml gives each layer the scales vLLM loaded into it (its
    ``_k_scale_float``/``_v_scale_float``); the output folder's record keeps them; a dump
    through ``write_dump`` of the worker's description carries them in its metadata."""
    config, caches, connector = engine(tmp_path, "fp8_e4m3")
    context = config.compilation_config.static_forward_context
    assert [(context[LAYER.format(i)]._k_scale_float) for i in range(3)] == [1.0, 1.0, 2.0]
    described = load_description(tmp_path / "workers" / "pp0-tp0" / "cache.yaml")
    [group] = described.groups
    got = [(layer.spec.k_scale, layer.spec.v_scale) for layer in group.layers]
    assert got == SCALES
    assert group.spec.dtype.itemsize == 1  # vLLM's fp8 cache: one byte per element

    path = tmp_path / "dump.safetensors"
    blocks = {"req": RequestBlocks(16, {0: (0, [1])})}
    write_dump(path, described, caches, blocks, worker=WorkerInfo(role="producer"))
    with safe_open(str(path), "pt") as dump:
        cache = json.loads(dump.metadata()["kvaudit.cache"])
    entries = cache["groups"][0]["layers"]
    assert {"name": LAYER.format(2), "spec": {"k_scale": 2.0}} in entries

    # One checksum line makes the worker's record, whose layer facts come with it.
    (tmp_path / "workers" / "pp0-tp0" / "checksums.jsonl").write_text(
        json.dumps(
            {
                "format": "kvaudit.engine-checksums/1",
                "request": "req",
                "role": "producer",
                "num_tokens": 0,
                "positions": "request",
                "worker": {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "engine": ""},
                "fingerprints": {},
                "not_covered": {},
                "groups": {},
            }
        )
        + "\n"
    )
    [worker] = read_output_folder(tmp_path).workers
    facts = [(worker.layers[LAYER.format(i)].k_scale, worker.layers[LAYER.format(i)].v_scale)
             for i in range(3)]  # fmt: skip
    assert facts == SCALES
    del connector


def test_an_unquantized_cache_records_no_scale(tmp_path: Path) -> None:
    """vLLM keeps scales of 1.0 on every Attention layer; a bf16/fp16 cache never applies
    them, and its description gives none."""
    engine(tmp_path, "auto")
    described = load_description(tmp_path / "workers" / "pp0-tp0" / "cache.yaml")
    assert all(
        (layer.spec.k_scale, layer.spec.v_scale) == (None, None)
        for layer in described.groups[0].layers
    )
