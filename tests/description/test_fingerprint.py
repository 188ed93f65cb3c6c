"""Group fingerprints and stored-checksum tags against hashlib/repr references of the spec."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

import numpy as np
import torch

from kvaudit.description import GroupDescription, LayerEntry, LayerSpec, StateSplit
from kvaudit.description.fingerprint import (
    block_checksum_tag,
    block_checksum_tags,
    group_fingerprint,
    layer_fingerprint,
    layer_identity,
    stored_checksum,
)

MOD = 2**64

ATTN = "model.layers.0.self_attn.attn"
MLA = "model.layers.1.self_attn.attn"
SHARED = "model.layers.4.self_attn.attn"
UNSPLIT = "model.layers.2.mixer"
SPLIT = "model.layers.3.mixer"
DRAFT = "drafter.layers.0.self_attn.attn"


def ref_hash(identity: tuple) -> int:
    """uint64_le(sha256(utf8(repr(identity)))[:8]), written from the spec."""
    digest = hashlib.sha256(repr(identity).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def ref_tag(block_hash: bytes, fingerprint: int) -> int:
    message = block_hash + fingerprint.to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(message).digest()[:8], "little")


# Hand-written identities of the layers below, as the spec spells them (the seed's
# tuples: vLLM spec class names, str() of torch dtypes).
ATTN_ID = (ATTN, "FullAttentionSpec", "torch.bfloat16")
MLA_ID = (MLA, "MLAAttentionSpec", "torch.float8_e4m3fn")
SHARED_ID = (SHARED, "FullAttentionSpec", "torch.bfloat16")
UNSPLIT_ID = (UNSPLIT, "MambaSpec", ((3, 64),), ["torch.bfloat16"])
SPLIT_ID = (
    SPLIT,
    "MambaSpec",
    [((1024, 512, 4), (3,)), ((32,), (8, 4))],
    ["torch.bfloat16", "torch.float32"],
)

# uint64_le of the first 8 bytes of sha256 of the spec's example string, computed with
# coreutils: printf '%s' "('model.layers.0.self_attn.attn', 'FullAttentionSpec',
# 'torch.bfloat16')" | sha256sum, its first 8 bytes read little-endian.
SPEC_EXAMPLE_FINGERPRINT = 0xD8FE581622DF5382


def attention_spec(block_size: int = 16) -> LayerSpec:
    return LayerSpec(
        type="full_attention",
        block_size=block_size,
        kernel_block_size=block_size,
        num_kv_heads=2,
        head_size=64,
        head_size_v=64,
        dtype=torch.bfloat16,
    )


def mla_spec(block_size: int = 16) -> LayerSpec:
    return LayerSpec(
        type="mla",
        block_size=block_size,
        kernel_block_size=block_size,
        head_size=576,
        dtype=torch.float8_e4m3fn,
        layout="NTC",
    )


def unsplit_spec(block_size: int = 16) -> LayerSpec:
    return LayerSpec(
        type="mamba",
        block_size=block_size,
        kernel_block_size=block_size,
        shapes=((3, 64), (8, 16, 4)),
        dtypes=(torch.bfloat16, torch.float32),
        checksummed_states=1,
    )


def split_spec(tp_size: int, block_size: int = 16) -> LayerSpec:
    """A TP-split state layer whose global shape is the same at any TP size dividing 32."""
    rows_a, rows_b, rows_c = 1024 // tp_size, 512 // tp_size, 32 // tp_size
    # The third segment is replicated on every rank: 4 global rows whatever the TP size.
    shapes = ((3, rows_a + rows_b + 4), (rows_c, 8, 4))
    splits = (
        StateSplit(axis=1, segments=((rows_a, 1), (rows_b, 1), (4, tp_size))),
        StateSplit(axis=0, segments=((rows_c, 1),)),
    )
    return LayerSpec(
        type="mamba",
        block_size=block_size,
        kernel_block_size=block_size,
        shapes=shapes,
        dtypes=(torch.bfloat16, torch.float32),
        state_splits=splits,
    )


def make_group(tp_size: int = 2, block_size: int = 16, extra: tuple = ()) -> GroupDescription:
    layers = (
        LayerEntry(ATTN, attention_spec(block_size)),
        LayerEntry(MLA, mla_spec(block_size)),
        LayerEntry(UNSPLIT, unsplit_spec(block_size)),
        LayerEntry(SPLIT, split_spec(tp_size, block_size)),
        LayerEntry(SHARED, attention_spec(block_size), shares=ATTN),
        *extra,
    )
    return GroupDescription(id=0, spec=attention_spec(block_size), layers=layers)


def test_layer_identities_match_the_spec() -> None:
    group = make_group(tp_size=2)
    identities = [layer_identity(entry, 2) for entry in group.layers]
    assert identities == [ATTN_ID, MLA_ID, UNSPLIT_ID, SPLIT_ID, SHARED_ID]


def test_layer_identity_repr_is_the_seeds() -> None:
    entry = LayerEntry(SPLIT, split_spec(4))
    assert repr(layer_identity(entry, 4)) == (
        "('model.layers.3.mixer', 'MambaSpec', [((1024, 512, 4), (3,)), ((32,), (8, 4))], "
        "['torch.bfloat16', 'torch.float32'])"
    )
    assert repr(layer_identity(LayerEntry(ATTN, attention_spec()), 1)) == (
        "('model.layers.0.self_attn.attn', 'FullAttentionSpec', 'torch.bfloat16')"
    )


def test_layer_fingerprint_is_sha256_of_the_repr() -> None:
    for identity in (ATTN_ID, MLA_ID, UNSPLIT_ID, SPLIT_ID):
        assert layer_fingerprint(identity) == ref_hash(identity)


def test_the_spec_example_has_its_fixed_value() -> None:
    group = GroupDescription(
        id=0, spec=attention_spec(), layers=(LayerEntry(ATTN, attention_spec()),)
    )
    assert group_fingerprint(group, 1) == SPEC_EXAMPLE_FINGERPRINT
    assert ref_hash(ATTN_ID) == SPEC_EXAMPLE_FINGERPRINT


# Each spec type's vLLM class, as docs/checksum.md lists them.
SPEC_CLASSES = {
    "full_attention": "FullAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "chunked_local_attention": "ChunkedLocalAttentionSpec",
    "mla": "MLAAttentionSpec",
    "sliding_window_mla": "SlidingWindowMLASpec",
}


def test_every_type_names_its_vllm_class_and_spec_class_overrides_it() -> None:
    for type_, class_name in SPEC_CLASSES.items():
        spec = replace(attention_spec(), type=type_, dtype=torch.float16)
        assert layer_identity(LayerEntry(ATTN, spec), 1) == (ATTN, class_name, "torch.float16")
    sink = replace(attention_spec(), spec_class="SinkFullAttentionSpec")
    assert layer_identity(LayerEntry(ATTN, sink), 2) == (
        ATTN,
        "SinkFullAttentionSpec",
        "torch.bfloat16",
    )
    state = replace(unsplit_spec(), spec_class="MambaSubclassSpec")
    assert layer_identity(LayerEntry(UNSPLIT, state), 2)[1] == "MambaSubclassSpec"
    base = group_fingerprint(make_group(), 2)
    layers = list(make_group().layers)
    layers[0] = LayerEntry(ATTN, sink)
    assert group_fingerprint(replace(make_group(), layers=tuple(layers)), 2) != base


def test_group_fingerprint_sums_every_layer_including_shared() -> None:
    expected = sum(ref_hash(i) for i in (ATTN_ID, MLA_ID, UNSPLIT_ID, SPLIT_ID, SHARED_ID)) % MOD
    assert group_fingerprint(make_group(tp_size=2), 2) == expected


def test_split_state_fingerprint_independent_of_tp_size() -> None:
    at_tp2 = make_group(tp_size=2)
    at_tp4 = make_group(tp_size=4)
    assert at_tp2.layers[3].spec.shapes != at_tp4.layers[3].spec.shapes
    assert layer_identity(at_tp4.layers[3], 4) == SPLIT_ID
    assert group_fingerprint(at_tp2, 2) == group_fingerprint(at_tp4, 4)


def test_drafter_layers_are_excluded() -> None:
    drafter = LayerEntry(DRAFT, attention_spec())
    with_drafter = make_group(extra=(drafter,))
    assert group_fingerprint(with_drafter, 2) != group_fingerprint(make_group(), 2)
    assert group_fingerprint(with_drafter, 2, frozenset({DRAFT})) == group_fingerprint(
        make_group(), 2
    )


def test_block_size_does_not_matter() -> None:
    assert group_fingerprint(make_group(block_size=16), 2) == group_fingerprint(
        make_group(block_size=64), 2
    )


def test_pp_stages_sum_to_the_whole_group() -> None:
    whole = make_group()
    stage0 = replace(whole, layers=whole.layers[:2])
    stage1 = replace(whole, layers=whole.layers[2:])
    empty = replace(whole, layers=())
    assert group_fingerprint(empty, 2) == 0
    total = (group_fingerprint(stage0, 2) + group_fingerprint(stage1, 2)) % MOD
    assert total == group_fingerprint(whole, 2)


def test_dtype_name_and_checksummed_states_change_it() -> None:
    base = group_fingerprint(make_group(), 2)
    fp16 = LayerEntry(ATTN, replace(attention_spec(), dtype=torch.float16))
    renamed = LayerEntry("model.layers.9.self_attn.attn", attention_spec())
    two_states = LayerEntry(UNSPLIT, replace(unsplit_spec(), checksummed_states=2))
    group = make_group()
    for index, entry in ((0, fp16), (0, renamed), (2, two_states)):
        layers = list(group.layers)
        layers[index] = entry
        assert group_fingerprint(replace(group, layers=tuple(layers)), 2) != base
    assert layer_identity(two_states, 2) == (
        UNSPLIT,
        "MambaSpec",
        ((3, 64), (8, 16, 4)),
        ["torch.bfloat16", "torch.float32"],
    )


def test_block_checksum_tag_matches_reference() -> None:
    rng = random.Random(7)
    for fingerprint in (0, 1, 2**63, 2**64 - 1, rng.getrandbits(64)):
        block_hash = rng.randbytes(32)
        assert block_checksum_tag(block_hash, fingerprint) == ref_tag(block_hash, fingerprint)


def test_block_checksum_tags_vectorised() -> None:
    rng = random.Random(11)
    hashes = [rng.randbytes(32) for _ in range(20)]
    fingerprint = rng.getrandbits(64) | 2**63
    tags = block_checksum_tags(hashes, fingerprint)
    assert tags.dtype == np.uint64
    assert tags.tolist() == [ref_tag(h, fingerprint) for h in hashes]
    assert block_checksum_tags([], fingerprint).shape == (0,)


def test_stored_checksum_binds_block_identity() -> None:
    rng = random.Random(3)
    fingerprint = rng.getrandbits(64)
    block_hash = rng.randbytes(32)
    partial = rng.getrandbits(64) | 2**63
    stored = stored_checksum(partial, block_hash, fingerprint)
    assert stored == partial ^ ref_tag(block_hash, fingerprint)
    # On load: recomputed sum XOR the expected hash's tag equals the stored entry.
    assert stored_checksum(partial, block_hash, fingerprint) == stored
    assert stored_checksum(partial, rng.randbytes(32), fingerprint) != stored
    assert stored_checksum(partial, block_hash, fingerprint ^ 1) != stored
    assert stored_checksum(partial ^ 4, block_hash, fingerprint) != stored
