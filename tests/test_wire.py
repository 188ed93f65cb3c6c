"""Producer checksums on the wire: exact bytes, round trips, and strict rejection."""

from __future__ import annotations

import base64
import random
import struct

import numpy as np
import pytest

from kvaudit.errors import KvauditError, WireFormatError
from kvaudit.wire import (
    WireGroup,
    decode_wire,
    decode_wire_base64,
    encode_wire,
    encode_wire_base64,
)


def ref_encode(groups: list[tuple[int, int, int, int, list[int]]]) -> bytes:
    """The layout of checksum.md written value by value."""
    out = b"KVC1" + struct.pack("<H", len(groups))
    for group_id, fingerprint, block_size, start, totals in groups:
        out += struct.pack("<I", group_id) + struct.pack("<Q", fingerprint)
        out += struct.pack("<I", block_size) + struct.pack("<I", start)
        out += struct.pack("<I", len(totals))
        out += b"".join(struct.pack("<Q", value) for value in totals)
    return out


def random_groups(seed: int) -> list[tuple[int, int, int, int, list[int]]]:
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


def as_wire(groups: list[tuple[int, int, int, int, list[int]]]) -> list[WireGroup]:
    return [
        WireGroup(gid, fp, bs, start, np.array(totals, dtype=np.uint64))
        for gid, fp, bs, start, totals in groups
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_encode_matches_the_layout_and_round_trips(seed: int) -> None:
    groups = random_groups(seed)
    data = encode_wire(as_wire(groups))
    assert data == ref_encode(groups)
    decoded = decode_wire(data)
    assert [(g.group_id, g.fingerprint, g.block_size, g.start) for g in decoded] == [
        group[:4] for group in groups
    ]
    for wire, group in zip(decoded, groups, strict=True):
        assert wire.totals.dtype == np.uint64
        assert wire.totals.tolist() == group[4]
    assert decoded == as_wire(groups)


def test_empty_request_and_writable_totals() -> None:
    assert decode_wire(encode_wire([])) == []
    decoded = decode_wire(ref_encode([(0, 5, 16, 0, [1, 2])]))
    decoded[0].totals[0] = 9
    assert decoded[0].totals.tolist() == [9, 2]


def test_int64_totals_keep_their_bits() -> None:
    signed = np.array([-1, -(2**63), 5], dtype=np.int64)
    data = encode_wire([WireGroup(1, 2, 16, 0, signed)])
    assert decode_wire(data)[0].totals.tolist() == [2**64 - 1, 2**63, 5]


def test_base64_round_trip() -> None:
    groups = as_wire(random_groups(5))
    text = encode_wire_base64(groups)
    assert base64.b64decode(text) == ref_encode(random_groups(5))
    assert decode_wire_base64(text, "dump.safetensors") == groups


GOOD = ref_encode([(0, 2**63 + 5, 16, 2, [1, 2**64 - 1, 3]), (1, 7, 32, 0, [4])])


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "truncated"),
        (b"KVC1\x01", "truncated"),
        (b"KVC2" + GOOD[4:], "magic"),
        (b"ABCD\x00\x00", "magic"),
        (GOOD[:-1], "count"),
        (GOOD[:6], "truncated"),
        (GOOD[: 6 + 10], "truncated"),
        (GOOD + b"\x00", "over-long"),
        (GOOD + GOOD[6:], "over-long"),
        (b"KVC1" + struct.pack("<H", 3) + GOOD[6:], "truncated"),
        (ref_encode([(0, 1, 16, 0, [])])[:-4] + struct.pack("<I", 2**32 - 1), "count"),
        (ref_encode([(3, 1, 16, 0, [1]), (3, 2, 16, 0, [2])]), "group id 3 repeated"),
        (ref_encode([(0, 1, 0, 0, [1])]), "block size"),
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


def test_errors_name_the_byte_offset() -> None:
    with pytest.raises(WireFormatError, match="byte 6"):
        decode_wire(GOOD[:10])
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
        decode_wire_base64(base64.b64encode(b"hello world").decode(), "x")


@pytest.mark.parametrize(
    "group",
    [
        WireGroup(2**32, 0, 16, 0, np.zeros(1, dtype=np.uint64)),
        WireGroup(0, 2**64, 16, 0, np.zeros(1, dtype=np.uint64)),
        WireGroup(0, 0, -1, 0, np.zeros(1, dtype=np.uint64)),
        WireGroup(0, 0, 16, 2**32, np.zeros(1, dtype=np.uint64)),
        WireGroup(0, 0, 16, 0, np.zeros((2, 2), dtype=np.uint64)),
    ],
)
def test_encode_rejects_values_that_do_not_fit(group: WireGroup) -> None:
    with pytest.raises(WireFormatError):
        encode_wire([group])


def test_encode_rejects_what_decode_rejects() -> None:
    # A block size of 0 would write bytes no reader accepts.
    with pytest.raises(WireFormatError, match="block size 0"):
        encode_wire([WireGroup(0, 5, 0, 0, np.zeros(0, dtype=np.uint64))])


def test_encode_rejects_duplicate_groups() -> None:
    group = WireGroup(4, 0, 16, 0, np.zeros(1, dtype=np.uint64))
    with pytest.raises(WireFormatError, match="4"):
        encode_wire([group, group])
