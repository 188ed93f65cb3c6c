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
nonzero ``j + 1`` is invertible modulo the prime.

Version 2 (``MARKER``: word 2 the marker, 3 the seed lane's sum over the range's blocks,
4 and 5 the range, 6 the 63-bit signature, 7 the layer word) is still read, from an older
kvaudit prefill, and compared by the seed lane alone.

This module imports neither SGLang nor anything that does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...core.scheme import STRONG_PRIME

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


@dataclass(frozen=True)
class Carried:
    """What a prefill wrote into a request's checksum row: over tokens ``first .. end -
    1`` and global layer ids ``layers[0] .. layers[1] - 1``, under ``signature``, for the
    transfer whose bootstrap room's low 32 bits are ``room``, ``sums``: the strong lane's
    moments over units of ``unit`` tokens (``lane`` strong), or the seed lane's sum over
    the range (``lane`` seed, ``unit`` 0: a version 2 row)."""

    sums: tuple[int, ...]
    first: int
    end: int
    signature: int
    layers: tuple[int, int]
    room: int
    unit: int = 0

    @property
    def lane(self) -> str:
        """``strong`` (the moments of a version 3 row) or ``seed`` (a version 2 row)."""
        return STRONG if self.unit else SEED


def signature_word(signature: int, lane: str) -> int:
    """The part of ``content_signature`` a row of ``lane`` carries (32 bits for strong)."""
    return signature & MASK32 if lane == STRONG else signature


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


def content_signature(raw: Mapping[str, Any], layers: Sequence[str] | None = None) -> int:
    """A 63-bit nonzero hash of what a checksum of a description's layers covers,
    independent of TP width, page size and block count: kind, layer names, model KV
    heads, head sizes and dtype.

    Args:
        raw: ``describe_sglang_cache``'s dict.
        layers: The layer names summed (default: every layer of the description).

    Returns:
        The signature (positive, never 0).

    """
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
    digest = hashlib.blake2b(repr(identity).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) | 1


def write_carried(metadata_buffers: Any, index: int, carried: Carried | None) -> None:
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


def read_carried(metadata_buffers: Any, index: int) -> Carried | Unverified:
    """What checksum row ``index`` carries from a kvaudit prefill (version 3, or 2).

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
        units: The range's units, ascending.

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
    Vandermonde system of distinct nonzero ``xs``, by Gaussian elimination."""
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
