"""An output folder's checksum line is decoded by the record's strict decoder: each defect
of a group refused in a record file (``Record.from_json``) is refused in a line, with the
same problem named at the same key path under the group, and a line is never read
loosely (a group whose fingerprint the line lacks is refused, as a record's group without
its ``fingerprint`` is). Folders are written by kvaudit's own writers
(``helpers.output_folders``)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.output_folders import write_folder

from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.core.scheme import STRONG_PRIME
from kvaudit.formats import json_text, record_to_json
from kvaudit.output_folders import read_output
from kvaudit.records import Record

Change = Callable[[dict], None]


def set_key(key: str, value: object) -> Change:
    def change(groups: dict) -> None:
        groups["0"][key] = value

    return change


def set_row(key: str, row: int, value: object) -> Change:
    def change(groups: dict) -> None:
        groups["0"][key][row] = value

    return change


def rename_group(groups: dict) -> None:
    groups["00"] = groups.pop("0")


def drop_key(key: str) -> Change:
    return lambda groups: groups["0"].pop(key)


# Each defect of group "0" and the words of the problem both readers give.
DEFECTS = [
    ("block size 0", set_key("block_size", 0), "block_size: expected an integer from 1"),
    ("block size text", set_key("block_size", "16"), "block_size: expected an integer"),
    ("start -1", set_key("start", -1), "start: expected an integer from 0"),
    ("start past the tokens", set_key("start", 40), "is beyond the request's"),
    ("replica index past", set_key("replica_keys", [[1, 1]]), "replica index 1 is not below 1"),
    ("replica key twice", set_key("replica_keys", [[1, 0], [1, 0]]), "repeated"),
    ("no replica key", set_key("replica_keys", []), "expected at least one replica key"),
    ("row too wide", set_row("values", 0, ["0" * 16, "0" * 16]), "one per replica key"),
    ("value upper case", set_row("values", 0, ["ABCDEF0123456789"]), "16 lowercase hex"),
    ("value a number", set_row("values", 0, [7]), "16 lowercase hex"),
    ("strong not a residue", set_row("strong", 0, [f"{STRONG_PRIME:016x}"]), "not a residue"),
    ("strong row short", set_row("strong", 0, []), "one per replica key"),
    ("strong rows missing", lambda g: g["0"]["strong"].pop(), "rows (one per position)"),
    ("an unknown key", set_key("extra", 1), "unknown key"),
    ("values missing", drop_key("values"), "values: missing"),
    ("group id 00", rename_group, "expected a group id"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("same") / "out"
    write_folder(path, "producer")
    return path


def lines_file(folder: Path) -> Path:
    return folder / "workers" / "pp0-tp0" / "checksums.jsonl"


def problem(message: str) -> str:
    """What a message says from group "0" on (the key paths above it differ: a record's
    ``requests["r1"].groups``, a line's ``groups``)."""
    found = re.search(r'groups(\["0+"\].*)', message)
    assert found is not None, message
    return found.group(1)


def record_error(folder: Path, change: Change) -> str:
    data = json.loads(json_text(record_to_json(read_output(folder).record)))
    change(data["requests"]["r1"]["groups"])
    with pytest.raises(KvauditError) as caught:
        Record.from_json(data, "r.json")
    return caught.value.message


def line_error(folder: Path, change: Change, tmp_path: Path) -> str:
    copy_of = tmp_path / "out"
    write_folder(copy_of, "producer")
    path = lines_file(copy_of)
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    [index] = [i for i, line in enumerate(lines) if line["request"] == "r1"]
    change(lines[index]["groups"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(KvauditError) as caught:
        read_output(copy_of)
    assert caught.value.source == f"{path}: line {index + 1}"
    return caught.value.message


@pytest.mark.parametrize(("what", "change", "words"), DEFECTS, ids=[d[0] for d in DEFECTS])
def test_a_group_defect_is_refused_as_in_a_record(
    folder: Path, tmp_path: Path, what: str, change: Change, words: str
) -> None:
    by_record = record_error(folder, change)
    by_line = line_error(folder, change, tmp_path)
    assert words in by_record and words in by_line, (by_record, by_line)
    assert problem(by_line) == problem(by_record)


def test_a_group_without_its_fingerprint_is_refused_as_in_a_record(
    folder: Path, tmp_path: Path
) -> None:
    """A record's group without ``fingerprint`` is refused; so is a line whose
    ``fingerprints`` lack one of its groups (read before as fingerprint 0)."""
    assert 'groups["0"].fingerprint: missing' in record_error(folder, drop_key("fingerprint"))
    copy_of = tmp_path / "out"
    write_folder(copy_of, "producer")
    path = lines_file(copy_of)
    lines = [json.loads(text) for text in path.read_text().splitlines()]
    lines[1]["fingerprints"] = {}
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["checksum", str(copy_of)])
    assert result.exit_code == 2, result.output
    [message] = result.output.splitlines()
    assert message == (
        f'kvaudit: error: {path}: line 2: groups["0"]: the line\'s fingerprints lack group 0'
    )


def test_the_folder_reads_back_to_the_record_it_encodes(folder: Path) -> None:
    """The folder's record, written by the record codec and read by its strict decoder,
    is the record its own JSON reads back to."""
    record = read_output(folder).record
    text = json_text(record_to_json(record))
    assert json_text(record_to_json(Record.from_json(json.loads(text), "r.json"))) == text
