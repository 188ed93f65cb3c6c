"""The record codec (``kvaudit.records.encoding`` and ``kvaudit.records.reading``): the
one encoder gives what a hand-written encoding of the same checksums gives (hex by
``format``, independent of the encoder); every writer (``kvaudit.formats``, the output
folder's ``checksum_line``) writes the codec's data; what the codec writes, the strict
decoder reads back to the same checksums, and encoding them again gives the same bytes."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from kvaudit import formats
from kvaudit.core.scheme import STRONG_PRIME, strong_add
from kvaudit.output_folders import LINE_FORMAT, LINE_FORMATS, checksum_line
from kvaudit.records import (
    GroupChecksums,
    LayerFacts,
    LayerSums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    WorkerSummary,
)
from kvaudit.records.encoding import (
    hex_list,
    hex_rows,
    record_to_json,
    request_line_to_json,
    worker_record_to_json,
)
from kvaudit.records.reading import RecordReader, request_line_from_json

EDGES = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]


def hexed(value: int) -> str:
    """16 lowercase hex digits, written here without the codec."""
    return format(value, "016x")


def make_group(seed: int, strong: bool, layer_sums: bool = False) -> GroupChecksums:
    """Three positions under replica keys (2, 0), (2, 1), (1, 0), values drawn over the
    whole 64 bits (the edges included)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**64, size=(3, 3), dtype=np.uint64, endpoint=False)
    values[0] = EDGES[3:6]
    residues = rng.integers(0, STRONG_PRIME, size=(3, 3), dtype=np.uint64) if strong else None
    group = GroupChecksums(16, 1, [(2, 0), (2, 1), (1, 0)], values, 0xFEDCBA9876543210 + seed)
    group.strong = residues
    if layer_sums:
        # The replica-0 totals split over two planes of layer 0 and one of layer 3.
        totals = group.totals()
        first = rng.integers(0, 2**64, size=3, dtype=np.uint64)
        second = rng.integers(0, 2**64, size=3, dtype=np.uint64)
        third = totals - first - second  # uint64 arithmetic wraps, as the sums do
        parts = [(0, "K"), (0, "V"), (3, "KV")]
        group.layer_sums = LayerSums(parts, np.stack([first, second, third], axis=1))
    return group


def hand_group(group: GroupChecksums) -> dict:
    """A record's group, encoded here by hand."""
    columns = [k for k, (_, index) in enumerate(group.replica_keys) if index == 0]
    totals = [sum(int(v) for v in row[columns]) % 2**64 for row in group.values]
    entry = {
        "block_size": group.block_size,
        "start": group.start,
        "fingerprint": hexed(group.fingerprint),
        "replica_keys": [list(key) for key in group.replica_keys],
        "values": [[hexed(int(v)) for v in row] for row in group.values],
        "totals": [hexed(t) for t in totals],
    }
    if group.strong is not None:
        strong_totals = [sum(int(v) for v in row[columns]) % STRONG_PRIME for row in group.strong]
        entry["strong"] = [[hexed(int(v)) for v in row] for row in group.strong]
        entry["strong_totals"] = [hexed(t) for t in strong_totals]
    if group.partial is not None:
        entry["partial"] = group.partial
    return entry


def test_hex_rows_write_each_value_as_format_does() -> None:
    values = np.array([EDGES, EDGES[::-1]], dtype=np.uint64)
    assert hex_rows(values) == [[hexed(v) for v in EDGES], [hexed(v) for v in EDGES[::-1]]]
    assert hex_list(values[0]) == [hexed(v) for v in EDGES]
    assert hex_rows(np.zeros((2, 0), dtype=np.uint64)) == [[], []]
    assert hex_rows(np.zeros((0, 3), dtype=np.uint64)) == []


def two_worker_record() -> Record:
    facts = {"model.layers.0.attn": LayerFacts(0, "FullAttentionSpec", "float8_e4m3fn", 64, 64)}
    workers = [
        WorkerSummary(WorkerInfo(0, 2, 0, 1, "producer", "vllm", "a"), {0: 7, 1: 9}, {2: "x"}),
        WorkerSummary(WorkerInfo(1, 2, 0, 1, "producer", "", "b"), {0: 7}, {}, facts),
    ]
    partial = make_group(2, strong=False)
    partial.partial = "worker b lacks the request"
    requests = {
        "z": RequestChecksums(60, {1: make_group(1, strong=True), 0: partial}),
        "a": RequestChecksums(0, {}),
    }
    return Record("request", workers, True, requests)


def test_a_record_is_encoded_as_by_hand_and_read_back() -> None:
    record = two_worker_record()
    data = record_to_json(record)
    assert list(data) == ["format", "positions", "workers", "complete", "requests"]
    assert data["format"] == "kvaudit.record/1" and data["complete"] is True
    assert list(data["requests"]) == ["z", "a"]  # the record's order
    z = record.requests["z"]
    assert data["requests"]["z"] == {
        "num_tokens": 60,
        "groups": {"0": hand_group(z.groups[0]), "1": hand_group(z.groups[1])},
    }
    assert list(data["requests"]["z"]["groups"]["1"]) == [
        "block_size", "start", "fingerprint", "replica_keys", "values", "totals",
        "strong", "strong_totals",
    ]  # fmt: skip
    assert data["workers"][0] == {
        "source": "a", "tp_rank": 0, "tp_size": 2, "pp_rank": 0, "pp_size": 1,
        "role": "producer", "fingerprints": {"0": hexed(7), "1": hexed(9)},
        "not_covered": {"2": "x"},
    }  # fmt: skip
    assert data["workers"][1]["layers"]["model.layers.0.attn"]["dtype"] == "float8_e4m3fn"
    # The formats' writer is the codec's; the strict reader reads it back whole.
    assert formats.record_to_json(record) == data
    text = formats.json_text(data)
    again = Record.from_json(json.loads(text), "r.json")
    assert formats.json_text(record_to_json(again)) == text


def test_a_worker_record_is_a_record_of_that_worker_alone() -> None:
    worker = WorkerInfo(0, 1, 0, 1, "consumer", "sglang", "live:/tmp/s")
    facts = {"l": LayerFacts(0, "FullAttentionSpec", "bfloat16", 8, 8)}
    record = WorkerRecord(
        worker, "block", {0: 5}, {}, {"r": RequestChecksums(60, {0: make_group(3, True)})}, facts
    )
    data = worker_record_to_json(record)
    # As the live agent has always sent it: the worker's layers' facts left out.
    assert "layers" not in data["workers"][0]
    assert data["complete"] is True and data["positions"] == "block"
    assert data["requests"]["r"]["groups"]["0"] == hand_group(record.requests["r"].groups[0])
    back = Record.from_json(json.loads(json.dumps(data)), "live")
    assert worker_record_to_json(
        WorkerRecord(worker, back.positions, {0: 5}, {}, back.requests)
    ) == json.loads(json.dumps(data))


@pytest.mark.parametrize("strong", [False, True])
@pytest.mark.parametrize("layer_sums", [False, True])
def test_a_checksum_line_is_the_codecs_and_reads_back_to_the_same_bytes(
    strong: bool, layer_sums: bool
) -> None:
    worker = WorkerInfo(1, 2, 0, 1, "consumer", "vllm", "ignored")
    group = make_group(4, strong, layer_sums)
    record = WorkerRecord(worker, "request", {0: group.fingerprint, 5: 3}, {5: "state"}, {})
    checksums = RequestChecksums(60, {0: group})
    text = checksum_line(record, checksums, "r\u00e9", "consumer", "0123456789abcdef")
    data = request_line_to_json(LINE_FORMAT, record, checksums, "r\u00e9", "consumer", None)
    data["prompt"] = "0123456789abcdef"
    assert text == json.dumps(data, separators=(",", ":"))
    # By hand: a line's group holds no fingerprint and no totals.
    expected_group = {
        key: value
        for key, value in hand_group(group).items()
        if key not in ("fingerprint", "totals", "strong_totals")
    }
    if layer_sums:
        raw = np.ascontiguousarray(group.layer_sums.values, dtype="<u8").tobytes()
        expected_group["layer_sums"] = {
            "parts": [[0, "K"], [0, "V"], [3, "KV"]],
            "sums": base64.b64encode(raw).decode(),
        }
    assert json.loads(text)["groups"] == {"0": expected_group}
    assert json.loads(text)["worker"] == {
        "tp_rank": 1, "tp_size": 2, "pp_rank": 0, "pp_size": 1, "engine": "vllm"
    }  # fmt: skip
    line = request_line_from_json(RecordReader("f: line 1"), json.loads(text), LINE_FORMATS)
    assert (line.request, line.role, line.num_tokens, line.prompt) == (
        "r\u00e9", "consumer", 60, "0123456789abcdef"
    )  # fmt: skip
    assert line.fingerprints == record.fingerprints and line.not_covered == record.not_covered
    back = WorkerRecord(line.worker, line.positions, line.fingerprints, line.not_covered, {})
    again = RequestChecksums(line.num_tokens, line.groups)
    assert checksum_line(back, again, line.request, line.role, line.prompt) == text


def test_strong_totals_are_sums_modulo_the_prime() -> None:
    """The strong totals the encoder writes are the replica-0 residues summed modulo
    ``2**64 - 59`` (``strong_add``), here two residues just below the prime."""
    group = GroupChecksums(4, 0, [(1, 0), (2, 0)], np.zeros((1, 2), dtype=np.uint64), 0)
    group.strong = np.array([[STRONG_PRIME - 1, STRONG_PRIME - 2]], dtype=np.uint64)
    want = int(strong_add(group.strong[:, 0], group.strong[:, 1])[0])
    assert want == (2 * STRONG_PRIME - 3) % STRONG_PRIME
    request = RequestChecksums(4, {0: group})
    entry = record_to_json(Record("request", [], True, {"r": request}))["requests"]["r"]
    assert entry["groups"]["0"]["strong_totals"] == [hexed(want)]
