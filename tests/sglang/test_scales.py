"""The K and V scales of an fp8 SGLang pool in kvaudit's description: SGLang 0.5.23's own
``MHATokenToKVPool`` of ``float8_e4m3fn`` and ``RadixAttention`` layers whose scales are
loaded through SGLang's own ``BaseKVCacheMethod`` (as a checkpoint's are), KV written by
the pool's own ``set_kv_buffer`` (which divides K and V by the layer's scales before the
cast). A producer and a consumer pool of the same bytes whose layer 2 K scale differs are
diffed through their dumps: exit 1, the scale named."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from click.testing import CliRunner
from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from kvaudit.cli import main
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.integrations.sglang import (
    describe_sglang_cache,
    request_blocks,
    sglang_attention_layers,
    sglang_layer_caches,
)
from kvaudit.integrations.sglang.carried import content_signature
from kvaudit.integrations.sglang.inline_state import attention_layers
from kvaudit.integrations.sglang.ranks import RankChecksummer
from kvaudit.records import WorkerInfo

PAGE, HEADS, HEAD_DIM, LAYERS, TOKENS = 16, 2, 8, 3, 40
NAME = "model.layers.{}.self_attn.attn"


def attention(scales: list[tuple[float, float]]) -> torch.nn.ModuleList:
    """A model's attention layers, each with its (k_scale, v_scale) loaded by SGLang."""
    layers = torch.nn.ModuleList()
    for layer_id, (k_scale, v_scale) in enumerate(scales):
        layer = RadixAttention(HEADS, HEAD_DIM, 1.0, HEADS, layer_id)
        method = BaseKVCacheMethod(None)  # type: ignore[arg-type]
        method.create_weights(layer)
        layer.k_scale.data.fill_(k_scale)
        layer.v_scale.data.fill_(v_scale)
        method.process_weights_after_loading(layer)
        layers.append(layer)
    return layers


def pool(dtype: torch.dtype, model: torch.nn.ModuleList, seed: int = 0) -> MHATokenToKVPool:
    """A pool holding one request of TOKENS tokens in slots from page 1, written by
    ``set_kv_buffer`` through each layer's scales (the same values for every seed: only
    the scales change the bytes)."""
    built = MHATokenToKVPool(
        size=PAGE * 6, page_size=PAGE, dtype=dtype, head_num=HEADS, head_dim=HEAD_DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False, start_layer=0,
        end_layer=LAYERS,
    )  # fmt: skip
    values = torch.Generator().manual_seed(seed)
    loc = torch.arange(PAGE, PAGE + TOKENS)
    for layer in model:
        k = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=values)
        v = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=values)
        built.set_kv_buffer(layer, loc, k, v, layer.k_scale_float, layer.v_scale_float)
    return built


def test_each_layers_loaded_scales_are_described() -> None:
    """Layer 2's K scale doubled: each layer carries its own scales; read back as the
    description's per-layer ``k_scale``/``v_scale``."""
    model = attention([(1.0, 0.5), (1.0, 0.5), (2.0, 0.5)])
    raw = describe_sglang_cache(
        pool(torch.float8_e4m3fn, model), attention=sglang_attention_layers(model)
    )
    layers = parse_description(raw, "sglang").groups[0].layers
    assert [(layer.spec.k_scale, layer.spec.v_scale) for layer in layers] == [
        (1.0, 0.5),
        (1.0, 0.5),
        (2.0, 0.5),
    ]
    assert [layer.name for layer in layers] == [NAME.format(i) for i in range(LAYERS)]


def test_one_scale_for_every_layer_goes_on_the_group() -> None:
    model = attention([(0.25, 0.25)] * LAYERS)
    raw = describe_sglang_cache(
        pool(torch.float8_e4m3fn, model), attention=sglang_attention_layers(model)
    )
    (group,) = raw["groups"]
    assert (group["spec"]["k_scale"], group["spec"]["v_scale"]) == (0.25, 0.25)
    assert group["layers"] == [NAME.format(i) for i in range(LAYERS)]


def test_a_bf16_pool_or_no_model_gives_no_scale() -> None:
    """SGLang applies the scales only where it casts to a one-byte dtype; without the
    model's layers nothing is known of them."""
    model = attention([(2.0, 2.0)] * LAYERS)
    bf16 = describe_sglang_cache(
        pool(torch.bfloat16, model), attention=sglang_attention_layers(model)
    )
    fp8 = describe_sglang_cache(pool(torch.float8_e4m3fn, model))
    for raw in (bf16, fp8):
        layers = parse_description(raw, "sglang").groups[0].layers
        assert all(layer.spec.k_scale is None and layer.spec.v_scale is None for layer in layers)


def test_the_scheduler_hands_its_models_attention_layers() -> None:
    """The inline hooks reach the model through ``scheduler.tp_worker.model_runner``; a
    scheduler without one gives none (no scales, nothing else changes)."""
    model = attention([(1.0, 1.0)] * LAYERS)
    scheduler = SimpleNamespace(
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model))
    )
    assert attention_layers(scheduler) == {i: model[i] for i in range(LAYERS)}
    assert attention_layers(SimpleNamespace()) is None


def test_a_rank_checksummer_over_some_layers_takes_per_layer_scales() -> None:
    """Layers of their own scales are mappings in the description: a span of them is
    still checksummed, and the inline signature (names, not scales) is unchanged."""
    scaled = attention([(1.0, 1.0), (2.0, 1.0), (1.0, 1.0)])
    the_pool = pool(torch.float8_e4m3fn, scaled)
    layers = sglang_attention_layers(scaled)
    summer = RankChecksummer(
        the_pool, tp_rank=0, tp_size=1, total_kv_heads=HEADS, role="producer", layers=(1, 3),
        attention=layers,
    )  # fmt: skip
    assert list(summer.tensors) == [NAME.format(1), NAME.format(2)]
    assert [layer.spec.k_scale for layer in summer.description.groups[0].layers] == [2.0, 1.0]
    plain = RankChecksummer(
        the_pool, tp_rank=0, tp_size=1, total_kv_heads=HEADS, role="producer", layers=(1, 3)
    )
    assert summer.signature == plain.signature == content_signature(plain.raw)


def test_a_doubled_scale_over_equal_bytes_fails_the_diff(tmp_path: Path) -> None:
    """The producer writes through k_scale 1.0 everywhere; the consumer's layer 2 K scale
    is 2.0 and its pool holds the producer's bytes (a transfer copies bytes, not
    scales): ``kvaudit diff`` of their dumps exits 1 naming the scale."""
    same = [(1.0, 1.0)] * LAYERS
    producer_model = attention(same)
    consumer_model = attention([(1.0, 1.0), (1.0, 1.0), (2.0, 1.0)])
    producer = pool(torch.float8_e4m3fn, producer_model)
    consumer = pool(torch.float8_e4m3fn, producer_model)  # the same bytes
    row = torch.arange(PAGE, PAGE + TOKENS)
    for role, the_pool, model in (
        ("producer", producer, producer_model),
        ("consumer", consumer, consumer_model),
    ):
        raw = describe_sglang_cache(the_pool, attention=sglang_attention_layers(model))
        path = tmp_path / role / "tp0.safetensors"
        path.parent.mkdir()
        write_dump(
            path,
            parse_description(raw, role),
            sglang_layer_caches(the_pool),
            {"req": request_blocks(row, TOKENS, PAGE)},
            worker=WorkerInfo(role=role),
        )
    result = CliRunner().invoke(
        main, ["diff", str(tmp_path / "producer"), str(tmp_path / "consumer"), "--format", "json"]
    )
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert data["scales_differ"] == [
        f"scale differs: consumer k_scale 2.0, producer 1.0, {NAME.format(2)}"
    ]
    groups = data["requests"]["req"]["groups"]
    assert groups["0"]["compared"] == 3 and groups["0"]["mismatched_positions"] == []
