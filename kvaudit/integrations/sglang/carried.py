"""What a prefill's kvaudit checksum looks like in transit: the words kvaudit writes into
the spare words of a request's checksum row of SGLang's metadata buffers, which travels
with the last chunk of the request's KV (docs/sglang.md, "Inline verification").

Checksum row (8 uint64 per request; SGLang uses words 0 and 1), kvaudit version 3:

====  =====================================================================
word  content
====  =====================================================================
2     ``STRONG_TAG << 48 | unit << 32 | signature`` (0: nothing written; the request
      is unverified on decode); ``unit``: the tokens of one unit of the sums (the
      prefill's page size), ``signature``: the low 32 bits of ``content_signature``
3     the range's first token (a page boundary of the prefill) ``| end << 32``
4     the global layer ids summed and the transfer: ``first | end << 16 | room << 32``
      (a PP stage's layers; ``room``: the low 32 bits of SGLang's bootstrap room)
5..7  the strong lane's moments ``M_m = sum_j (j + 1)**m * S_j mod (2**64 - 59)``,
      ``m = 0, 1, 2``, over the range's units ``j`` (``j = token // unit``), ``S_j`` the
      unit's strong lane (docs/checksum.md) summed over the stage's ranks
====  =====================================================================

Three moments locate one differing unit among any number (``(j + 1) = M'_1 / M'_0`` of
the differences), name every differing unit of a range of up to three, and make a
difference confined to up to three units (each unit's strong lane changed, as every one-
or two-bit fault changes it) certain to be seen: the Vandermonde matrix of distinct
``j + 1`` is invertible modulo the prime.

A hybrid pool's request (two groups: full attention and window, or full attention and
Mamba state) is summed over every group: ``S_j`` is every paged group's blocks of unit
``j`` (the full layers' page and, where the window holds it, the window pool's page of
the same positions); a state group's block (the whole request's state, no position) is
the unit ``j = -1``, weight ``j + 1 = 0``, in ``M_0`` alone: distinct from every page's
weight, so the three moments' claims hold with it as one of the units. Each group's own
strong-lane sum and signature travel in the spare words of the request's
``bootstrap_room`` row of the same metadata buffers (SGLang reads word 0 only), so that
the decode names the group that failed; the checksum row alone covers every group:

====  =====================================================================
word  content (``bootstrap_room`` row)
====  =====================================================================
1     ``GROUPS_TAG << 48 | groups`` (0: no group words)
2k+2  group ``k``'s ``id << 32 | group_signature`` (low 32 bits), ``k < MAX_GROUPS``
2k+3  group ``k``'s strong lane summed over its blocks of the range and the stage's
      ranks, modulo ``2**64 - 59`` (its part of ``M_0``)
====  =====================================================================

Version 2 (``MARKER``: word 2 the marker, 3 the seed lane's sum over the range's blocks,
4 and 5 the range, 6 the 63-bit signature, 7 the layer word) is still read, from an older
kvaudit prefill, and compared by the seed lane alone (over every group, its group words
unused).

This module imports neither SGLang nor anything that does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...core.scheme import STRONG_PRIME
from . import hooked

if TYPE_CHECKING:
    from sglang.srt.disaggregation.utils import MetadataBuffers

MOD64 = 1 << 64
MASK32 = 0xFFFF_FFFF
MARKER = 0x6B76_6175_6469_7402
"""Word 2 of a version 2 row (``"kvaudit"``, version 2): the seed lane's sum in word 3."""
STRONG_TAG = 0x6B33
"""The top 16 bits of word 2 of a version 3 row (``"k3"``): the strong lane's moments."""
MOMENTS = 3
"""Moments of the strong lane a version 3 row carries (words 5..7)."""
SLOT_MARKER, SLOT_RANGE, SLOT_LAYERS, SLOT_SUMS = 2, 3, 4, 5
# Version 2's slots, read only.
V2_SUM, V2_FIRST, V2_END, V2_SIGNATURE, V2_LAYERS = 3, 4, 5, 6, 7
STRONG, SEED = "strong", "seed"
"""The lanes a row carries: the strong lane's moments (version 3), the seed lane's sum."""


GROUPS_TAG = 0x6B67
"""The top 16 bits of word 1 of a ``bootstrap_room`` row that carries group words."""
MAX_GROUPS = 3
"""Groups a row carries words of (words 2..7 of the ``bootstrap_room`` row)."""
GroupWord = tuple[int, int, int]
"""One group's words: ``(group id, low 32 bits of its signature, its strong-lane sum)``."""


@dataclass(frozen=True)
class Carried:
    """What a prefill wrote into a request's checksum row: over tokens ``first .. end -
    1`` and global layer ids ``layers[0] .. layers[1] - 1``, under ``signature``, for the
    transfer whose bootstrap room's low 32 bits are ``room``, ``sums``: the strong lane's
    moments over units of ``unit`` tokens (``lane`` strong), or the seed lane's sum over
    the range (``lane`` seed, ``unit`` 0: a version 2 row); ``groups``: a hybrid pool's
    group words from the ``bootstrap_room`` row."""

    sums: tuple[int, ...]
    first: int
    end: int
    signature: int
    layers: tuple[int, int]
    room: int
    unit: int = 0
    groups: tuple[GroupWord, ...] = ()
    """Each group's words, for a description of several groups (else empty)."""

    @property
    def lane(self) -> str:
        """``strong`` (the moments of a version 3 row) or ``seed`` (a version 2 row)."""
        return STRONG if self.unit else SEED


def signature_word(signature: int, lane: str) -> int:
    """The part of ``content_signature`` a row of ``lane`` carries (32 bits for strong)."""
    return signature & MASK32 if lane == STRONG else signature


def room_bits(bootstrap_room: int | None) -> int:
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
        2,  # what the signature covers; unchanged by version 3 (it carries the low bits)
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


def write_groups(
    metadata_buffers: MetadataBuffers, index: int, groups: Sequence[GroupWord]
) -> None:
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


def read_groups(metadata_buffers: MetadataBuffers, index: int) -> tuple[GroupWord, ...]:
    """The group words of ``bootstrap_room`` row ``index`` (empty: none, or not kvaudit's).

    Args:
        metadata_buffers: SGLang's ``MetadataBuffers``.
        index: The request's metadata buffer index.

    Returns:
        Each group's ``(id, signature, sum)``.

    """
    room = hooked.read_or_none(
        metadata_buffers, hooked.BOOTSTRAP_ROOM, "no group words read (the moments still are)"
    )
    if room is None or room.shape[-1] < 8:
        return ()
    words = [v % MOD64 for v in room.view(torch.int64)[index].tolist()]
    head = words[1]
    count = head & 0xFF
    if head >> 48 != GROUPS_TAG or not 0 < count <= MAX_GROUPS:
        return ()
    # A sum at or above the prime is no kvaudit prefill's: no group words (the checksum
    # row still covers every group).
    if not all(words[3 + 2 * k] < STRONG_PRIME for k in range(count)):
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


def write_carried(metadata_buffers: MetadataBuffers, index: int, carried: Carried | None) -> None:
    """Words 2..7 of checksum row ``index``: ``carried`` (version 3), or zeros (nothing
    written).

    Args:
        metadata_buffers: SGLang's ``MetadataBuffers`` (with its ``kv_checksum`` rows).
        index: The request's metadata buffer index.
        carried: What to carry (the strong lane's moments), or None.

    Raises:
        ValueError: A value that does not fit its word (a seed-lane value: kvaudit writes
            version 3 only).

    """
    words = metadata_buffers.kv_checksum.view(torch.int64)[index]
    if carried is None:
        words[SLOT_MARKER:] = 0
        return
    if carried.lane != STRONG or len(carried.sums) != MOMENTS:
        raise ValueError("a row carries the strong lane's moments")
    if not 0 < carried.unit <= 0xFFFF or carried.end > MASK32 or carried.signature > MASK32:
        raise ValueError(f"unit {carried.unit} or range end {carried.end} does not fit the row")
    if not all(0 <= v < STRONG_PRIME for v in carried.sums):
        raise ValueError("a moment is not below 2**64 - 59")
    values = (
        STRONG_TAG << 48 | carried.unit << 32 | carried.signature,
        carried.first | carried.end << 32,
        layer_word(carried.layers, carried.room),
        *carried.sums,
    )
    for slot, value in enumerate(values, start=SLOT_MARKER):
        words[slot] = value - MOD64 if value >= 1 << 63 else value


def read_carried(metadata_buffers: MetadataBuffers, index: int) -> Carried | Unverified:
    """What checksum row ``index`` carries from a kvaudit prefill (version 3, or 2).

    Args:
        metadata_buffers: SGLang's ``MetadataBuffers``.
        index: The request's metadata buffer index.

    Returns:
        The carried checksum, or why there is none.

    """
    if hooked.read_or_none(metadata_buffers, hooked.KV_CHECKSUM, "requests unverified") is None:
        return Unverified("no checksum row (needs --disaggregation-enable-kv-checksum)")
    words = [v % MOD64 for v in metadata_buffers.kv_checksum.view(torch.int64)[index].tolist()]
    marker = words[SLOT_MARKER]
    if marker == 0:
        return Unverified("no kvaudit checksum from the prefill")
    if marker == MARKER:
        layers, room = split_layer_word(words[V2_LAYERS])
        first, end = words[V2_FIRST], words[V2_END]
        carried = Carried((words[V2_SUM],), first, end, words[V2_SIGNATURE], layers, room)
    elif marker >> 48 == STRONG_TAG:
        layers, room = split_layer_word(words[SLOT_LAYERS])
        first, end = words[SLOT_RANGE] & MASK32, words[SLOT_RANGE] >> 32
        sums = tuple(words[SLOT_SUMS : SLOT_SUMS + MOMENTS])
        unit = (marker >> 32) & 0xFFFF
        carried = Carried(sums, first, end, marker & MASK32, layers, room, unit)
        if unit == 0 or not all(v < STRONG_PRIME for v in sums):
            return Unverified(MALFORMED, f"unit {unit} or a moment at or above 2**64 - 59")
    else:
        return Unverified(f"unknown kvaudit marker {marker:#x} (another kvaudit version)")
    # A row no kvaudit prefill writes (a torn or foreign write): the request is
    # unverified, never a reason to lose the batch's other requests.
    if not layers[0] < layers[1]:
        return Unverified(
            MALFORMED, f"layer range {layers[0]}..{layers[1] - 1} is empty or inverted"
        )
    if not first < end:
        return Unverified(MALFORMED, f"token range {first}..{end} is empty or inverted")
    return carried


def locate(differences: Sequence[int], units: Sequence[int]) -> list[int] | None:
    """The units whose strong lane differs, from the differences of the moments.

    With ``D_m = sum_j (j + 1)**m * d_j`` (``d_j``: unit ``j``'s difference): a range of
    up to three units is solved exactly (every differing unit); a longer one is located
    where one unit differs (``j + 1 = D_1 / D_0``, checked against ``D_2``).

    Args:
        differences: ``D_0 .. D_2`` modulo ``2**64 - 59`` (not all 0).
        units: The range's units, ascending (``-1``: a state group's block, weight 0).

    Returns:
        The differing units, or None where they cannot be named (more than one unit of a
        range longer than three).

    """
    prime = STRONG_PRIME
    xs = [j + 1 for j in units]
    if len(xs) <= MOMENTS:
        solved = _solve(xs, list(differences[: len(xs)]))
        # The moments the range's units do not use must agree with the solution.
        for m in range(len(xs), MOMENTS):
            if (
                sum(pow(x, m, prime) * d for x, d in zip(xs, solved, strict=True)) % prime
                != (differences[m])
            ):
                return None
        return [j for j, d in zip(units, solved, strict=True) if d]
    d0, d1, d2 = differences[:MOMENTS]
    if d0 == 0:
        return None
    x = d1 * pow(d0, prime - 2, prime) % prime
    if x * d1 % prime != d2 or x - 1 not in units:
        return None
    return [x - 1]


def _solve(xs: list[int], rhs: list[int]) -> list[int]:
    """``d`` with ``sum_i xs[i]**m * d[i] = rhs[m]`` (m < len(xs)) modulo the prime: the
    Vandermonde system of distinct ``xs``, by Gaussian elimination."""
    prime = STRONG_PRIME
    n = len(xs)
    rows = [[pow(x, m, prime) for x in xs] + [rhs[m] % prime] for m in range(n)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if rows[r][col])
        rows[col], rows[pivot] = rows[pivot], rows[col]
        inverse = pow(rows[col][col], prime - 2, prime)
        rows[col] = [v * inverse % prime for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col]:
                factor = rows[r][col]
                rows[r] = [
                    (a - factor * b) % prime for a, b in zip(rows[r], rows[col], strict=True)
                ]
    return [row[n] for row in rows]
