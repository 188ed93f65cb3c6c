"""The strong lane wherever a record goes: record JSON (``checksum --format json``), a live
agent's worker record, an output folder's checksum lines and the wire, each written and
read back with the reference's residues (``helpers.reference.strong_block_checksums``);
records without it (the seed engine's, an older kvaudit's) still read, and compare by the
seed lane with a note; a malformed strong value is one line naming the file, exit 2.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import engine_runs as er
from helpers import kvbuild as kb
from helpers import reference as ref
from helpers.output_folders import MODEL, TOKENS, write_folder

from kvaudit.cli import main
from kvaudit.compare import compare_records
from kvaudit.core.errors import WireFormatError
from kvaudit.core.scheme import STRONG_PRIME, to_hex
from kvaudit.formats import json_text, record_to_json
from kvaudit.output_folders import read_output
from kvaudit.records import Record
from kvaudit.records.encoding import worker_record_to_json
from kvaudit.records.wire import WireChecksums, decode_wire, encode_wire

SEED_NOTE = "compared by the seed lane only"


def want_strong(rid: str) -> list[int]:
    """The request's per-position strong totals, from the reference implementation."""
    index = list(TOKENS).index(rid)
    group = kb.reference_group(MODEL, 0, kb.make_request(MODEL, TOKENS[rid], index, 1), 1)
    return ref.strong_block_checksums(group, TOKENS[rid])[1]


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(arg) for arg in args])
    return result.exit_code, result.output


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_folder(tmp_path / "out", "producer")
    return tmp_path / "out"


def lines_file(folder: Path) -> Path:
    return folder / "workers" / "pp0-tp0" / "checksums.jsonl"


def assert_strong(record: Record) -> None:
    """Every request of ``TOKENS`` carries the reference's strong lane."""
    assert sorted(record.requests) == sorted(TOKENS)
    for rid in TOKENS:
        totals = record.requests[rid].groups[0].strong_totals()
        assert totals is not None, rid
        assert totals.tolist() == want_strong(rid), rid


def test_output_folder_lines_carry_the_strong_lane(folder: Path) -> None:
    line = json.loads(lines_file(folder).read_text().splitlines()[0])
    group = line["groups"]["0"]
    assert len(group["strong"]) == len(group["values"])
    assert_strong(read_output(folder).record)


def test_record_json_round_trip(folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    status, output = run("checksum", folder, "--format", "json", "-o", path)
    assert status == 0, output
    data = json.loads(path.read_text())
    group = data["requests"]["r1"]["groups"]["0"]
    assert group["strong_totals"] == [to_hex(v) for v in want_strong("r1")]
    record = Record.from_json(data, str(path))
    assert_strong(record)
    again = json.loads(json_text(record_to_json(record)))
    assert again == data


def test_live_worker_record_round_trip() -> None:
    requests = {rid: kb.make_request(MODEL, n, i, 1) for i, (rid, n) in enumerate(TOKENS.items())}
    [worker] = kb.build_engine(MODEL, requests, kb.Engine())
    [summer] = er.checksummers([worker], "producer")
    computed = summer.checksum(er.request_blocks(worker), "request")
    data = json.loads(json.dumps(worker_record_to_json(computed)))
    assert_strong(Record.from_json(data, "live"))


def test_wire_round_trip_and_strict_strong_totals(folder: Path) -> None:
    record = read_output(folder).record
    sent = record.requests["r1"]
    wire = WireChecksums(sent.num_tokens, "request", [sent.groups[0].to_wire(0)])
    data = encode_wire(wire)
    decoded = decode_wire(data)
    assert decoded == wire and decoded.groups[0].strong.tolist() == want_strong("r1")
    # The last 8 bytes are the group's last strong total: one not below the prime.
    bad = data[:-8] + STRONG_PRIME.to_bytes(8, "little")
    with pytest.raises(WireFormatError):
        decode_wire(bad)


def strip_strong(data: dict) -> dict:
    """The record as the seed engine writes it: no strong lane."""
    for request in data["requests"].values():
        for group in request["groups"].values():
            group.pop("strong"), group.pop("strong_totals")
    return data


def test_a_record_without_the_strong_lane_reads_and_compares_by_the_seed_lane(
    folder: Path, tmp_path: Path
) -> None:
    full = tmp_path / "full.json"
    assert run("checksum", folder, "--format", "json", "-o", full)[0] == 0
    seed = tmp_path / "seed.json"
    seed.write_text(json.dumps(strip_strong(json.loads(full.read_text()))))
    record = Record.from_json(json.loads(seed.read_text()), str(seed))
    assert all(g.strong is None for r in record.requests.values() for g in r.groups.values())
    report = compare_records(record, Record.from_json(json.loads(full.read_text()), str(full)))
    assert report.ok
    assert report.warnings == [f"{SEED_NOTE}: the producer carries no strong lane"]
    status, output = run("diff", full, seed, "-q")
    assert status == 0, output
    assert f"{SEED_NOTE}: the consumer carries no strong lane" in output
    status, output = run("diff", full, seed, "--format", "junit", "-q")
    assert f"<system-out>{SEED_NOTE}: the consumer carries no strong lane</system-out>" in output


def group_of(data: dict) -> dict:
    return data["requests"]["r1"]["groups"]["0"]


def change_strong(row: int, value: object) -> Callable[[dict], None]:
    def change(group: dict) -> None:
        group["strong"][row][0] = value

    return change


# Each change to a group's strong lane and a word of the one-line error it gives.
RECORD_CHANGES = [
    ("not hex", change_strong(0, "zz"), "expected 16 lowercase hex digits"),
    ("the prime", change_strong(1, to_hex(STRONG_PRIME)), "not a residue modulo 2**64 - 59"),
    ("all ones", change_strong(0, "f" * 16), "not a residue modulo 2**64 - 59"),
    ("a row short", lambda g: g["strong"].pop(), "rows (one per position)"),
    ("a value more", lambda g: g["strong"][0].append("0" * 16), "one per replica key"),
    ("a list of hex", lambda g: g.__setitem__("strong", "00"), "expected a list"),
    ("no totals", lambda g: g.pop("strong_totals"), "strong_totals: missing"),
    ("no rows", lambda g: g.pop("strong"), "strong: missing"),
    ("a wrong total", lambda g: g["strong_totals"].__setitem__(0, "0" * 16), "is not the sum"),
]


@pytest.mark.parametrize(
    ("what", "change", "words"), RECORD_CHANGES, ids=[c[0] for c in RECORD_CHANGES]
)
def test_a_malformed_strong_lane_in_a_record_is_one_line_exit_2(
    folder: Path, tmp_path: Path, what: str, change: Callable[[dict], None], words: str
) -> None:
    good = tmp_path / "good.json"
    assert run("checksum", folder, "--format", "json", "-o", good)[0] == 0
    data = json.loads(good.read_text())
    change(group_of(data))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    for args in (("diff", good, bad), ("verify", good, "--against", bad)):
        status, output = run(*args, "-q")
        assert status == 2, output
        [message] = output.splitlines()
        assert message.startswith(f"kvaudit: error: {bad}") and words in message, message


LINE_CHANGES = [
    ("not hex", change_strong(0, "0x12"), "expected 16 lowercase hex digits"),
    ("the prime", change_strong(0, to_hex(STRONG_PRIME + 5)), "not a residue"),
    ("a row more", lambda g: g["strong"].append(["0" * 16]), "rows (one per position)"),
    ("a value short", lambda g: g["strong"][0].pop(), "one per replica key"),
]


@pytest.mark.parametrize(
    ("what", "change", "words"), LINE_CHANGES, ids=[c[0] for c in LINE_CHANGES]
)
def test_a_malformed_strong_lane_in_a_line_is_one_line_exit_2(
    folder: Path, what: str, change: Callable[[dict], None], words: str
) -> None:
    path = lines_file(folder)
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    change(lines[1]["groups"]["0"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    status, output = run("checksum", folder)
    assert status == 2, output
    [message] = output.splitlines()
    assert message.startswith(f"kvaudit: error: {path}: line 2: ") and words in message, message


def test_a_line_without_the_strong_lane_still_reads(folder: Path) -> None:
    path = lines_file(folder)
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    for line in lines:
        for group in line["groups"].values():
            group.pop("strong")
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    record = read_output(folder).record
    assert all(g.strong is None for r in record.requests.values() for g in r.groups.values())
    totals = record.requests["r1"].groups[0].totals()
    assert isinstance(totals, np.ndarray) and len(totals) == len(want_strong("r1"))
