"""Producer checksums on the wire (KVC2): exact bytes, round trips, and strict rejection."""

from __future__ import annotations

import base64
import random
import struct

import numpy as np
import pytest

from kvaudit.core.errors import KvauditError, WireFormatError
from kvaudit.records import GroupChecksums, RequestChecksums
from kvaudit.records.wire import (
    WireChecksums,
    WireGroup,
    decode_wire,
    decode_wire_base64,
    encode_wire,
    encode_wire_base64,
)

Group = tuple[int, int, int, int, list[int]]


def ref_encode(num_tokens: int, numbering: int, groups: list[Group]) -> bytes:
    """The KVC2 layout of checksum.md written value by value."""
    out = b"KVC2" + struct.pack("<Q", num_tokens) + struct.pack("<B", numbering)
    out += struct.pack("<H", len(groups))
    for group_id, fingerprint, block_size, start, totals in groups:
        out += struct.pack("<I", group_id) + struct.pack("<Q", fingerprint)
        out += struct.pack("<I", block_size) + struct.pack("<I", start)
        out += struct.pack("<I", len(totals))
        out += b"".join(struct.pack("<Q", value) for value in totals)
    return out


def random_groups(seed: int) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for group_id in rng.sample(range(1000), 4):
        count = rng.choice([0, 1, 5, 33])
        totals = [rng.getrandbits(64) for _ in range(count)]
        # Values with the top bit set must survive as uint64.
        totals[:2] = [2**64 - 1, 2**63][: len(totals[:2])]
        groups.append(
            (group_id, rng.getrandbits(64), rng.choice([16, 64]), rng.randrange(50), totals)
        )
    return groups


def as_wire(num_tokens: int, numbering: str, groups: list[Group]) -> WireChecksums:
    return WireChecksums(
        num_tokens,
        numbering,
        [
            WireGroup(gid, fp, bs, start, np.array(totals, dtype=np.uint64))
            for gid, fp, bs, start, totals in groups
        ],
    )


@pytest.mark.parametrize(
    ("seed", "num_tokens", "numbering", "code"),
    # Every random group starts before token 50 * 64; 2**40 is the most tokens decoded.
    [(0, 3201, "request", 0), (1, 2**40, "block", 1), (2, 4096, "request", 0)],
)
def test_encode_matches_the_layout_and_round_trips(
    seed: int, num_tokens: int, numbering: str, code: int
) -> None:
    groups = random_groups(seed)
    data = encode_wire(as_wire(num_tokens, numbering, groups))
    assert data == ref_encode(num_tokens, code, groups)
    decoded = decode_wire(data)
    assert decoded.num_tokens == num_tokens
    assert decoded.numbering == numbering
    assert [(g.group_id, g.fingerprint, g.block_size, g.start) for g in decoded.groups] == [
        group[:4] for group in groups
    ]
    for wire, group in zip(decoded.groups, groups, strict=True):
        assert wire.totals.dtype == np.uint64
        assert wire.totals.tolist() == group[4]
    assert decoded == as_wire(num_tokens, numbering, groups)


def test_empty_request_and_writable_totals() -> None:
    empty = decode_wire(encode_wire(WireChecksums(0, "block", [])))
    assert (empty.num_tokens, empty.numbering, empty.groups) == (0, "block", [])
    decoded = decode_wire(ref_encode(7, 0, [(0, 5, 16, 0, [1, 2])]))
    decoded.groups[0].totals[0] = 9
    assert decoded.groups[0].totals.tolist() == [9, 2]


def test_int64_totals_keep_their_bits() -> None:
    signed = np.array([-1, -(2**63), 5], dtype=np.int64)
    data = encode_wire(WireChecksums(40, "request", [WireGroup(1, 2, 16, 0, signed)]))
    assert decode_wire(data).groups[0].totals.tolist() == [2**64 - 1, 2**63, 5]


def test_a_records_request_goes_on_the_wire_with_its_tokens_and_numbering() -> None:
    values = np.array([[1, 2, 100], [3, 4, 200]], dtype=np.uint64)
    keys = [(1, 0), (2, 0), (2, 1)]
    request = RequestChecksums(
        21, {5: GroupChecksums(16, 1, keys, values, 9), 2: GroupChecksums(32, 0, [(1, 0)],
                                                                        values[:1, :1], 8)}
    )  # fmt: skip
    data = encode_wire(request.to_wire("block"))
    # Totals sum the replica-0 columns only: 1+2 and 3+4.
    assert data == ref_encode(21, 1, [(2, 8, 32, 0, [1]), (5, 9, 16, 1, [3, 7])])


def test_base64_round_trip() -> None:
    groups = random_groups(5)
    text = encode_wire_base64(as_wire(3333, "block", groups))
    assert base64.b64decode(text) == ref_encode(3333, 1, groups)
    assert decode_wire_base64(text, "dump.safetensors") == as_wire(3333, "block", groups)


GOOD = ref_encode(40, 0, [(0, 2**63 + 5, 16, 2, [1, 2**64 - 1, 3]), (1, 7, 32, 0, [4])])
HEADER = 4 + 8 + 1 + 2


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "truncated"),
        (b"KVC2\x01", "truncated"),
        (GOOD[: HEADER - 1], "truncated"),
        (b"KVC9" + GOOD[4:], "magic"),
        (b"ABCD\x00\x00", "magic"),
        (b"AB", "magic"),
        (GOOD[:12] + b"\x02" + GOOD[13:], "unknown numbering 2"),
        (GOOD[:12] + b"\xff" + GOOD[13:], "unknown numbering 255"),
        (GOOD[:-1], "count"),
        (GOOD[:HEADER], "truncated"),
        (GOOD[: HEADER + 10], "truncated"),
        (GOOD + b"\x00", "over-long"),
        (GOOD + GOOD[HEADER:], "over-long"),
        (GOOD[:13] + struct.pack("<H", 3) + GOOD[HEADER:], "truncated"),
        (ref_encode(1, 0, [(0, 1, 16, 0, [])])[:-4] + struct.pack("<I", 2**32 - 1), "count"),
        (ref_encode(1, 0, [(3, 1, 16, 0, [1]), (3, 2, 16, 0, [2])]), "group id 3 repeated"),
        (ref_encode(1, 0, [(0, 1, 0, 0, [1])]), "block size"),
    ],
)
def test_malformed_buffers_are_rejected(data: bytes, words: str) -> None:
    with pytest.raises(WireFormatError) as caught:
        decode_wire(data, "consumer/rank0.safetensors")
    message = str(caught.value)
    assert isinstance(caught.value, KvauditError)
    assert "\n" not in message
    assert message.startswith("consumer/rank0.safetensors: ")
    assert words in message


def kvc1(groups: list[Group]) -> bytes:
    """The retired KVC1 layout: no token count, no numbering."""
    out = b"KVC1" + struct.pack("<H", len(groups))
    for group_id, fingerprint, block_size, start, totals in groups:
        out += struct.pack("<IQIII", group_id, fingerprint, block_size, start, len(totals))
        out += struct.pack(f"<{len(totals)}Q", *totals)
    return out


@pytest.mark.parametrize("data", [kvc1([(0, 5, 16, 0, [1, 2])]), kvc1([]), b"KVC1"])
def test_kvc1_is_refused_naming_kvc2(data: bytes) -> None:
    with pytest.raises(WireFormatError) as caught:
        decode_wire(data, "req-1")
    message = str(caught.value)
    assert message.startswith("req-1: ")
    assert "KVC1" in message and "KVC2" in message and "retired" in message
    assert "\n" not in message


def test_errors_name_the_byte_offset() -> None:
    with pytest.raises(WireFormatError, match=f"byte {HEADER}"):
        decode_wire(GOOD[: HEADER + 10])
    with pytest.raises(WireFormatError, match=f"byte {len(GOOD)}"):
        decode_wire(GOOD + b"\x01\x02")


@pytest.mark.parametrize("text", ["not base64!", "QUJD=", "QUJDRA=", "Ã©"])
def test_invalid_base64_is_rejected(text: str) -> None:
    with pytest.raises(WireFormatError) as caught:
        decode_wire_base64(text, "req-7.received")
    assert str(caught.value).startswith("req-7.received: ")
    assert "\n" not in str(caught.value)


def test_valid_base64_of_bad_bytes_is_rejected() -> None:
    with pytest.raises(WireFormatError, match="magic"):
        decode_wire_base64(base64.b64encode(b"hello world, long").decode(), "x")


def one(group: WireGroup, num_tokens: int = 16, numbering: str = "request") -> WireChecksums:
    return WireChecksums(num_tokens, numbering, [group])


ZERO = np.zeros(1, dtype=np.uint64)


@pytest.mark.parametrize(
    "checksums",
    [
        one(WireGroup(2**32, 0, 16, 0, ZERO)),
        one(WireGroup(0, 2**64, 16, 0, ZERO)),
        one(WireGroup(0, 0, -1, 0, ZERO)),
        one(WireGroup(0, 0, 16, 2**32, ZERO)),
        one(WireGroup(0, 0, 16, 0, np.zeros((2, 2), dtype=np.uint64))),
        one(WireGroup(0, 0, 16, 0, ZERO), num_tokens=2**64),
        one(WireGroup(0, 0, 16, 0, ZERO), num_tokens=-1),
        one(WireGroup(0, 0, 16, 0, ZERO), numbering="tokens"),
    ],
)
def test_encode_rejects_values_that_do_not_fit(checksums: WireChecksums) -> None:
    with pytest.raises(WireFormatError):
        encode_wire(checksums)


def test_encode_rejects_what_decode_rejects() -> None:
    # A block size of 0 would write bytes no reader accepts.
    with pytest.raises(WireFormatError, match="block size 0"):
        encode_wire(one(WireGroup(0, 5, 0, 0, np.zeros(0, dtype=np.uint64))))


def test_encode_rejects_duplicate_groups() -> None:
    group = WireGroup(4, 0, 16, 0, ZERO)
    with pytest.raises(WireFormatError, match="4"):
        encode_wire(WireChecksums(16, "request", [group, group]))
