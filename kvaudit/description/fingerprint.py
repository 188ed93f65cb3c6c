"""Group fingerprints and the tags of stored checksums (docs/checksum.md).

A group's fingerprint identifies the layers its checksums cover: the sum of a hash of
each layer's identity (name, vLLM spec class, dtypes, global state shapes), so that two
engines whose layers differ are reported as not comparable rather than corrupted. It is
the seed engine's own fingerprint, bit for bit, so kvaudit's records compare with the
checksums an engine running the seed's checksum worker computes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from ..core.scheme import MASK64
from . import GroupDescription, LayerEntry

_U64 = struct.Struct("<Q")

StateShapes = tuple[tuple[int, ...], ...]
SplitStates = list[tuple[tuple[int, ...], tuple[int, ...]]]
LayerIdentity = tuple[str, str, str] | tuple[str, str, StateShapes | SplitStates, list[str]]


def _uint64_le(digest: bytes) -> int:
    """The first 8 bytes of a digest as a little-endian unsigned integer."""
    return int(_U64.unpack_from(digest)[0])


def layer_identity(entry: LayerEntry, tp_size: int) -> LayerIdentity:
    """What identifies one layer in a fingerprint: the same on every TP rank and PP layout.

    Attention: ``(name, spec class, str(dtype))``. Unsplit state: ``(name, spec class,
    shapes, [str(dtype), ...])`` of the checksummed states. TP-split state: ``(name, spec
    class, [(global segment rows, other dims) per state], [str(dtype), ...])``.
    """
    spec = entry.spec
    if not spec.is_state:
        return (entry.name, spec.class_name, str(spec.dtype))
    if spec.state_splits is None:
        covered = spec.covered_states
        shapes = tuple(tuple(int(size) for size in shape) for shape in spec.shapes[:covered])
        return (entry.name, spec.class_name, shapes, [str(d) for d in spec.dtypes[:covered]])
    states: SplitStates = []
    for shape, split in zip(spec.shapes, spec.state_splits, strict=True):
        # Global rows, not local ones: the identity must not depend on the TP size.
        rows = tuple(
            int(local_rows) * tp_size // int(replicas) for local_rows, replicas in split.segments
        )
        others = tuple(int(size) for axis, size in enumerate(shape) if axis != split.axis)
        states.append((rows, others))
    dtypes = [str(dtype) for dtype in spec.dtypes[: len(spec.state_splits)]]
    return (entry.name, spec.class_name, states, dtypes)


def layer_fingerprint(identity: LayerIdentity) -> int:
    """``uint64_le(sha256(utf8(repr(identity)))[:8])``."""
    return _uint64_le(hashlib.sha256(repr(identity).encode("utf-8")).digest())


def group_fingerprint(
    group: GroupDescription, tp_size: int, draft_layers: frozenset[str] = frozenset()
) -> int:
    """The sum mod 2**64 of the fingerprints of the group's layers on this worker.

    Every layer counts, aliases (``shares``) included; drafter layers do not.

    Args:
        group: The group, as the cache description holds it.
        tp_size: The worker's TP size (a TP-split state layer counts its global rows).
        draft_layers: The names of the drafter's layers, left out of the sum.

    Returns:
        The group's fingerprint, an unsigned 64-bit integer.

    """
    total = 0
    for entry in group.layers:
        if entry.name in draft_layers:
            continue
        total += layer_fingerprint(layer_identity(entry, tp_size))
    return total & MASK64


def block_checksum_tag(block_hash: bytes, fingerprint: int) -> int:
    """The tag that binds a stored checksum to the block it belongs to.

    The tag is ``uint64_le(sha256(block_hash || uint64_le(fingerprint))[:8])``.

    Args:
        block_hash: The block's hash, as bytes.
        fingerprint: The fingerprint of the block's group (taken mod 2**64).

    Returns:
        The tag, an unsigned 64-bit integer.

    """
    message = bytes(block_hash) + _U64.pack(fingerprint & MASK64)
    return _uint64_le(hashlib.sha256(message).digest())


def block_checksum_tags(hashes: Sequence[bytes], fingerprint: int) -> np.ndarray:
    """The tags of several block hashes under one fingerprint (uint64 array)."""
    return np.array([block_checksum_tag(h, fingerprint) for h in hashes], dtype=np.uint64)


def stored_checksum(partial_sum: int, block_hash: bytes, fingerprint: int) -> int:
    """What a connector stores with an offloaded block: its partial sum XOR its tag.

    Args:
        partial_sum: The block's partial checksum on this worker (taken mod 2**64).
        block_hash: The block's hash, as bytes.
        fingerprint: The fingerprint of the block's group on this worker.

    Returns:
        The stored checksum, an unsigned 64-bit integer.

    """
    return (partial_sum & MASK64) ^ block_checksum_tag(block_hash, fingerprint)
