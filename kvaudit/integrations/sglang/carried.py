"""What a prefill's kvaudit checksum looks like in transit: the words kvaudit writes into
the spare words of a request's checksum row of SGLang's metadata buffers, which travels
with the last chunk of the request's KV (docs/sglang.md, "Inline verification").

Checksum row (8 uint64 per request; SGLang uses words 0 and 1):

====  =====================================================================
word  content
====  =====================================================================
2     ``MARKER`` (0: nothing written; the request is unverified on decode)
3     the sum over the range's blocks of kvaudit's block checksums (uint64)
4     the range's first token (a page boundary of the prefill)
5     the range's end (exclusive)
6     ``content_signature`` of the layers summed: names, model KV heads, head sizes,
      dtype
7     the global layer ids summed and the transfer: ``first | end << 16 | room << 32``
      (a PP stage's layers; ``room``: the low 32 bits of SGLang's bootstrap room)
====  =====================================================================

A hybrid pool's request (two groups: full attention and window, or full attention and
Mamba state) carries, besides word 3's sum over every group, each group's own sum and
signature in the spare words of its ``bootstrap_room`` row of the same metadata buffers
(SGLang reads word 0 only), so that the decode names the group that failed:

====  =====================================================================
word  content (``bootstrap_room`` row)
====  =====================================================================
1     ``GROUPS_TAG << 48 | groups`` (0: no group words)
2k+2  group ``k``'s ``id << 32 | group_signature`` (low 32 bits), ``k < MAX_GROUPS``
2k+3  group ``k``'s sum over its blocks of the range (uint64)
====  =====================================================================

This module imports neither SGLang nor anything that does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MOD64 = 1 << 64
MASK32 = 0xFFFF_FFFF
MARKER = 0x6B76_6175_6469_7402
"""Word 2 of the checksum row: kvaudit wrote words 3..7 (``"kvaudit"``, version 2)."""
SLOT_MARKER, SLOT_SUM, SLOT_FIRST, SLOT_END, SLOT_SIGNATURE, SLOT_LAYERS = 2, 3, 4, 5, 6, 7


GROUPS_TAG = 0x6B67
"""The top 16 bits of word 1 of a ``bootstrap_room`` row that carries group words."""
MAX_GROUPS = 3
"""Groups a row carries words of (words 2..7 of the ``bootstrap_room`` row)."""
GroupWord = tuple[int, int, int]
"""One group's words: ``(group id, low 32 bits of its signature, its sum)``."""


@dataclass(frozen=True)
class Carried:
    """What a prefill wrote into a request's checksum row: the summed checksum of tokens
    ``first .. end - 1`` over global layer ids ``layers[0] .. layers[1] - 1``, under
    ``signature``, for the transfer whose bootstrap room's low 32 bits are ``room``."""

    total: int
    first: int
    end: int
    signature: int
    layers: tuple[int, int]
    room: int
    groups: tuple[GroupWord, ...] = ()
    """Each group's words, for a description of several groups (else empty)."""


def room_bits(bootstrap_room: Any) -> int:
    """The low 32 bits of SGLang's bootstrap room (0 where there is none)."""
    return int(bootstrap_room or 0) & 0xFFFF_FFFF


def layer_word(layers: tuple[int, int], room: int) -> int:
    """Word 7: ``first | end << 16 | room << 32``."""
    first, end = layers
    if not 0 <= first < end < 1 << 16:
        raise ValueError(f"layer ids {first}..{end - 1} do not fit the checksum row")
    return first | end << 16 | room_bits(room) << 32


def split_layer_word(word: int) -> tuple[tuple[int, int], int]:
    """Word 7's layer ids and room."""
    return (word & 0xFFFF, (word >> 16) & 0xFFFF), word >> 32


@dataclass(frozen=True)
class Unverified:
    """A request that arrived without a kvaudit checksum it can be verified with: why
    (``reason``, counted) and, where it helps, the values seen (``detail``, logged)."""

    reason: str
    detail: str = ""


MALFORMED = "malformed kvaudit checksum row"
"""The reason of a row with kvaudit's marker whose words no kvaudit prefill writes."""


def _entry_name(entry: Any) -> str:
    """A description layer entry's name (the entry itself, or its ``name``)."""
    return entry if isinstance(entry, str) else str(entry["name"])


def content_signature(
    raw: Mapping[str, Any], layers: Sequence[str] | None = None, tp_size: int = 1
) -> int:
    """A 63-bit nonzero hash of what a checksum of a description's layers covers,
    independent of TP width, page size and block count: kind, layer names, model KV
    heads, head sizes and dtype (of a description of several groups: every group's
    ``group_signature`` identity, in order).

    Args:
        raw: ``describe_sglang_cache``'s dict.
        layers: The layer names summed (default: every layer of the description; a
            description of one group only).
        tp_size: The TP size the description's state rows are split over.

    Returns:
        The signature (positive, never 0).

    """
    if len(raw["groups"]) > 1:
        if layers is not None:
            raise ValueError("a subset of layers is summed for one group only")
        identity: tuple = tuple(_group_identity(raw, g, tp_size) for g in raw["groups"])
        return _hash(("kvaudit-sglang-inline-groups", 1, identity))
    (group,) = raw["groups"]
    spec = group["spec"]
    identity = (
        "kvaudit-sglang-inline",
        2,
        spec["type"],
        # Names only: a layer entry with its own spec (its scales) is a mapping.
        tuple(_entry_name(entry) for entry in (group["layers"] if layers is None else layers)),
        raw.get("model_kv_heads"),
        spec["head_size"],
        spec.get("head_size_v"),
        spec["dtype"],
    )
    return _hash(identity)


def _hash(identity: tuple) -> int:
    digest = hashlib.blake2b(repr(identity).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) | 1


def _group_identity(raw: Mapping[str, Any], group: Mapping[str, Any], tp_size: int) -> tuple:
    """What a group's checksum covers, the same at every TP width: its id and type, and
    per layer its name, heads (the model's), sizes, dtypes and window, or its states'
    global shapes and split segments."""
    spec = group["spec"]
    if spec["type"] != "mamba":
        return (
            group["id"],
            spec["type"],
            tuple(_entry_name(entry) for entry in group["layers"]),
            raw.get("model_kv_heads"),
            spec["head_size"],
            spec.get("head_size_v"),
            spec["dtype"],
            spec.get("sliding_window"),
        )
    layers = []
    for layer in group["layers"]:
        merged = {**spec, **layer.get("spec", {})}
        states = []
        for shape, dtype, split in zip(
            merged["shapes"], merged["dtypes"], merged["state_splits"], strict=True
        ):
            rows = [local * tp_size // replicas for local, replicas in split["segments"]]
            whole = list(shape)
            whole[split["axis"]] = sum(rows)
            states.append((tuple(whole), dtype, split["axis"], tuple(rows)))
        layers.append((layer["name"], tuple(states)))
    return (group["id"], "mamba", tuple(layers))


def group_signature(raw: Mapping[str, Any], group_id: int, tp_size: int = 1) -> int:
    """A 32-bit nonzero hash of one group's identity (``_group_identity``), what the
    group words carry: equal on both sides when the group describes the same KV.

    Args:
        raw: ``describe_sglang_cache``'s dict.
        group_id: The group.
        tp_size: The TP size the description's state rows are split over.

    Returns:
        The signature's low 32 bits (never 0).

    """
    (group,) = [g for g in raw["groups"] if g["id"] == group_id]
    return (_hash(("kvaudit-sglang-group", 1, _group_identity(raw, group, tp_size))) & MASK32) | 1


def write_groups(metadata_buffers: Any, index: int, groups: Sequence[GroupWord]) -> None:
    """Words 1..7 of ``bootstrap_room`` row ``index``: the group words (``groups``, at
    most ``MAX_GROUPS``), or zeros (none).

    Args:
        metadata_buffers: SGLang's ``MetadataBuffers``.
        index: The request's metadata buffer index.
        groups: Each group's ``(id, signature, sum)``.

    """
    words = metadata_buffers.bootstrap_room.view(torch.int64)[index]
    words[1:8] = 0
    if not groups:
        return
    if len(groups) > MAX_GROUPS:
        raise ValueError(f"{len(groups)} groups do not fit the row (at most {MAX_GROUPS})")
    values = [GROUPS_TAG << 48 | len(groups)]
    for group_id, signature, total in groups:
        values += [group_id << 32 | (signature & MASK32), total]
    for slot, value in enumerate(values, start=1):
        words[slot] = value - MOD64 if value >= 1 << 63 else value


def read_groups(metadata_buffers: Any, index: int) -> tuple[GroupWord, ...]:
    """The group words of ``bootstrap_room`` row ``index`` (empty: none, or not kvaudit's).

    Args:
        metadata_buffers: SGLang's ``MetadataBuffers``.
        index: The request's metadata buffer index.

    Returns:
        Each group's ``(id, signature, sum)``.

    """
    room = getattr(metadata_buffers, "bootstrap_room", None)
    if room is None or room.shape[-1] < 8:
        return ()
    words = [v % MOD64 for v in room.view(torch.int64)[index].tolist()]
    head = words[1]
    count = head & 0xFF
    if head >> 48 != GROUPS_TAG or not 0 < count <= MAX_GROUPS:
        return ()
    return tuple(
        (words[2 + 2 * k] >> 32, words[2 + 2 * k] & MASK32, words[3 + 2 * k]) for k in range(count)
    )


def group_row(groups: Sequence[GroupWord]) -> list[int]:
    """Group words as ``2 * MAX_GROUPS`` words for a gather (zeros where none)."""
    words = [0] * (2 * MAX_GROUPS)
    for k, (group_id, signature, total) in enumerate(groups[:MAX_GROUPS]):
        words[2 * k] = group_id << 32 | signature
        words[2 * k + 1] = total
    return words


def split_group_row(words: Sequence[int]) -> tuple[GroupWord, ...]:
    """``group_row``'s words back as group words."""
    return tuple(
        (words[2 * k] >> 32, words[2 * k] & MASK32, words[2 * k + 1])
        for k in range(MAX_GROUPS)
        if words[2 * k]
    )


def write_carried(metadata_buffers: Any, index: int, carried: Carried | None) -> None:
    """Words 2..7 of checksum row ``index``: ``carried``, or zeros (nothing written).

    Args:
        metadata_buffers: SGLang's ``MetadataBuffers`` (with its ``kv_checksum`` rows).
        index: The request's metadata buffer index.
        carried: What to carry, or None.

    """
    words = metadata_buffers.kv_checksum.view(torch.int64)[index]
    if carried is None:
        words[SLOT_MARKER : SLOT_LAYERS + 1] = 0
        return
    values = (
        MARKER,
        carried.total,
        carried.first,
        carried.end,
        carried.signature,
        layer_word(carried.layers, carried.room),
    )
    for slot, value in zip(range(SLOT_MARKER, SLOT_LAYERS + 1), values, strict=True):
        words[slot] = value - MOD64 if value >= 1 << 63 else value


def read_carried(metadata_buffers: Any, index: int) -> Carried | Unverified:
    """What checksum row ``index`` carries from a kvaudit prefill.

    Args:
        metadata_buffers: SGLang's ``MetadataBuffers``.
        index: The request's metadata buffer index.

    Returns:
        The carried checksum, or why there is none.

    """
    if getattr(metadata_buffers, "kv_checksum", None) is None:
        return Unverified("no checksum row (needs --disaggregation-enable-kv-checksum)")
    words = [v % MOD64 for v in metadata_buffers.kv_checksum.view(torch.int64)[index].tolist()]
    marker = words[SLOT_MARKER]
    if marker == 0:
        return Unverified("no kvaudit checksum from the prefill")
    if marker != MARKER:
        return Unverified(f"unknown kvaudit marker {marker:#x} (another kvaudit version)")
    layers, room = split_layer_word(words[SLOT_LAYERS])
    first, end = words[SLOT_FIRST], words[SLOT_END]
    # A row no kvaudit prefill writes (a torn or foreign write): the request is
    # unverified, never a reason to lose the batch's other requests.
    if not layers[0] < layers[1]:
        return Unverified(
            MALFORMED, f"layer range {layers[0]}..{layers[1] - 1} is empty or inverted"
        )
    if not first < end:
        return Unverified(MALFORMED, f"token range {first}..{end} is empty or inverted")
    return Carried(words[SLOT_SUM], first, end, words[SLOT_SIGNATURE], layers, room)
