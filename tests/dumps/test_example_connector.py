"""vLLM ExampleConnector folders as vLLM 0.33 saves them, read under the engine's own
description whatever its physical layout; several request folders at once; the older
``[2, tokens, heads*head_size]`` form still read.

The folders are written here as the connector writes them: each layer's request KV placed
in a standardized per-layer view ``[blocks, heads, tokens, 2*head_size]`` at the request's
block ids (junk elsewhere), then ``view[block_ids, :, offsets]`` of its slot mapping saved
as ``kv_cache`` (MLA: rows of the view flattened to ``[blocks*tokens, width]``). The
expected checksums come from the request KV alone, through the numpy reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from helpers import reference as ref
from safetensors.torch import save_file

from kvaudit.checksum import checksum_dump_set
from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.description import CacheDescription, parse_description
from kvaudit.dumps import DumpSet, write_dump
from kvaudit.formats import record_to_json
from kvaudit.records import WorkerInfo
from kvaudit.sources import DumpSource, open_source

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NUM_BLOCKS = 12


def connector_set(folders: list[Path], config: CacheDescription | None = None) -> DumpSet:
    """ExampleConnector folders opened as SOURCE arguments are (``kvaudit.sources``)."""
    source = open_source([str(folder) for folder in folders], config)
    assert isinstance(source, DumpSource)
    return source.dump_set


@dataclass(frozen=True)
class Model:
    """A tiny model's cache: attention (heads x head_size, K and V) or an MLA latent."""

    mla: bool = False
    heads: int = 2
    head_size: int = 4
    width: int = 16
    block_size: int = 4
    kernel_block_size: int = 2
    dtype: torch.dtype = torch.bfloat16

    @property
    def cell(self) -> tuple[int, int]:
        """``(heads, elements)`` of one token's cell: K's row then V's."""
        return (1, self.width) if self.mla else (self.heads, 2 * self.head_size)

    def description(self, layout: str) -> dict:
        spec: dict = {
            "block_size": self.block_size,
            "kernel_block_size": self.kernel_block_size,
            "dtype": str(self.dtype).removeprefix("torch.").replace("float8_e4m3fn", "fp8_e4m3"),
            "layout": layout,
        }
        if self.mla:
            spec.update(type="mla", head_size=self.width)
        else:
            spec.update(type="full_attention", num_kv_heads=self.heads, head_size=self.head_size)
        return {
            "kvaudit": 1,
            "num_blocks": NUM_BLOCKS,
            "groups": [{"spec": spec, "layers": list(LAYERS)}],
        }


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    count = int(np.prod(shape)) * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def request_kv(model: Model, tokens: int, seed: int) -> list[torch.Tensor]:
    """Each layer's KV of a request: ``[tokens, heads, cell elements]``."""
    return [
        random_bits((tokens, *model.cell), model.dtype, seed * 10 + i) for i in range(len(LAYERS))
    ]


def connector_save(model: Model, kv: torch.Tensor, block_ids: list[int], seed: int) -> torch.Tensor:
    """What the connector saves of one layer: the request's tokens gathered from the
    standardized view by slot mapping."""
    tokens = kv.shape[0]
    heads, elements = model.cell
    view = random_bits((NUM_BLOCKS, heads, model.block_size, elements), model.dtype, 1000 + seed)
    slots = (
        torch.tensor(block_ids)[:, None] * model.block_size + torch.arange(model.block_size)
    ).flatten()[:tokens]
    blocks, offsets = slots // model.block_size, slots % model.block_size
    for t in range(tokens):
        view[blocks[t], :, offsets[t]] = kv[t]
    if model.mla:
        return view.reshape(-1, elements)[slots].contiguous()
    return view[blocks, :, offsets].contiguous()


def write_folder(folder: Path, model: Model, kv: list[torch.Tensor], block_ids: list[int]) -> None:
    folder.mkdir(parents=True)
    for number, (name, layer_kv) in enumerate(zip(LAYERS, kv, strict=True)):
        saved = connector_save(model, layer_kv, block_ids, number)
        save_file({"kv_cache": saved}, str(folder / f"{name}.safetensors"))


def expected_totals(model: Model, kv: list[torch.Tensor], positions: str = "request") -> list[str]:
    """The reference's totals of a request, from its KV alone."""
    tokens = kv[0].shape[0]
    caches = tuple(
        ref.Layer(
            name, layer.contiguous().view(torch.uint8).numpy().reshape(tokens, layer.shape[1], -1)
        )
        for name, layer in zip(LAYERS, kv, strict=True)
    )
    group = ref.Group(model.block_size, caches)
    return [
        f"{int(v):016x}" for v in ref.total(ref.block_checksums(group, tokens, positions=positions))
    ]


def totals(record: dict) -> dict[str, list[str]]:
    return {rid: request["groups"]["0"]["totals"] for rid, request in record["requests"].items()}


CASES = [
    pytest.param(Model(), layout, id=f"attention-{layout}")
    for layout in ("NHTC", "NTHC", "KNTHD", "KNHTD", "NKTHD")
] + [
    pytest.param(Model(mla=True), "NTC", id="mla-NTC"),
    pytest.param(Model(mla=True), "NHTC", id="mla-NHTC"),
    pytest.param(Model(mla=True, dtype=torch.float8_e4m3fn), "NTC", id="mla-fp8"),
]


@pytest.mark.parametrize(("model", "layout"), CASES)
@pytest.mark.parametrize("tokens", [8, 13])
def test_a_folder_under_the_engines_own_description(
    tmp_path: Path, model: Model, layout: str, tokens: int
) -> None:
    config = parse_description(model.description(layout), "cache.yaml")
    kv = request_kv(model, tokens, seed=tokens)
    table = [
        int(i) for i in np.random.default_rng(tokens).permutation(NUM_BLOCKS)[: -(-tokens // 4)]
    ]
    folder = tmp_path / "0f3a9c"
    write_folder(folder, model, kv, table)
    record = record_to_json(checksum_dump_set(connector_set([folder], config)))
    assert totals(record) == {"0f3a9c": expected_totals(model, kv)}
    assert record["requests"]["0f3a9c"]["num_tokens"] == tokens
    by_block = record_to_json(checksum_dump_set(connector_set([folder], config), positions="block"))
    assert totals(by_block) == {"0f3a9c": expected_totals(model, kv, "block")}


def test_several_request_folders(tmp_path: Path) -> None:
    model = Model()
    config = parse_description(model.description("KNHTD"), "cache.yaml")
    storage = tmp_path / "storage"
    rng = np.random.default_rng(7)
    ids = [int(i) for i in rng.permutation(NUM_BLOCKS)]
    expected = {}
    for seed, (name, tokens, count) in enumerate([("a1b2", 12, 3), ("c3d4", 8, 2), ("e5f6", 4, 1)]):
        kv = request_kv(model, tokens, seed)
        write_folder(storage / name, model, kv, ids[:count])
        ids = ids[count:]
        expected[name] = expected_totals(model, kv)
    folders = [storage / name for name in expected]
    record = record_to_json(checksum_dump_set(connector_set(folders, config)))
    assert totals(record) == expected
    # The connector's storage path holds the folders: given alone, it reads them all.
    assert totals(record_to_json(checksum_dump_set(connector_set([storage], config)))) == expected
    # A subset: one folder.
    one = record_to_json(checksum_dump_set(connector_set([folders[1]], config)))
    assert totals(one) == {"c3d4": expected["c3d4"]}

    # On the command line, with the description in -c.
    cache = tmp_path / "cache.yaml"
    cache.write_text(yaml.safe_dump(model.description("KNHTD")))
    result = CliRunner().invoke(
        main, ["checksum", "-q", "-c", str(cache), str(storage), "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    assert totals(json.loads(result.output)) == expected


def test_folders_diff_clean_against_a_dump_of_the_same_kv(tmp_path: Path) -> None:
    """The folders of a producer and a consumer's dump of the same KV in another layout."""
    model = Model()
    storage = tmp_path / "storage"
    requests = {"9e1d": 12, "77aa": 8}
    consumer_layout = "KNTHD"
    n = NUM_BLOCKS * model.block_size
    cache = random_bits((2, n, model.heads, model.head_size), model.dtype, 99)
    caches = {name: cache.clone() for name in LAYERS}
    free = [int(i) for i in np.random.default_rng(3).permutation(NUM_BLOCKS)]
    blocks = {}
    for seed, (rid, tokens) in enumerate(requests.items()):
        kv = request_kv(model, tokens, seed)
        count = -(-tokens // model.block_size)
        write_folder(storage / rid, model, kv, list(range(count)))  # the producer's blocks
        table, free = free[:count], free[count:]  # the consumer's
        for layer, layer_kv in zip(LAYERS, kv, strict=True):
            for t in range(tokens):
                slot = table[t // 4] * 4 + t % 4
                both = layer_kv[t].reshape(model.heads, 2, model.head_size)
                caches[layer][:, slot] = both.permute(1, 0, 2)
        blocks[rid] = RequestBlocks(tokens, {0: (0, table)})
    data = model.description(consumer_layout)
    kernel_view = {
        name: tensor.reshape(2, NUM_BLOCKS * 2, 2, model.heads, model.head_size)
        for name, tensor in caches.items()
    }
    dump = tmp_path / "consumer.safetensors"
    description = parse_description(data, "consumer")
    write_dump(dump, description, kernel_view, blocks, worker=WorkerInfo(role="consumer"))
    config = tmp_path / "producer.yaml"
    config.write_text(yaml.safe_dump(model.description("NHTC")))
    result = CliRunner().invoke(
        main, ["diff", "-q", "--producer-config", str(config), str(storage), str(dump)]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("layout", ["NTHC", "KNTHD"])
@pytest.mark.parametrize("merged", [True, False], ids=["merged", "split"])
def test_the_older_form_is_still_read(tmp_path: Path, layout: str, merged: bool) -> None:
    model = Model()
    tokens = 10
    kv = request_kv(model, tokens, seed=4)
    folder = tmp_path / "req"
    folder.mkdir()
    for name, layer in zip(LAYERS, kv, strict=True):
        # [tokens, heads, K and V] as [2, tokens, heads, head_size]: K plane, then V plane.
        planes = layer.reshape(tokens, model.heads, 2, model.head_size).permute(2, 0, 1, 3)
        saved = planes.reshape(2, tokens, -1) if merged else planes
        save_file({"kv_cache": saved.contiguous()}, str(folder / f"{name}.safetensors"))
    config = parse_description(model.description(layout), "cache.yaml")
    record = record_to_json(checksum_dump_set(connector_set([folder], config)))
    assert totals(record) == {"req": expected_totals(model, kv)}


def test_two_tokens_of_two_heads_are_read_as_todays_form(tmp_path: Path) -> None:
    """``[2, 2, 2*head_size]`` fits both forms when two heads hold two tokens: it is read
    as what current vLLM saves."""
    model = Model(block_size=2, kernel_block_size=2)
    kv = request_kv(model, 2, seed=8)
    folder = tmp_path / "r"
    write_folder(folder, model, kv, [5])
    config = parse_description(model.description("KNTHD"), "cache.yaml")
    record = record_to_json(checksum_dump_set(connector_set([folder], config)))
    assert totals(record) == {"r": expected_totals(model, kv)}


def test_folders_that_cannot_be_read_together(tmp_path: Path) -> None:
    model = Model()
    config = parse_description(model.description("NHTC"), "cache.yaml")
    kv = request_kv(model, 8, seed=1)
    first, second = tmp_path / "a" / "same", tmp_path / "b" / "same"
    write_folder(first, model, kv, [0, 1])
    write_folder(second, model, kv, [2, 3])
    with pytest.raises(KvauditError) as error:
        connector_set([first, second], config)
    assert str(error.value) == f"{second}: request same is also the folder {first}"
    # One folder in today's form, one in the older form.
    older = tmp_path / "older"
    older.mkdir()
    for name, layer in zip(LAYERS, kv, strict=True):
        planes = layer.reshape(8, model.heads, 2, model.head_size).permute(2, 0, 1, 3)
        save_file(
            {"kv_cache": planes.reshape(2, 8, -1).contiguous()}, str(older / f"{name}.safetensors")
        )
    with pytest.raises(KvauditError) as error:
        connector_set([first, older], config)
    assert str(error.value).startswith(
        f"{older}: its layers are saved in other forms than those of {first}"
    )
