"""Producer checksums on the wire: a request's totals per group as bytes (docs/checksum.md).

Layout (KVC2), little-endian: magic ``KVC2``, ``num_tokens`` u64, ``numbering`` u8 (0
request positions, 1 block positions), ``num_groups`` u16; per group ``group_id`` u32,
``fingerprint`` u64, ``block_size`` u32, ``start`` u32, ``count`` u32, then ``count``
u64 totals. KVC3, what kvaudit sends, is KVC2 with each group's ``count`` u64 totals of
the strong lane (residues below ``2**64 - 59``) after its seed totals; KVC2 (the seed
lane alone) is still read. Decoding is strict: anything malformed is a
``WireFormatError``.
"""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import WireFormatError
from ..core.scheme import MASK64, STRONG_PRIME
from ..core.validation import MAX_TOKENS, Positions, check_positions

MAGIC = b"KVC3"
SEED_MAGIC = b"KVC2"
"""The seed lane alone (a sender without the strong lane)."""
RETIRED_MAGIC = b"KVC1"
# Wire code of each position numbering.
NUMBERING_CODES: dict[Positions, int] = {"request": 0, "block": 1}
_NUMBERING_NAMES: dict[int, Positions] = {code: name for name, code in NUMBERING_CODES.items()}
_HEADER = struct.Struct("<4sQBH")
_GROUP = struct.Struct("<IQIII")
_TOTAL_BYTES = 8
_U16_MAX = (1 << 16) - 1
_U32_MAX = (1 << 32) - 1


@dataclass(eq=False)
class WireGroup:
    """One group's producer totals: positions ``start .. start + len(totals) - 1``."""

    group_id: int
    fingerprint: int
    block_size: int
    start: int
    totals: np.ndarray
    strong: np.ndarray | None = None
    """The strong lane's totals of the same positions, or None (the seed lane alone)."""

    def __post_init__(self) -> None:
        # Same bits whatever integer type the caller had (int64 wrap-around included).
        self.totals = np.ascontiguousarray(self.totals, dtype=np.uint64)
        if self.strong is not None:
            self.strong = np.ascontiguousarray(self.strong, dtype=np.uint64)

    @property
    def count(self) -> int:
        """The number of positions (totals) the group carries."""
        return int(self.totals.shape[0])

    def __eq__(self, other: object) -> bool:
        """Equal fields and equal totals, element by element."""
        if not isinstance(other, WireGroup):
            return NotImplemented
        return (
            self.group_id == other.group_id
            and self.fingerprint == other.fingerprint
            and self.block_size == other.block_size
            and self.start == other.start
            and np.array_equal(self.totals, other.totals)
            and (self.strong is None) == (other.strong is None)
            and (self.strong is None or np.array_equal(self.strong, other.strong))
        )


@dataclass
class WireChecksums:
    """One request's producer checksums: its token count, numbering and totals per group.

    ``num_tokens`` is the request's token count when it was checksummed, ``numbering``
    how positions were numbered (``"request"`` or ``"block"``).
    """

    num_tokens: int
    numbering: Positions
    groups: list[WireGroup] = field(default_factory=list)


def _check_field(name: str, value: int, limit: int, group_id: int) -> None:
    """Raise ``WireFormatError`` unless ``0 <= value <= limit``."""
    if not 0 <= value <= limit:
        raise WireFormatError(
            f"group {group_id}: {name} {value} does not fit in {limit.bit_length()} bits",
            source="<wire>",
        )


def _encode_group(group: WireGroup, strong: bool) -> list[bytes]:
    """One group's header and totals (then its strong totals, for KVC3) as bytes."""
    _check_field("group_id", group.group_id, _U32_MAX, group.group_id)
    _check_field("fingerprint", group.fingerprint, MASK64, group.group_id)
    _check_field("block_size", group.block_size, _U32_MAX, group.group_id)
    if group.block_size == 0:
        # Readers reject it: a block of no tokens holds no position.
        raise WireFormatError(f"group {group.group_id}: block size 0", source="<wire>")
    _check_field("start", group.start, _U32_MAX, group.group_id)
    if group.totals.ndim != 1:
        raise WireFormatError(
            f"group {group.group_id}: totals must be one-dimensional", source="<wire>"
        )
    _check_field("count", group.count, _U32_MAX, group.group_id)
    header = _GROUP.pack(
        int(group.group_id),
        int(group.fingerprint),
        int(group.block_size),
        int(group.start),
        group.count,
    )
    parts = [header, group.totals.astype("<u8", copy=False).tobytes()]
    if strong:
        assert group.strong is not None
        if group.strong.shape != group.totals.shape:
            raise WireFormatError(
                f"group {group.group_id}: {group.strong.shape[0]} strong totals for "
                f"{group.count} positions",
                source="<wire>",
            )
        if bool((group.strong >= np.uint64(STRONG_PRIME)).any()):
            raise WireFormatError(
                f"group {group.group_id}: a strong total is not below 2**64 - 59", source="<wire>"
            )
        parts.append(group.strong.astype("<u8", copy=False).tobytes())
    return parts


def encode_wire(checksums: WireChecksums) -> bytes:
    """The wire bytes of one request's producer checksums.

    Args:
        checksums: The request's token count, position numbering and group totals.

    Returns:
        KVC3 bytes where every group carries the strong lane, else KVC2 bytes, laid out
        as the module describes.

    Raises:
        WireFormatError: An unknown numbering, a token count, a field or the number of
            groups out of range, or a duplicate group id.

    """
    if checksums.numbering not in NUMBERING_CODES:
        raise WireFormatError(
            f"unknown numbering {checksums.numbering!r}, expected one of "
            f"{', '.join(NUMBERING_CODES)}",
            source="<wire>",
        )
    if not 0 <= checksums.num_tokens <= MASK64:
        raise WireFormatError(
            f"num_tokens {checksums.num_tokens} does not fit in 64 bits", source="<wire>"
        )
    groups = checksums.groups
    if len(groups) > _U16_MAX:
        raise WireFormatError(f"{len(groups)} groups do not fit in 16 bits", source="<wire>")
    strong = bool(groups) and all(group.strong is not None for group in groups)
    magic = MAGIC if strong else SEED_MAGIC
    parts = [
        _HEADER.pack(
            magic, int(checksums.num_tokens), NUMBERING_CODES[checksums.numbering], len(groups)
        )
    ]
    seen: set[int] = set()
    for group in groups:
        if group.group_id in seen:
            raise WireFormatError(f"group {group.group_id} appears twice", source="<wire>")
        seen.add(group.group_id)
        parts.extend(_encode_group(group, strong))
    return b"".join(parts)


def _decode_header(data: bytes, source: str) -> tuple[int, Positions, int, bool]:
    """``(num_tokens, numbering, num_groups, strong)`` of the buffer's header."""
    size = len(data)
    if size >= 4 and data[:4] == RETIRED_MAGIC:
        raise WireFormatError(
            "KVC1 wire bytes (without num_tokens and numbering) are retired: the producer "
            "must send KVC2",
            source,
        )
    if size < _HEADER.size:
        if all(data[: min(size, 4)] != m[: min(size, 4)] for m in (MAGIC, SEED_MAGIC)):
            raise WireFormatError(f"wrong magic {data[:4]!r} at byte 0, expected {MAGIC!r}", source)
        raise WireFormatError(
            f"truncated: {size} bytes, the header needs {_HEADER.size}", source=source
        )
    magic, num_tokens, numbering, num_groups = _HEADER.unpack_from(data, 0)
    if magic not in (MAGIC, SEED_MAGIC):
        raise WireFormatError(
            f"wrong magic {magic!r} at byte 0, expected {MAGIC!r} or {SEED_MAGIC!r}", source
        )
    if numbering not in _NUMBERING_NAMES:
        raise WireFormatError(
            f"unknown numbering {numbering} at byte 12, expected 0 (request) or 1 (block)",
            source,
        )
    if num_tokens > MAX_TOKENS:
        raise WireFormatError(
            f"num_tokens {num_tokens} at byte 4 is more than the {MAX_TOKENS} kvaudit reads",
            source,
        )
    return num_tokens, _NUMBERING_NAMES[numbering], num_groups, magic == MAGIC


def decode_wire(data: bytes, source: str = "<wire>") -> WireChecksums:
    """The producer checksums in wire bytes.

    Args:
        data: The KVC3 or KVC2 bytes (any bytes-like object).
        source: What the bytes are named in errors.

    Returns:
        The request's checksums; each group's totals are a copy, not a view of ``data``.

    Raises:
        WireFormatError: A wrong magic (KVC1 named as retired), an unknown numbering, a
            truncated or over-long buffer, a count that does not fit in the bytes left, a
            zero block size or a duplicate group id, a token count or block size past the
            limits (``kvaudit.core.validation``) or a start beyond the token count; the message
            names the source and the byte offset.

    """
    data = bytes(data)
    size = len(data)
    num_tokens, numbering, num_groups, strong = _decode_header(data, source)
    lanes = 2 if strong else 1
    offset = _HEADER.size
    groups: list[WireGroup] = []
    seen: set[int] = set()
    for index in range(num_groups):
        if size - offset < _GROUP.size:
            raise WireFormatError(
                f"truncated at byte {offset}: group {index} of {num_groups} needs a "
                f"{_GROUP.size}-byte header, {size - offset} bytes left",
                source,
            )
        group_id, fingerprint, block_size, start, count = _GROUP.unpack_from(data, offset)
        if group_id in seen:
            raise WireFormatError(f"group id {group_id} repeated at byte {offset}", source)
        if block_size == 0:
            raise WireFormatError(f"group {group_id} at byte {offset}: block size 0", source)
        offset += _GROUP.size
        needed = count * _TOTAL_BYTES * lanes
        if size - offset < needed:
            raise WireFormatError(
                f"count {count} of group {group_id} does not fit: at byte {offset} it needs "
                f"{needed} bytes, {size - offset} left",
                source,
            )
        check_positions(
            source,
            f"group {group_id} at byte {offset - _GROUP.size}",
            num_tokens,
            block_size,
            start,
            count,
            WireFormatError,
        )
        # A copy: the caller owns the totals, not a read-only view of the buffer.
        totals = np.frombuffer(data, dtype="<u8", count=count, offset=offset).astype(np.uint64)
        strong_totals = None
        if strong:
            at = offset + count * _TOTAL_BYTES
            strong_totals = np.frombuffer(data, dtype="<u8", count=count, offset=at).astype(
                np.uint64
            )
            if bool((strong_totals >= np.uint64(STRONG_PRIME)).any()):
                raise WireFormatError(
                    f"group {group_id}: a strong total at byte {at} or after is not below "
                    "2**64 - 59",
                    source,
                )
        groups.append(WireGroup(group_id, fingerprint, block_size, start, totals, strong_totals))
        seen.add(group_id)
        offset += needed
    if offset != size:
        raise WireFormatError(
            f"over-long: {size - offset} trailing bytes after the last group at byte {offset}",
            source,
        )
    return WireChecksums(num_tokens, numbering, groups)


def encode_wire_base64(checksums: WireChecksums) -> str:
    """The wire bytes as base64 text (a dump's ``received``, ``kv_transfer_params``).

    Args:
        checksums: The request's token count, position numbering and group totals.

    Returns:
        The base64 text of ``encode_wire(checksums)``.

    Raises:
        WireFormatError: As ``encode_wire`` raises it.

    """
    return base64.b64encode(encode_wire(checksums)).decode("ascii")


def decode_wire_base64(text: str, source: str = "<wire>") -> WireChecksums:
    """The producer checksums in base64 wire text.

    Args:
        text: The base64 text of KVC3 or KVC2 bytes.
        source: What the text is named in errors.

    Returns:
        The request's checksums, as ``decode_wire`` reads them.

    Raises:
        WireFormatError: The text is not valid base64, or its bytes are malformed.

    """
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError) as error:
        raise WireFormatError(f"invalid base64: {error}", source) from error
    return decode_wire(data, source)
