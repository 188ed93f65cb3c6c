"""The cache description loader: merged values and defaults, round trip, and strict errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from kvaudit.core.dtypes import dtype_name, dtype_size, parse_dtype, safetensors_dtype_name
from kvaudit.core.errors import DescriptionError, KvauditError
from kvaudit.description import (
    CacheDescription,
    GroupDescription,
    LayerEntry,
    LayerSpec,
    StateSplit,
    description_to_dict,
    load_description,
    parse_description,
)

L0 = "model.layers.0.self_attn.attn"
L1 = "model.layers.1.self_attn.attn"
L2 = "model.layers.2.self_attn.attn"
L3 = "model.layers.3.self_attn.attn"
L4 = "model.layers.4.self_attn.attn"
L5 = "model.layers.5.self_attn.attn"
L6 = "model.layers.6.self_attn.indexer"
L7 = "model.layers.7.mixer"
L8 = "model.layers.8.mixer"
DRAFT = "drafter.layers.0.self_attn.attn"


def base() -> dict[str, Any]:
    """A valid description using every feature: overrides, shares, MLA, mamba with splits."""
    return {
        "kvaudit": 1,
        "num_blocks": 64,
        "model_kv_heads": 8,
        "draft_layers": [DRAFT],
        "groups": [
            {
                "spec": {
                    "type": "full_attention",
                    "block_size": 32,
                    "kernel_block_size": 16,
                    "num_kv_heads": 4,
                    "head_size": 64,
                    "dtype": "BF16",
                    "layout": "NHTC",
                },
                "layers": [
                    L0,
                    {
                        "name": L1,
                        "spec": {
                            "num_kv_heads": 2,
                            "head_size": 32,
                            "dtype": "fp8_e4m3",
                            "layout": "KNTHD",
                        },
                    },
                    {"name": L2, "shares": L0},
                ],
            },
            {
                "id": 5,
                "transfer": False,
                "spec": {
                    "type": "sliding_window",
                    "block_size": 16,
                    "num_kv_heads": 2,
                    "head_size": 64,
                    "head_size_v": 32,
                    "dtype": "float16",
                    "layout": "NTHC",
                    "sliding_window": 128,
                    "max_tp_shards": 2,
                },
                "layers": [
                    L3,
                    {
                        "name": L4,
                        "spec": {
                            "type": "chunked_local_attention",
                            "sliding_window": None,
                            "attention_chunk_size": 64,
                        },
                    },
                ],
            },
            {
                "id": 2,
                "host_resident": True,
                "spec": {
                    "type": "mla",
                    "block_size": 64,
                    "head_size": 576,
                    "dtype": "fp8_e4m3",
                    "layout": "NTC",
                },
                "layers": [L5, {"name": L6, "spec": {"head_size": 132, "dtype": "uint8"}}],
            },
            {
                "spec": {
                    "type": "mamba",
                    "block_size": 16,
                    "shapes": [[3, 64], [4, 8, 2]],
                    "dtypes": ["bfloat16", "F32"],
                    "checksummed_states": 1,
                    "state_splits": [
                        {"axis": 1, "segments": [[16, 1], [8, 2]]},
                        {"axis": 0, "segments": [[4, 1]]},
                    ],
                },
                "layers": [
                    L7,
                    {"name": L8, "spec": {"tp_replicated": True, "checksummed_states": 2}},
                ],
            },
        ],
    }


def write_yaml(tmp_path: Path, data: Any, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


# Expected specs, written out field by field from the description above and the defaults
# the format documents; a layer's spec is its group's with the override's fields replaced.
FULL = LayerSpec(
    type="full_attention",
    block_size=32,
    kernel_block_size=16,
    num_kv_heads=4,
    head_size=64,
    head_size_v=64,
    dtype=torch.bfloat16,
    layout="NHTC",
)
FULL_L1 = replace(
    FULL, num_kv_heads=2, head_size=32, head_size_v=32, dtype=torch.float8_e4m3fn, layout="KNTHD"
)
SLIDING = LayerSpec(
    type="sliding_window",
    block_size=16,
    kernel_block_size=16,
    num_kv_heads=2,
    head_size=64,
    head_size_v=32,
    dtype=torch.float16,
    layout="NTHC",
    sliding_window=128,
    max_tp_shards=2,
)
CHUNKED = replace(
    SLIDING, type="chunked_local_attention", sliding_window=None, attention_chunk_size=64
)
MLA = LayerSpec(
    type="mla",
    block_size=64,
    kernel_block_size=64,
    num_kv_heads=1,
    head_size=576,
    head_size_v=0,
    dtype=torch.float8_e4m3fn,
    layout="NTC",
)
INDEXER = replace(MLA, head_size=132, dtype=torch.uint8)
SPLITS = (
    StateSplit(axis=1, segments=((16, 1), (8, 2))),
    StateSplit(axis=0, segments=((4, 1),)),
)
MAMBA = LayerSpec(
    type="mamba",
    block_size=16,
    kernel_block_size=16,
    shapes=((3, 64), (4, 8, 2)),
    dtypes=(torch.bfloat16, torch.float32),
    checksummed_states=1,
    state_splits=SPLITS,
)
MAMBA_L8 = replace(MAMBA, checksummed_states=2, tp_replicated=True)


def check_full_description(description: CacheDescription) -> None:
    assert description.num_blocks == 64
    assert description.model_kv_heads == 8
    assert description.draft_layers == frozenset({DRAFT})
    assert [g.id for g in description.groups] == [0, 5, 2, 3]
    assert [(g.transfer, g.host_resident) for g in description.groups] == [
        (True, False),
        (False, False),
        (True, True),
        (True, False),
    ]
    expected = [
        (FULL, [(L0, FULL, None), (L1, FULL_L1, None), (L2, FULL, L0)]),
        (SLIDING, [(L3, SLIDING, None), (L4, CHUNKED, None)]),
        (MLA, [(L5, MLA, None), (L6, INDEXER, None)]),
        (MAMBA, [(L7, MAMBA, None), (L8, MAMBA_L8, None)]),
    ]
    for group, (group_spec, layers) in zip(description.groups, expected, strict=True):
        assert group.spec == group_spec
        assert [(e.name, e.spec, e.shares) for e in group.layers] == layers
    assert description.group(5).block_size == 16
    assert description.groups[3].layers[0].spec.covered_states == 1
    assert description.groups[3].layers[1].spec.covered_states == 2


def test_full_description_merges_overrides_and_fills_defaults() -> None:
    check_full_description(parse_description(base(), "test"))


def test_load_yaml_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, base())
    description = load_description(path)
    check_full_description(description)
    assert description.source == str(path)


def test_minimal_defaults() -> None:
    data = {
        "kvaudit": 1,
        "num_blocks": 8,
        "groups": [
            {
                "spec": {"type": "mamba", "block_size": 4, "shapes": [[2]], "dtypes": ["I64"]},
                "layers": ["m.0.mixer"],
            }
        ],
    }
    description = parse_description(data, "test")
    assert description.model_kv_heads is None
    assert description.draft_layers == frozenset()
    (group,) = description.groups
    assert (group.id, group.transfer, group.host_resident) == (0, True, False)
    spec = group.layers[0].spec
    assert spec.kernel_block_size == 4
    assert spec.checksummed_states is None
    assert spec.covered_states == 1
    assert spec.tp_replicated is False
    assert spec.state_splits is None
    assert spec.dtypes == (torch.int64,)


def test_layout_is_case_insensitive() -> None:
    data = base()
    data["groups"][0]["spec"]["layout"] = "nhtc"
    assert parse_description(data, "test").groups[0].spec.layout == "NHTC"


def test_round_trip_through_json() -> None:
    description = parse_description(base(), "test")
    dumped = description_to_dict(description)
    again = parse_description(json.loads(json.dumps(dumped)), "dump.safetensors")
    assert again == description
    check_full_description(again)


def test_to_dict_lists_only_the_keys_a_layer_changes() -> None:
    dumped = description_to_dict(parse_description(base(), "test"))
    groups = dumped["groups"]
    assert groups[0]["layers"][0] == L0
    assert groups[0]["layers"][1] == {
        "name": L1,
        "spec": {
            "num_kv_heads": 2,
            "head_size": 32,
            "head_size_v": 32,
            "dtype": "float8_e4m3fn",
            "layout": "KNTHD",
        },
    }
    assert groups[0]["layers"][2] == {"name": L2, "shares": L0}
    assert groups[1]["layers"][1]["spec"] == {
        "type": "chunked_local_attention",
        "attention_chunk_size": 64,
        "sliding_window": None,
    }
    assert groups[2]["layers"][1]["spec"] == {"head_size": 132, "dtype": "uint8"}
    assert groups[3]["layers"][1]["spec"] == {"checksummed_states": 2, "tp_replicated": True}


def test_round_trip_of_a_description_built_in_code() -> None:
    # A layer may lack an optional key its group sets: the dict unsets it with null.
    group_spec = LayerSpec(
        type="full_attention",
        block_size=16,
        kernel_block_size=8,
        num_kv_heads=2,
        head_size=8,
        head_size_v=8,
        dtype=torch.float32,
        layout="NTHC",
        max_tp_shards=4,
    )
    layer_spec = replace(group_spec, max_tp_shards=None)
    built = CacheDescription(
        num_blocks=4,
        groups=(
            GroupDescription(
                id=7,
                spec=group_spec,
                layers=(LayerEntry("a.0.attn", group_spec), LayerEntry("a.1.attn", layer_spec)),
            ),
        ),
    )
    dumped = description_to_dict(built)
    assert dumped["groups"][0]["layers"][1] == {"name": "a.1.attn", "spec": {"max_tp_shards": None}}
    assert parse_description(json.loads(json.dumps(dumped)), "x") == built


# The error table: each case breaks the valid description one way.

Path_ = tuple[str | int, ...]


def set_(keys: Path_, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        node: Any = data
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return mutate


def del_(keys: Path_) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        node: Any = data
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]

    return mutate


G0 = ("groups", 0, "spec")
G1 = ("groups", 1, "spec")
G3 = ("groups", 3, "spec")
L1_SPEC = ("groups", 0, "layers", 1, "spec")
SPLIT0 = (*G3, "state_splits", 0)


def test_spec_class_defaults_to_the_types_vllm_class() -> None:
    data = base()
    data["groups"][0]["spec"]["spec_class"] = "SinkFullAttentionSpec"
    data["groups"][0]["layers"][1]["spec"]["spec_class"] = "OtherAttentionSpec"
    description = parse_description(data, "test")
    names = {
        layer.name: layer.spec.class_name for group in description.groups for layer in group.layers
    }
    # Given on group 0 and overridden by L1; elsewhere, vLLM's class of each type
    # (docs/cache-description.md).
    assert names == {
        L0: "SinkFullAttentionSpec",
        L1: "OtherAttentionSpec",
        L2: "SinkFullAttentionSpec",
        L3: "SlidingWindowSpec",
        L4: "ChunkedLocalAttentionSpec",
        L5: "MLAAttentionSpec",
        L6: "MLAAttentionSpec",
        L7: "MambaSpec",
        L8: "MambaSpec",
    }
    assert description.groups[1].spec.spec_class is None
    dumped = description_to_dict(description)
    assert dumped["groups"][0]["spec"]["spec_class"] == "SinkFullAttentionSpec"
    assert dumped["groups"][0]["layers"][1]["spec"]["spec_class"] == "OtherAttentionSpec"
    assert "spec_class" not in dumped["groups"][1]["spec"]
    assert parse_description(dumped, "again") == description
    assert parse_description(base(), "test") != description


ERROR_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    # Top level.
    ("version missing", del_(("kvaudit",)), "kvaudit", "missing"),
    ("version 2", set_(("kvaudit",), 2), "kvaudit", "expected 1"),
    ("version bool", set_(("kvaudit",), True), "kvaudit", "expected 1"),
    ("version float", set_(("kvaudit",), 1.0), "kvaudit", "expected 1"),
    ("num_blocks missing", del_(("num_blocks",)), "num_blocks", "missing"),
    ("num_blocks zero", set_(("num_blocks",), 0), "num_blocks", "positive integer, got 0"),
    ("num_blocks bool", set_(("num_blocks",), True), "num_blocks", "positive integer, got True"),
    ("num_blocks str", set_(("num_blocks",), "64"), "num_blocks", "positive integer, got '64'"),
    ("groups missing", del_(("groups",)), "groups", "missing"),
    ("groups empty", set_(("groups",), []), "groups", "non-empty list"),
    ("groups mapping", set_(("groups",), {"a": 1}), "groups", "non-empty list"),
    ("unknown top key", set_(("num_block",), 3), "num_block", "unknown key"),
    ("model_kv_heads zero", set_(("model_kv_heads",), 0), "model_kv_heads", "positive"),
    ("draft_layers str", set_(("draft_layers",), "x"), "draft_layers", "list"),
    ("draft_layers int item", set_(("draft_layers", 0), 3), "draft_layers[0]", "string"),
    # Groups.
    ("unknown group key", set_(("groups", 1, "tranfer"), 1), "groups[1].tranfer", "unknown key"),
    ("duplicate id", set_(("groups", 2, "id"), 5), "groups[2].id", "already the id of groups[1]"),
    ("implicit id clash", set_(("groups", 1, "id"), 3), "groups[3].id", "already the id"),
    ("negative id", set_(("groups", 1, "id"), -1), "groups[1].id", "from 0 to 4294967295"),
    ("bool id", set_(("groups", 1, "id"), True), "groups[1].id", "got True"),
    ("transfer str", set_(("groups", 1, "transfer"), "no"), "groups[1].transfer", "true or false"),
    (
        "host_resident int",
        set_(("groups", 2, "host_resident"), 1),
        "groups[2].host_resident",
        "true",
    ),
    ("spec missing", del_(("groups", 1, "spec")), "groups[1].spec", "missing"),
    ("spec list", set_(("groups", 1, "spec"), [1]), "groups[1].spec", "expected a mapping"),
    ("layers missing", del_(("groups", 1, "layers")), "groups[1].layers", "missing"),
    ("layers empty", set_(("groups", 1, "layers"), []), "groups[1].layers", "non-empty list"),
    # Layers.
    ("layer int", set_(("groups", 0, "layers", 0), 42), "groups[0].layers[0]", "layer name"),
    ("layer empty name", set_(("groups", 0, "layers", 0), ""), "groups[0].layers[0]", "non-empty"),
    (
        "layer no name",
        del_(("groups", 0, "layers", 1, "name")),
        "groups[0].layers[1].name",
        "missing",
    ),
    (
        "unknown layer key",
        set_(("groups", 0, "layers", 2, "shared"), L0),
        "groups[0].layers[2].shared",
        "unknown key",
    ),
    ("override not mapping", set_(L1_SPEC, "KNTHD"), "groups[0].layers[1].spec", "mapping"),
    (
        "unknown override key",
        set_((*L1_SPEC, "heads"), 2),
        "groups[0].layers[1].spec.heads",
        "unknown key",
    ),
    (
        "override bad heads",
        set_((*L1_SPEC, "num_kv_heads"), "x"),
        "groups[0].layers[1].spec.num_kv_heads",
        "expected a positive integer, got 'x'",
    ),
    (
        "override to mamba",
        set_((*L1_SPEC, "type"), "mamba"),
        "groups[0].layers[1].spec.type",
        "cannot change",
    ),
    (
        "override from mamba",
        set_(("groups", 3, "layers", 1, "spec", "type"), "full_attention"),
        "groups[3].layers[1].spec.type",
        "cannot change",
    ),
    (
        "override block_size",
        set_((*L1_SPEC, "block_size"), 16),
        "groups[0].layers[1].spec.block_size",
        "cannot change",
    ),
    (
        "override kernel_block_size",
        set_((*L1_SPEC, "kernel_block_size"), 32),
        "groups[0].layers[1].spec.kernel_block_size",
        "cannot change",
    ),
    (
        "duplicate name in group",
        set_(("groups", 0, "layers", 0), L3),
        "groups[1].layers[0]",
        "already listed at groups[0].layers[0]",
    ),
    (
        "duplicate name mapping",
        set_(("groups", 2, "layers", 1, "name"), L0),
        "groups[2].layers[1].name",
        "already listed",
    ),
    (
        "shares missing target",
        set_(("groups", 0, "layers", 2, "shares"), "nope.0"),
        "groups[0].layers[2].shares",
        "no layer named 'nope.0'",
    ),
    (
        "shares itself",
        set_(("groups", 0, "layers", 2, "shares"), L2),
        "groups[0].layers[2].shares",
        "its own",
    ),
    (
        "shares a sharer",
        set_(("groups", 1, "layers", 0), {"name": L3, "shares": L2}),
        "groups[1].layers[0].shares",
        "itself shares",
    ),
    (
        "shares not str",
        set_(("groups", 0, "layers", 2, "shares"), 0),
        "groups[0].layers[2].shares",
        "string",
    ),
    # Spec: common keys.
    (
        "spec_class with a space",
        set_((*G0, "spec_class"), "Sink Spec"),
        "groups[0].spec.spec_class",
        "expected a class name (a Python identifier) such as FullAttentionSpec, got 'Sink Spec'",
    ),
    ("spec_class number", set_((*G3, "spec_class"), 5), "groups[3].spec.spec_class", "got 5"),
    (
        "spec_class keyword override",
        set_((*L1_SPEC, "spec_class"), "class"),
        "groups[0].layers[1].spec.spec_class",
        "a class name",
    ),
    ("unknown spec key", set_((*G0, "num_heads"), 4), "groups[0].spec.num_heads", "unknown key"),
    (
        "unknown mamba key",
        set_((*G3, "shape"), [[1]]),
        "groups[3].spec.shape",
        "kernel_block_size, shapes, dtypes",
    ),
    ("type missing", del_((*G0, "type")), "groups[0].spec.type", "missing"),
    (
        "type unknown",
        set_((*G0, "type"), "attention"),
        "groups[0].spec.type",
        "full_attention | sliding_window",
    ),
    ("block_size missing", del_((*G0, "block_size")), "groups[0].spec.block_size", "missing"),
    ("block_size zero", set_((*G0, "block_size"), 0), "groups[0].spec.block_size", "positive"),
    ("block_size bool", set_((*G1, "block_size"), True), "groups[1].spec.block_size", "got True"),
    (
        "kernel not divisor",
        set_((*G0, "kernel_block_size"), 12),
        "groups[0].spec.kernel_block_size",
        "divisor of block_size (32)",
    ),
    (
        "kernel zero",
        set_((*G0, "kernel_block_size"), 0),
        "groups[0].spec.kernel_block_size",
        "positive",
    ),
    (
        "max_tp_shards zero",
        set_((*G1, "max_tp_shards"), 0),
        "groups[1].spec.max_tp_shards",
        "positive",
    ),
    # Spec: attention keys.
    ("num_kv_heads missing", del_((*G0, "num_kv_heads")), "groups[0].spec.num_kv_heads", "missing"),
    (
        "num_kv_heads float",
        set_((*G0, "num_kv_heads"), 4.0),
        "groups[0].spec.num_kv_heads",
        "got 4.0",
    ),
    ("head_size missing", del_((*G0, "head_size")), "groups[0].spec.head_size", "missing"),
    ("head_size negative", set_((*G0, "head_size"), -1), "groups[0].spec.head_size", "positive"),
    (
        "head_size_v negative",
        set_((*G1, "head_size_v"), -1),
        "groups[1].spec.head_size_v",
        "non-negative",
    ),
    (
        "head_size_v with K",
        set_((*L1_SPEC, "head_size_v"), 16),
        "groups[0].layers[1].spec.head_size_v",
        "expected 32 (head_size)",
    ),
    ("dtype missing", del_((*G0, "dtype")), "groups[0].spec.dtype", "missing"),
    (
        "dtype unknown",
        set_((*G0, "dtype"), "bfloat17"),
        "groups[0].spec.dtype",
        "unknown dtype 'bfloat17'",
    ),
    ("dtype int", set_((*G0, "dtype"), 16), "groups[0].spec.dtype", "dtype name"),
    ("layout missing", del_((*G0, "layout")), "groups[0].spec.layout", "missing"),
    ("layout letter", set_((*G0, "layout"), "NTHX"), "groups[0].spec.layout", "unknown axis 'X'"),
    ("layout repeat", set_((*G0, "layout"), "NTHCT"), "groups[0].spec.layout", "more than once"),
    ("layout no T", set_((*G0, "layout"), "NHC"), "groups[0].spec.layout", "no T"),
    ("layout C and D", set_((*G0, "layout"), "NTHDC"), "groups[0].spec.layout", "both C"),
    ("layout no C or D", set_((*G0, "layout"), "NTH"), "groups[0].spec.layout", "needs C"),
    ("layout K without D", set_((*G0, "layout"), "KNTHC"), "groups[0].spec.layout", "no D"),
    ("layout not str", set_((*G0, "layout"), 5), "groups[0].spec.layout", "axis letters"),
    (
        "layout no H",
        set_((*L1_SPEC, "layout"), "NTC"),
        "groups[0].layers[1].spec.layout",
        "num_kv_heads is 2",
    ),
    ("sliding missing", del_((*G1, "sliding_window")), "groups[1].spec.sliding_window", "missing"),
    ("sliding zero", set_((*G1, "sliding_window"), 0), "groups[1].spec.sliding_window", "positive"),
    (
        "sliding on full",
        set_((*G0, "sliding_window"), 64),
        "groups[0].spec.sliding_window",
        "not allowed for type full_attention",
    ),
    (
        "sliding kept by chunked",
        del_(("groups", 1, "layers", 1, "spec", "sliding_window")),
        "groups[1].layers[1].spec.sliding_window",
        "not allowed for type chunked_local_attention",
    ),
    (
        "chunk on full",
        set_((*G0, "attention_chunk_size"), 64),
        "groups[0].spec.attention_chunk_size",
        "chunked_local_attention only",
    ),
    (
        "chunk zero",
        set_(("groups", 1, "layers", 1, "spec", "attention_chunk_size"), 0),
        "groups[1].layers[1].spec.attention_chunk_size",
        "positive",
    ),
    ("mamba key on attention", set_((*G0, "shapes"), [[1]]), "groups[0].spec.shapes", "mamba only"),
    (
        "mamba key in override",
        set_((*L1_SPEC, "tp_replicated"), True),
        "groups[0].layers[1].spec.tp_replicated",
        "mamba only",
    ),
    # Spec: mamba keys.
    (
        "attention key on mamba",
        set_((*G3, "layout"), "NTC"),
        "groups[3].spec.layout",
        "not allowed for type mamba",
    ),
    (
        "attention key in mamba override",
        set_(("groups", 3, "layers", 1, "spec", "head_size"), 4),
        "groups[3].layers[1].spec.head_size",
        "not allowed for type mamba",
    ),
    ("shapes missing", del_((*G3, "shapes")), "groups[3].spec.shapes", "missing"),
    ("shapes empty", set_((*G3, "shapes"), []), "groups[3].spec.shapes", "non-empty list"),
    ("shape empty", set_((*G3, "shapes", 1), []), "groups[3].spec.shapes[1]", "non-empty list"),
    ("shape dim zero", set_((*G3, "shapes", 0, 1), 0), "groups[3].spec.shapes[0][1]", "positive"),
    ("dtypes missing", del_((*G3, "dtypes")), "groups[3].spec.dtypes", "missing"),
    (
        "dtypes short",
        set_((*G3, "dtypes"), ["bf16"]),
        "groups[3].spec.dtypes",
        "expected 2 dtype names",
    ),
    (
        "dtypes bad item",
        set_((*G3, "dtypes", 1), "f33"),
        "groups[3].spec.dtypes[1]",
        "unknown dtype",
    ),
    (
        "checksummed too many",
        set_((*G3, "checksummed_states"), 3),
        "groups[3].spec.checksummed_states",
        "from 0 to 2",
    ),
    (
        "checksummed negative",
        set_((*G3, "checksummed_states"), -1),
        "groups[3].spec.checksummed_states",
        "from 0 to 2",
    ),
    (
        "tp_replicated str",
        set_((*G3, "tp_replicated"), "yes"),
        "groups[3].spec.tp_replicated",
        "true or false",
    ),
    (
        "splits short",
        set_((*G3, "state_splits"), [{"axis": 0, "segments": [[1, 1]]}]),
        "groups[3].spec.state_splits",
        "one per state",
    ),
    (
        "split unknown key",
        set_((*SPLIT0, "rows"), 1),
        "groups[3].spec.state_splits[0].rows",
        "unknown key",
    ),
    (
        "split axis missing",
        del_((*SPLIT0, "axis")),
        "groups[3].spec.state_splits[0].axis",
        "missing",
    ),
    (
        "split axis range",
        set_((*SPLIT0, "axis"), 2),
        "groups[3].spec.state_splits[0].axis",
        "from 0 to 1",
    ),
    (
        "split axis range 3d",
        set_((*G3, "state_splits", 1, "axis"), 3),
        "groups[3].spec.state_splits[1].axis",
        "from 0 to 2",
    ),
    (
        "split segments missing",
        del_((*SPLIT0, "segments")),
        "groups[3].spec.state_splits[0].segments",
        "missing",
    ),
    (
        "split segments empty",
        set_((*SPLIT0, "segments"), []),
        "groups[3].spec.state_splits[0].segments",
        "non-empty",
    ),
    (
        "split segment short",
        set_((*SPLIT0, "segments", 1), [8]),
        "groups[3].spec.state_splits[0].segments[1]",
        "[local_rows, replicas]",
    ),
    (
        "split replicas zero",
        set_((*SPLIT0, "segments", 0, 1), 0),
        "groups[3].spec.state_splits[0].segments[0][1]",
        "positive",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "key_path", "expected"),
    [pytest.param(m, p, e, id=name) for name, m, p, e in ERROR_CASES],
)
def test_error_names_file_and_key_path(
    tmp_path: Path,
    mutate: Callable[[dict[str, Any]], None],
    key_path: str,
    expected: str,
) -> None:
    data = base()
    mutate(data)
    path = write_yaml(tmp_path, data)
    with pytest.raises(DescriptionError) as info:
        load_description(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: {key_path}: ")
    assert expected in message


def test_parse_error_names_source() -> None:
    data = base()
    data["num_blocks"] = -3
    with pytest.raises(
        KvauditError, match=r"^dump-0\.safetensors: num_blocks: expected a positive"
    ):
        parse_description(data, "dump-0.safetensors")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("kvaudit: 1\nnum_blocks: [1, 2\n", "line 3: invalid YAML", id="unclosed"),
        pytest.param("kvaudit: 1\n  num_blocks: 4\n", "line 2: invalid YAML", id="indent"),
        pytest.param(
            "kvaudit: 1\nkvaudit: 1\n",
            "line 2: invalid YAML: found duplicate key 'kvaudit'",
            id="duplicate",
        ),
        pytest.param("- kvaudit: 1\n", "expected a mapping", id="list root"),
        pytest.param("just text\n", "expected a mapping", id="scalar root"),
        pytest.param("", "empty", id="empty"),
    ],
)
def test_yaml_file_errors(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(DescriptionError) as info:
        load_description(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert expected in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(DescriptionError) as info:
        load_description(str(path))
    assert str(info.value) == f"{path}: no such file"


# Dtype names.

DTYPE_NAMES = [
    # (accepted names, dtype, torch name, safetensors name, bytes)
    (["BF16", "bf16", "bfloat16", "torch.bfloat16"], torch.bfloat16, "bfloat16", "BF16", 2),
    (["F16", "fp16", "float16", "half", "HALF"], torch.float16, "float16", "F16", 2),
    (["F32", "fp32", "float32", "float"], torch.float32, "float32", "F32", 4),
    (["F64", "float64", "double"], torch.float64, "float64", "F64", 8),
    (
        ["F8_E4M3", "fp8_e4m3", "float8_e4m3fn", "FP8_E4M3"],
        torch.float8_e4m3fn,
        "float8_e4m3fn",
        "F8_E4M3",
        1,
    ),
    (["F8_E5M2", "fp8_e5m2", "float8_e5m2"], torch.float8_e5m2, "float8_e5m2", "F8_E5M2", 1),
    (["U8", "uint8"], torch.uint8, "uint8", "U8", 1),
    (["I8", "int8"], torch.int8, "int8", "I8", 1),
    (["I16", "int16", "short"], torch.int16, "int16", "I16", 2),
    (["U16", "uint16"], torch.uint16, "uint16", "U16", 2),
    (["I32", "int32", "int"], torch.int32, "int32", "I32", 4),
    (["U32", "uint32"], torch.uint32, "uint32", "U32", 4),
    (["I64", "int64", "long"], torch.int64, "int64", "I64", 8),
    (["U64", "uint64"], torch.uint64, "uint64", "U64", 8),
    (["BOOL", "bool"], torch.bool, "bool", "BOOL", 1),
]


@pytest.mark.parametrize(
    ("names", "dtype", "torch_name", "st_name", "size"),
    [pytest.param(*row, id=row[2]) for row in DTYPE_NAMES],
)
def test_dtype_names(
    names: list[str], dtype: torch.dtype, torch_name: str, st_name: str, size: int
) -> None:
    for name in names:
        assert parse_dtype(name) == dtype
    assert dtype_name(dtype) == torch_name
    assert safetensors_dtype_name(dtype) == st_name
    assert dtype_size(dtype) == size
    assert parse_dtype(st_name.lower()) == dtype


@pytest.mark.parametrize("name", ["bfloat17", "", "f8", "torch."])
def test_unknown_dtype(name: str) -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype(name)


def test_dtype_without_safetensors_name() -> None:
    with pytest.raises(ValueError, match="complex64"):
        safetensors_dtype_name(torch.complex64)


@pytest.mark.parametrize("value", [10**400, -(10**400), True, "0.5", float("nan")])
def test_a_scale_that_is_no_positive_finite_number_is_refused(value: Any) -> None:
    data = base()
    data["groups"][0]["spec"]["scale"] = value
    with pytest.raises(DescriptionError, match=r"groups\[0\]\.spec\.scale: expected a positive"):
        parse_description(data, "test")


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "mla", "head_size": 576, "dtype": "fp8_e4m3", "layout": "NTC"},
        {"type": "full_attention", "num_kv_heads": 1, "head_size": 8, "head_size_v": 0},
    ],
    ids=["mla", "no-v-rows"],
)
def test_scale_without_v_rows_scales_k_only_and_reads_back(spec: dict) -> None:
    # v_scale defaults to scale only where there are V rows: a dump of this description
    # must read back (v_scale is refused without V rows).
    data = {
        "kvaudit": 1,
        "num_blocks": 4,
        "groups": [
            {
                "spec": {
                    "block_size": 16,
                    "dtype": "fp8_e4m3",
                    "layout": "NTHC",
                    **spec,
                    "scale": 0.5,
                },
                "layers": ["model.layers.0.attn"],
            },
        ],
    }
    description = parse_description(data, "test")
    layer = description.groups[0].spec
    assert (layer.k_scale, layer.v_scale) == (0.5, None)
    again = parse_description(json.loads(json.dumps(description_to_dict(description))), "dump")
    assert again == description


@pytest.mark.parametrize(
    ("key", "text", "expected"),
    [
        ("scale", "1e-3", 0.001),
        ("scale", "2.5E+1", 25.0),
        ("scale", ".5", 0.5),
        ("num_blocks", "010", 10),
        ("num_blocks", "0x40", 64),
        ("num_blocks", "1:04", "expected"),  # YAML 1.1's sexagesimal 64
        ("num_blocks", "6_4", "expected"),  # YAML 1.1's 64
    ],
)
def test_numbers_read_as_yaml_1_2_reads_them(
    tmp_path: Path, key: str, text: str, expected: float | str
) -> None:
    data = base()
    if key == "scale":
        data["groups"][0]["spec"]["scale"] = "PLACE"
    else:
        data["num_blocks"] = "PLACE"
    path = tmp_path / "cache.yaml"
    path.write_text(yaml.safe_dump(data).replace("PLACE", text), encoding="utf-8")
    if isinstance(expected, str):
        with pytest.raises(DescriptionError, match=f"{key}: {expected}"):
            load_description(path)
        return
    description = load_description(path)
    got = description.groups[0].spec.k_scale if key == "scale" else description.num_blocks
    assert got == expected


def test_a_null_group_wide_key_in_a_layer_keeps_the_groups() -> None:
    # docs: "A null value counts as not given".
    data = base()
    data["groups"][0]["layers"][0] = {"name": L0, "spec": {"kernel_block_size": None}}
    description = parse_description(data, "test")
    group = description.groups[0]
    assert group.layers[0].spec.kernel_block_size == group.spec.kernel_block_size


def test_counts_in_messages_agree_with_their_nouns() -> None:
    data = base()
    data["groups"][3]["spec"]["shapes"] = [[4]]
    data["groups"][3]["spec"]["dtypes"] = "float16"
    data["groups"][3]["spec"].pop("state_splits", None)
    with pytest.raises(DescriptionError, match=r"expected 1 dtype name, one per state, got"):
        parse_description(data, "test")


def test_mla_holds_one_head() -> None:
    spec = {
        "type": "mla",
        "block_size": 16,
        "num_kv_heads": 8,
        "head_size": 576,
        "dtype": "bfloat16",
        "layout": "NTHC",
    }
    data = {"kvaudit": 1, "num_blocks": 4, "groups": [{"spec": spec, "layers": ["m.0.a"]}]}
    with pytest.raises(DescriptionError, match=r"num_kv_heads: expected 1 for type mla, got 8"):
        parse_description(data, "test")
