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
