"""The constants and small pieces of the checksum's definition (scheme 1, docs/checksum.md)."""

from __future__ import annotations

import numpy as np

from .errors import UnsupportedGroupError

MAX_KV_HEADS_PER_LAYER = 65536
MASK64 = (1 << 64) - 1

ReplicaKey = tuple[int, int]
"""``(replicas, replica_index)``: the ranks that hold the same heads, and which of them."""


def slice_number(layer_number: int, head: int) -> int:
    """``L * H + h``: a slice's place among every (layer, global head) of the model, as
    the signed 64-bit integer the kernels take: only its value modulo 2**64 enters the
    weights, and any layer number fits."""
    wrapped = (layer_number * MAX_KV_HEADS_PER_LAYER + head) & MASK64
    return wrapped - (1 << 64) if wrapped >> 63 else wrapped


STRONG_PRIME = (1 << 64) - 59
"""The strong lane's modulus: the largest prime below 2**64; 2 is a primitive root of it."""

STRONG_TOKEN_PLACES = 4096
"""Tokens that take distinct places in a slice: a token's place uses ``t mod 4096``."""

STRONG_PIECE_PLACES = 1 << 20
"""Places a cell's pieces have before the next token's begin."""


def strong_place(slice_index: int, token: int, piece: int) -> int:
    """``E = (s * 4096 + t mod 4096) * 2**20 + k``: the place of piece ``k`` of token
    ``t`` of slice ``s = (L * H + h) mod 2**64`` in the strong lane, whose weight is
    ``2**(64 E)`` modulo :data:`STRONG_PRIME` (docs/checksum.md, "The strong lane")."""
    token_place = (slice_index & MASK64) * STRONG_TOKEN_PLACES + token % STRONG_TOKEN_PLACES
    return token_place * STRONG_PIECE_PLACES + piece


def strong_weight(place: int) -> int:
    """``2**(64 * place)`` modulo :data:`STRONG_PRIME` (``2**64`` is 59 modulo it)."""
    return pow(59, place % (STRONG_PRIME - 1), STRONG_PRIME)


def strong_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(a + b) mod (2**64 - 59)`` of residues (uint64 arrays)."""
    gap, prime = np.uint64(59), np.uint64(STRONG_PRIME)
    total = a + b
    total = np.where(total < a, total + gap, total)  # a carry past 2**64 is worth 59
    return np.where(total >= prime, total - prime, total)


def valid_tokens(
    num_tokens: int | np.ndarray, block_size: int, positions: np.ndarray | int
) -> np.ndarray:
    """``v_b = min(B, max(0, num_tokens - b*B))``: the tokens of each block position that
    count; slots at or past ``num_tokens`` never do."""
    positions = np.asarray(positions, dtype=np.int64)
    return np.clip(num_tokens - positions * block_size, 0, block_size)


def to_hex(value: int) -> str:
    """A 64-bit value as 16 lowercase hex digits."""
    return f"{value & MASK64:016x}"


def from_hex(text: str) -> int:
    """16 hex digits as an unsigned 64-bit value."""
    return int(text, 16) & MASK64


def layer_module(layer_name: str) -> tuple[int, str]:
    """A layer's number (its one integer name component) and its module name (up to it).

    Raises:
        UnsupportedGroupError: The name has no integer component, or several.

    """
    parts = layer_name.split(".")
    # ASCII digits only: str.isdigit() also accepts "²", which int() refuses.
    numbered = [i for i, part in enumerate(parts) if part.isascii() and part.isdigit()]
    if len(numbered) != 1:
        raise UnsupportedGroupError(f"layer {layer_name} has no single layer number")
    index = numbered[0]
    return int(parts[index]), ".".join(parts[: index + 1])
