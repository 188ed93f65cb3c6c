"""The KV checksum (scheme 1) as plain numpy and Python: the tests' independent reference.

Written from docs/checksum.md alone; it imports nothing from kvaudit. A group's model is
its caches in global form (every global head, every token), each with its replica class
``R``; ``block_checksums`` returns ``c(b)`` per block position and replica class.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

MOD64 = 1 << 64
MAX_HEADS = 65536


def layer_number(name: str) -> int:
    """The one all-digit dot-separated component of a layer name, as an integer."""
    numbers = [int(part) for part in name.split(".") if part.isascii() and part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"layer {name} has no single layer number")
    return numbers[0]


def layer_module(name: str) -> str:
    """The layer's name up to and including its layer number."""
    parts = name.split(".")
    index = next(i for i, part in enumerate(parts) if part.isascii() and part.isdigit())
    return ".".join(parts[: index + 1])


def cell_pieces(cells: np.ndarray) -> np.ndarray:
    """uint8 cells ``[..., cell_bytes]`` as little-endian 8-byte pieces ``[..., P]`` (uint64)."""
    if cells.dtype != np.uint8 or cells.shape[-1] % 8:
        raise ValueError("cells must be uint8 with a multiple of 8 bytes")
    return np.ascontiguousarray(cells).view("<u8").astype(np.uint64)


@dataclass(frozen=True)
class Layer:
    """An attention cache in global form: every token's cell of every global KV head.

    ``cells`` is uint8 ``[num_tokens, global_heads, cell_bytes]`` (K row then V row where
    they are stored apart). ``aliases`` are the other layers that share this cache.
    """

    name: str
    cells: np.ndarray
    replicas: int = 1
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class UnsplitState:
    """A Mamba layer whose checksummed states are one cell per block position.

    ``cells`` is uint8 ``[num_positions, heads, cell_bytes]``: head ``r`` is what rank ``r``
    holds (one head, ``replicas = tp_size``, when the states are TP-replicated).
    """

    name: str
    cells: np.ndarray
    replicas: int = 1
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class SplitState:
    """A Mamba layer whose states are split by rows across TP ranks, in global form.

    ``states[s]`` is ``[num_positions, *global_shape]`` with 2- or 4-byte elements;
    ``axes[s]`` its split axis (of the state's own shape); ``segments[s]`` its
    ``(global_rows, replicas)`` along that axis, in order.
    """

    name: str
    states: tuple[np.ndarray, ...]
    axes: tuple[int, ...]
    segments: tuple[tuple[tuple[int, int], ...], ...]
    aliases: tuple[str, ...] = ()


Cache = Layer | UnsplitState | SplitState


@dataclass(frozen=True)
class Group:
    """One KV cache group: its block size and its distinct caches (drafters left out)."""

    block_size: int
    caches: tuple[Cache, ...]


@dataclass(frozen=True)
class Slices:
    """Consecutive global heads of one layer, of one replica class, as pieces.

    ``pieces`` is uint64 ``[items, heads, P]``: items are tokens, or block positions for
    state layers (``per_block``), whose one state sits at the block's first token.
    """

    number: int
    first_head: int
    replicas: int
    pieces: np.ndarray
    per_block: bool


def _owner(cache: Cache) -> tuple[int, str]:
    """The lowest (layer number, name) that uses a cache: the one it is counted under."""
    return min((layer_number(name), name) for name in (cache.name, *cache.aliases))


def _cache_slices(number: int, cache: Cache) -> list[Slices]:
    """A cache's slices with heads numbered from 0 within it."""
    if isinstance(cache, Layer):
        return [Slices(number, 0, cache.replicas, cell_pieces(cache.cells), per_block=False)]
    if isinstance(cache, UnsplitState):
        return [Slices(number, 0, cache.replicas, cell_pieces(cache.cells), per_block=True)]
    slices = []
    head = 0
    for state, axis, segments in zip(cache.states, cache.axes, cache.segments, strict=True):
        size = state.dtype.itemsize
        if size not in (2, 4):
            raise ValueError("split state elements must be 2 or 4 bytes")
        unsigned = np.ascontiguousarray(state).view(f"<u{size}")
        rows = np.moveaxis(unsigned, axis + 1, 1)
        rows = rows.reshape(rows.shape[0], rows.shape[1], -1).astype(np.uint64)
        if sum(g for g, _ in segments) != rows.shape[1]:
            raise ValueError("segments do not cover the state's rows")
        offset = 0
        for global_rows, replicas in segments:
            part = rows[:, offset : offset + global_rows, :]
            slices.append(Slices(number, head, replicas, part, per_block=True))
            head += global_rows
            offset += global_rows
    return slices


def group_slices(group: Group) -> list[Slices]:
    """Every slice set of a group with its global layer number and first global head.

    Caches are counted under their owner; the caches of one layer number take consecutive
    heads in owner-name order.
    """
    owned = sorted(((_owner(cache), cache) for cache in group.caches), key=lambda x: x[0])
    modules: dict[int, str] = {}
    next_head: dict[int, int] = defaultdict(int)
    result = []
    for (number, name), cache in owned:
        if modules.setdefault(number, layer_module(name)) != layer_module(name):
            raise ValueError(f"two layer modules share layer number {number}")
        base = next_head[number]
        for part in _cache_slices(number, cache):
            result.append(
                Slices(
                    part.number, base + part.first_head, part.replicas, part.pieces, part.per_block
                )
            )
            next_head[number] = max(
                next_head[number], base + part.first_head + part.pieces.shape[1]
            )
    if any(heads > MAX_HEADS for heads in next_head.values()):
        raise ValueError("a layer has more than 65536 heads")
    return result


def valid_tokens(num_tokens: int, block_size: int, position: int) -> int:
    """``v_b = min(B, max(0, num_tokens - b*B))``."""
    return min(block_size, max(0, num_tokens - position * block_size))


def _slice_factors(part: Slices) -> np.ndarray:
    """``m(L, h)`` of each of the part's heads, uint64."""
    heads = part.pieces.shape[1]
    return np.array(
        [(2 * (part.number * MAX_HEADS + part.first_head + h) + 1) % MOD64 for h in range(heads)],
        dtype=np.uint64,
    )


def _part_checksum(
    part: Slices, num_tokens: int, block_size: int, position: int, positions: str
) -> np.uint64:
    """``sum over the part's heads of m(L, h) * s(L, h, b)`` mod 2**64, vectorised."""
    valid = valid_tokens(num_tokens, block_size, position)
    if valid == 0:
        return np.uint64(0)
    first = position * block_size
    num_pieces = part.pieces.shape[2]
    if part.per_block:
        x = part.pieces[position][None]  # one token: the block's first position
        tokens = np.array([first], dtype=np.uint64)
    else:
        x = part.pieces[first : first + valid]
        tokens = np.arange(first, first + valid, dtype=np.uint64)
    if positions == "block":
        tokens = tokens - np.uint64(first)
    j = tokens[:, None] * np.uint64(num_pieces) + np.arange(num_pieces, dtype=np.uint64)[None]
    weights = np.uint64(2) * j + np.uint64(1)  # [tokens, P]
    per_head = (x * weights[:, None, :]).sum(axis=(0, 2), dtype=np.uint64)  # s(L, h, b)
    return (per_head * _slice_factors(part)).sum(dtype=np.uint64)


def block_checksums(
    group: Group,
    num_tokens: int,
    start: int = 0,
    count: int | None = None,
    positions: str = "request",
) -> dict[int, np.ndarray]:
    """``c(b)`` for positions ``start .. start+count-1``, per replica class ``R`` (uint64).

    ``count`` defaults to the positions up to the last one holding a token.
    """
    if positions not in ("request", "block"):
        raise ValueError(positions)
    block_size = group.block_size
    if count is None:
        count = max(0, -(-num_tokens // block_size) - start)
    result: dict[int, np.ndarray] = {}
    with np.errstate(over="ignore"):
        for part in group_slices(group):
            values = result.setdefault(part.replicas, np.zeros(count, dtype=np.uint64))
            for i in range(count):
                values[i] += _part_checksum(part, num_tokens, block_size, start + i, positions)
    return result


def total(by_class: dict[int, np.ndarray], count: int | None = None) -> np.ndarray:
    """The sum over replica classes (what a producer sends), uint64."""
    arrays = list(by_class.values())
    if not arrays:
        return np.zeros(count or 0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return np.sum(np.stack(arrays), axis=0, dtype=np.uint64)


def slow_block_checksum(
    group: Group, num_tokens: int, position: int, positions: str = "request"
) -> int:
    """``c(b)`` summed over replica classes, by the definition's loops over Python ints."""
    block_size = group.block_size
    valid = valid_tokens(num_tokens, block_size, position)
    first = position * block_size
    result = 0
    for part in group_slices(group):
        num_pieces = part.pieces.shape[2]
        tokens = [first] if part.per_block and valid else list(range(first, first + valid))
        for h in range(part.pieces.shape[1]):
            s = 0
            for t in tokens:
                item = position if part.per_block else t
                u = t - first if positions == "block" else t
                for p in range(num_pieces):
                    j = u * num_pieces + p
                    s += int(part.pieces[item, h, p]) * (2 * j + 1)
            m = 2 * (part.number * MAX_HEADS + part.first_head + h) + 1
            result = (result + m * s) % MOD64
    return result


def identity_hash(identity: tuple) -> int:
    """``uint64_le(sha256(utf8(repr(identity)))[:8])`` of one layer's identity tuple."""
    text = repr(identity).encode("utf-8")
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def fingerprint(identities: list[tuple]) -> int:
    """A worker's group fingerprint: the identities' hashes summed mod 2**64."""
    return sum(identity_hash(identity) for identity in identities) % MOD64


# The strong lane (docs/checksum.md, "The strong lane"): the block read as one number whose
# piece (L, h, t, k) sits at bit 64 * E, E = ((L * 65536 + h) * 4096 + t mod 4096) * 2**20
# + k, reduced modulo the prime 2**64 - 59.

STRONG_PRIME = 2**64 - 59


def strong_place(number: int, head: int, token: int, piece: int) -> int:
    """``E`` of one piece (the slice number taken modulo 2**64, as the seed lane's)."""
    slice_number = (number * MAX_HEADS + head) % MOD64
    return (slice_number * 4096 + token % 4096) * 2**20 + piece


def _strong_part(
    part: Slices, num_tokens: int, block_size: int, position: int, positions: str
) -> int:
    """The part's slices' share of the strong lane of one block, as a Python integer."""
    valid = valid_tokens(num_tokens, block_size, position)
    if valid == 0:
        return 0
    first = position * block_size
    items = [(position, first)] if part.per_block else [(t, t) for t in range(first, first + valid)]
    num_pieces = part.pieces.shape[2]
    # 2**(64 p) for the pieces of a cell, then the cell's own place.
    piece_powers = [pow(2, 64 * p, STRONG_PRIME) for p in range(num_pieces)]
    total = 0
    for item, t in items:
        token = t - first if positions == "block" else t
        for h in range(part.pieces.shape[1]):
            cell = [int(x) for x in part.pieces[item, h]]
            number = sum(x * w for x, w in zip(cell, piece_powers, strict=True))
            place = strong_place(part.number, part.first_head + h, token, 0)
            total += number * pow(2, 64 * place, STRONG_PRIME)
    return total % STRONG_PRIME


def strong_block_checksums(
    group: Group,
    num_tokens: int,
    start: int = 0,
    count: int | None = None,
    positions: str = "request",
) -> dict[int, list[int]]:
    """The strong lane of positions ``start .. start+count-1``, per replica class ``R``."""
    block_size = group.block_size
    if count is None:
        count = max(0, -(-num_tokens // block_size) - start)
    result: dict[int, list[int]] = {}
    for part in group_slices(group):
        values = result.setdefault(part.replicas, [0] * count)
        for i in range(count):
            share = _strong_part(part, num_tokens, block_size, start + i, positions)
            values[i] = (values[i] + share) % STRONG_PRIME
    return result
