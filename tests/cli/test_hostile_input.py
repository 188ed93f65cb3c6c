"""Hostile input (issue 9): sizes that would allocate without bound, parser tracebacks,
positions that would wrap silently, and mixed roles in one set. Each is refused before
anything large is allocated, as one line naming the file and key, exit status 2."""

from __future__ import annotations

import copy
import json
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from helpers.fuzz_inputs import DESCRIPTION, REQUESTS, Seeds, safetensors_bytes, seed_tensors

from kvaudit.checksum.checksummer import Checksummer
from kvaudit.cli import main
from kvaudit.compare import compare_records
from kvaudit.core.errors import DescriptionError, KvauditError, WireFormatError
from kvaudit.core.validation import (
    MAX_BLOCK_SIZE,
    MAX_DEPTH,
    MAX_TOKENS,
    MAX_WORKERS,
    worker_layout,
)
from kvaudit.description import load_description, parse_description
from kvaudit.dumps import open_dump, open_dump_set, write_dump
from kvaudit.records import GroupChecksums, Record, RequestChecksums, WorkerInfo, WorkerSummary
from kvaudit.records.wire import WireChecksums, WireGroup, decode_wire, encode_wire
from kvaudit.views.inputs import RequestBlocks

MIB = 1 << 20


@pytest.fixture
def seeds(tmp_path: Path) -> Seeds:
    return Seeds(tmp_path)


def run(*args: object) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def assert_one_line_error(result: Result, *names: str) -> str:
    """Exit 2, nothing on stdout, one ``kvaudit: error:`` line naming ``names``."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvaudit: error: "), result.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@contextmanager
def bounded(megabytes: int = 20, seconds: float = 5.0) -> Iterator[None]:
    """Fail unless the block allocates at most ``megabytes`` (Python and numpy) and
    finishes within ``seconds``."""
    tracemalloc.start()
    began = time.perf_counter()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= megabytes * MIB, f"peak {peak / MIB:.0f} MiB"
    assert time.perf_counter() - began <= seconds


def with_metadata(seeds: Seeds, path: Path, **changes: object) -> Path:
    """The seed dump with metadata values replaced (dicts and lists as JSON, text as is)."""
    header = copy.deepcopy(seeds.header)
    for key, value in changes.items():
        name = "kvaudit." + key
        header["__metadata__"][name] = value if isinstance(value, str) else json.dumps(value)
    path.write_bytes(safetensors_bytes(header, seeds.payload))
    return path


def requests_with(**request: object) -> dict:
    return {"r": {"num_tokens": 10, "groups": {"0": [0, [1, 2, 3]]}, **request}}


def record_file(seeds: Seeds, path: Path, change: Callable[[dict], None]) -> Path:
    data = copy.deepcopy(seeds.record_json)
    change(data)
    path.write_text(json.dumps(data))
    return path


def group_of(data: dict) -> dict:
    return data["requests"]["r"]["groups"]["0"]


def worker_of(data: dict) -> dict:
    return data["workers"][0]


# Class 2: memory or time without bound from a few bytes.


@pytest.mark.parametrize("size", ["tp_size", "pp_size"])
@pytest.mark.parametrize("value", [10**12, MAX_WORKERS + 1])
def test_a_huge_engine_layout_is_refused_before_listing_missing_workers(
    seeds: Seeds, tmp_path: Path, size: str, value: int
) -> None:
    worker = json.loads(seeds.header["__metadata__"]["kvaudit.worker"])
    dump = with_metadata(seeds, tmp_path / "d.safetensors", worker={**worker, size: value})
    with bounded():
        line = assert_one_line_error(run("inspect", dump), "d.safetensors", size)
    assert str(MAX_WORKERS) in line

    record = record_file(seeds, tmp_path / "r.json", lambda d: worker_of(d).update({size: value}))
    with bounded():
        assert_one_line_error(run("checksum", record), "r.json", size)


def test_the_most_workers_read_is_a_layout_of_max_workers() -> None:
    workers = [WorkerInfo(0, 256, 0, 256, "producer", source="w")]
    assert len(worker_layout(workers)) == MAX_WORKERS - 1
    with pytest.raises(KvauditError, match="tp_size 257 x pp_size 256"):
        worker_layout([WorkerInfo(0, 257, 0, 256, "producer", source="w")])


def test_a_record_block_size_past_the_limit_is_refused(seeds: Seeds, tmp_path: Path) -> None:
    record = record_file(seeds, tmp_path / "r.json", lambda d: group_of(d).update(block_size=2**31))
    with bounded():
        assert_one_line_error(run("checksum", record), "r.json", "block_size", str(MAX_BLOCK_SIZE))


def test_comparing_block_sizes_far_apart_takes_memory_in_the_rows_held() -> None:
    """A producer of one 2**24-token block against a consumer of 1-token blocks: coarsening
    allocates per row held, not per token of the coarse block."""
    fingerprint = 7
    values = np.arange(1, 11, dtype=np.uint64).reshape(10, 1)

    def record(block_size: int, rows: np.ndarray) -> Record:
        group = GroupChecksums(block_size, 0, [(1, 0)], rows, fingerprint)
        worker = [WorkerSummary(WorkerInfo(source=f"b{block_size}"))]
        return Record("request", worker, True, {"r": RequestChecksums(10, {0: group})})

    producer = record(MAX_BLOCK_SIZE, np.array([[55]], dtype=np.uint64))
    with bounded(megabytes=5):
        report = compare_records(producer, record(1, values))
    group = report.requests["r"][0]
    assert (group.compared, group.mismatched_positions, group.unverified) == (1, [], None)
    broken = record(1, values + np.uint64(1))
    assert compare_records(producer, broken).requests["r"][0].mismatched_positions == [0]


def test_a_wire_block_size_past_the_limit_is_refused() -> None:
    data = encode_wire(WireChecksums(40, "request", [WireGroup(3, 1, 16, 0, np.ones(2))]))
    oversized = bytearray(data)
    struct.pack_into("<I", oversized, 15 + 4 + 8, 2**31)  # the group's block_size
    with bounded(), pytest.raises(WireFormatError, match=r"group 3 .*block size 2147483648"):
        decode_wire(bytes(oversized), "rx")


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    text = 'a0: &a0 ["lol"]\n'
    for level in range(1, levels):
        text += f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]\n"
    return text


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(path.read_bytes()) < 1000
    with bounded(), pytest.raises(DescriptionError, match="expands to more than 100000"):
        load_description(path)
    with bounded():
        assert_one_line_error(run("inspect", "--config", path, tmp_path), "bomb.yaml")


def test_yaml_aliases_within_the_bound_still_work(tmp_path: Path) -> None:
    spec = DESCRIPTION["groups"][0]["spec"]
    text = (
        "kvaudit: 1\nnum_blocks: 4\ngroups:\n"
        f"  - spec: &spec {json.dumps(spec)}\n    layers: [a.0.attn]\n"
        "  - {id: 1, spec: *spec, layers: [b.1.attn]}\n"
    )
    path = tmp_path / "shared.yaml"
    path.write_text(text)
    description = load_description(path)
    assert [group.spec.block_size for group in description.groups] == [4, 4]


def test_a_recursive_alias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("kvaudit: &a [1, *a]\n")
    with pytest.raises(DescriptionError, match=r"line 1: .*alias inside the value it names"):
        load_description(path)


@pytest.mark.parametrize("length", [100_000_001, 6 << 30, 2**64 - 1])
def test_a_header_length_over_100_mb_is_refused_unread(tmp_path: Path, length: int) -> None:
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", length) + b"{}")
        file.truncate(200 * MIB)  # sparse: the claimed header would fit in a large file
    with bounded(megabytes=5):
        line = assert_one_line_error(run("inspect", path), "big.safetensors")
    assert f"header length is {length} bytes" in line and "100000000" in line


# Class 4: parser tracebacks, each now one line naming the file and key.


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [MAX_DEPTH + 2, 100_000])
def test_deep_json_anywhere_is_one_line(seeds: Seeds, tmp_path: Path, depth: int) -> None:
    header = json.dumps({"x": "PLACE"}).replace('"PLACE"', deep_json(depth)).encode()
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    line = assert_one_line_error(run("inspect", path), "h.safetensors", "safetensors header")
    assert f"nested more than {MAX_DEPTH} levels deep" in line

    dump = with_metadata(seeds, tmp_path / "m.safetensors", requests=deep_json(depth))
    assert_one_line_error(run("inspect", dump), "m.safetensors", "kvaudit.requests", "nested")

    record = record_file(seeds, tmp_path / "r.json", lambda d: group_of(d).update(values="PLACE"))
    record.write_text(record.read_text().replace('"PLACE"', deep_json(depth)))
    assert_one_line_error(run("checksum", record), "r.json", "nested")


def test_deep_yaml_is_one_line(tmp_path: Path) -> None:
    flow = tmp_path / "flow.yaml"
    flow.write_text("kvaudit: " + deep_json(100_000) + "\n")
    block = tmp_path / "block.yaml"
    block.write_text("kvaudit:\n" + "".join(" " * i + "-\n" for i in range(1, 500)))
    for path in (flow, block):
        with bounded(seconds=2):
            line = assert_one_line_error(run("inspect", "--config", path, tmp_path), path.name)
        assert f"nested more than {MAX_DEPTH} levels deep" in line


@pytest.mark.parametrize("value", [2**63, 2**64 + 3, 10**30])
@pytest.mark.parametrize(
    ("key", "place"),
    [
        ("num_tokens", lambda v: requests_with(num_tokens=v)),
        ("start", lambda v: requests_with(groups={"0": [v, [1]]})),
    ],
)
def test_dump_integers_past_64_bits_are_one_line(
    seeds: Seeds, tmp_path: Path, value: int, key: str, place: Callable[[int], dict]
) -> None:
    dump = with_metadata(seeds, tmp_path / "d.safetensors", requests=place(value))
    line = assert_one_line_error(run("checksum", dump), "d.safetensors", "request 'r'")
    assert key.replace("_", " ") in line.replace("_", " ")


@pytest.mark.parametrize("value", [2**63, 2**64 + 3])
@pytest.mark.parametrize("key", ["num_tokens", "start", "block_size", "tp_rank", "replicas"])
def test_record_integers_past_64_bits_are_one_line(
    seeds: Seeds, tmp_path: Path, value: int, key: str
) -> None:
    def change(data: dict) -> None:
        if key == "num_tokens":
            data["requests"]["r"]["num_tokens"] = value
        elif key == "tp_rank":
            worker_of(data)["tp_rank"] = value
        elif key == "replicas":
            group_of(data)["replica_keys"] = [[value, 0]]
        else:
            group_of(data)[key] = value

    record = record_file(seeds, tmp_path / "r.json", change)
    expected = "replica_keys" if key == "replicas" else key
    assert_one_line_error(run("checksum", record), "r.json", expected)


def test_wire_token_counts_past_the_limit_are_refused() -> None:
    for num_tokens in (MAX_TOKENS + 1, 2**63, 2**64 - 1):
        data = bytearray(encode_wire(WireChecksums(40, "request", [])))
        struct.pack_into("<Q", data, 4, num_tokens)
        with pytest.raises(WireFormatError, match=f"num_tokens {num_tokens} at byte 4"):
            decode_wire(bytes(data), "rx")


def test_lone_surrogates_are_refused_where_they_are_read(seeds: Seeds, tmp_path: Path) -> None:
    requests = json.loads(seeds.header["__metadata__"]["kvaudit.requests"])
    requests["r\ud800"] = requests.pop("r")
    dump = with_metadata(seeds, tmp_path / "d.safetensors", requests=requests)
    line = assert_one_line_error(run("checksum", dump), "d.safetensors", "kvaudit.requests")
    assert "lone surrogate U+D800" in line

    record = tmp_path / "r.json"
    record.write_text(json.dumps(seeds.record_json).replace('"r"', '"r\\udfff"'))
    line = assert_one_line_error(run("checksum", record), "r.json", "requests")
    assert "lone surrogate U+DFFF" in line

    worker = {**json.loads(seeds.header["__metadata__"]["kvaudit.worker"]), "engine": "\udc80"}
    engine = with_metadata(seeds, tmp_path / "e.safetensors", worker=worker)
    assert_one_line_error(run("inspect", engine), "e.safetensors", "engine", "U+DC80")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("!!int x", "cannot read 'x' as !!int"),
        ("!!timestamp x", "cannot read 'x' as !!timestamp"),
        ("!!timestamp 2001-13-45", "as !!timestamp"),
        ("!!float y", "as !!float"),
        ("!!python/object/apply:os.system [echo]", "could not determine a constructor"),
        ("!!python/name:os.system", "could not determine a constructor"),
    ],
)
def test_yaml_explicit_tags_are_one_line(tmp_path: Path, value: str, words: str) -> None:
    path = tmp_path / "tagged.yaml"
    path.write_text(f"kvaudit: 1\nnum_blocks: {value}\ngroups: []\n")
    line = assert_one_line_error(run("inspect", "--config", path, tmp_path), "tagged.yaml")
    assert "line 2" in line and words in line


def test_a_yaml_timestamp_that_builds_is_a_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "date.yaml"
    path.write_text("kvaudit: 1\nnum_blocks: !!timestamp 2001-12-14\ngroups: []\n")
    with pytest.raises(DescriptionError, match="num_blocks: expected a positive integer"):
        load_description(path)


LIVE = """
import numpy as np
import torch

DESCRIPTION = {description!r}


def kvaudit_live():
    tensors = {{
        "model.layers.0.attn": torch.zeros(4, 4, 1, 4),
        "model.layers.1.attn": torch.zeros(4, 2, 1, 4, dtype=torch.float16),
    }}
    rank = {{}}
    requests = {{"r": {{"num_tokens": 10, "groups": {{0: [0, [1, 2]]}}}}}}
    {change}
    return DESCRIPTION, tensors, rank, requests
"""


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ('tensors["model.layers.0.attn"] = "hello"', "got str"),
        ('tensors["model.layers.0.attn"] = np.zeros((4, 4, 1, 4))', "got ndarray"),
        ('tensors["model.layers.0.attn"] = (torch.zeros(1), 5)', "got tuple"),
        ('rank = {"tp_rank": 0.0}', "tp_rank: expected an integer"),
        ('rank = {"tp_size": 2.5}', "tp_size: expected an integer from 1 to 65536"),
        ('rank = {"tp_size": 10**12}', "tp_size: expected an integer from 1 to 65536"),
        ('rank = {"num_blocks": 1.5}', "num_blocks"),
        ('rank = {"engine": b"x"}', "engine must be a string"),
        ('requests["r"]["num_tokens"] = 10.0', 'request "r": num_tokens'),
        ('requests["r"]["num_tokens"] = 2**63', 'request "r": num_tokens'),
        ('requests["r"]["groups"][0][0] = 2**62', "start: expected an integer from 0"),
        ('requests["r"]["groups"][0][0] = 3', "start position 3 (token 12) is beyond"),
        ('requests = {"r\\ud800": requests["r"]}', "lone surrogate U+D800"),
        ('requests = {("a",): requests["r"]}', "is not a string"),
    ],
)
def test_live_handles_returning_the_wrong_types_are_one_line(
    tmp_path: Path, change: str, words: str
) -> None:
    handle = tmp_path / "handle.py"
    handle.write_text(LIVE.format(description=DESCRIPTION, change=change))
    line = assert_one_line_error(run("checksum", f"py:{handle}"), "handle.py")
    assert words in line


def test_a_plain_live_handle_still_checksums(tmp_path: Path) -> None:
    handle = tmp_path / "handle.py"
    handle.write_text(LIVE.format(description=DESCRIPTION, change="pass"))
    result = run("checksum", f"py:{handle}", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"]["r"]["num_tokens"] == 10


# Class 5: positions, starts and token counts checked against each other.


def test_a_start_of_2_62_in_a_10_token_request_is_an_error_not_position_0(
    seeds: Seeds, tmp_path: Path
) -> None:
    dump = with_metadata(
        seeds, tmp_path / "d.safetensors", requests=requests_with(groups={"0": [2**62, [1]]})
    )
    line = assert_one_line_error(run("checksum", dump), "d.safetensors", "request 'r' group 0")
    assert f"start position {2**62}" in line and "beyond the request's 10 tokens" in line


@pytest.mark.parametrize(("start", "ok"), [(2, True), (3, False), (4, False)])
def test_a_dump_start_must_hold_a_token(seeds: Seeds, tmp_path: Path, start: int, ok: bool) -> None:
    # Block size 4, 10 tokens: position 2 holds tokens 8 and 9, position 3 none.
    dump = with_metadata(
        seeds, tmp_path / "d.safetensors", requests=requests_with(groups={"0": [start, [1]]})
    )
    if ok:
        record = json.loads(run("checksum", dump, "--format", "json").stdout)
        assert record["requests"]["r"]["groups"]["0"]["start"] == start
    else:
        assert_one_line_error(run("checksum", dump), "beyond the request's 10 tokens")


@pytest.mark.parametrize("start", [3, 2**40, 2**62])
def test_a_record_start_beyond_its_tokens_is_refused(
    seeds: Seeds, tmp_path: Path, start: int
) -> None:
    record = record_file(seeds, tmp_path / "r.json", lambda d: group_of(d).update(start=start))
    line = assert_one_line_error(run("checksum", record), "r.json", 'requests["r"]')
    assert "start" in line


def test_a_record_token_count_below_its_start_is_refused(seeds: Seeds, tmp_path: Path) -> None:
    record = record_file(
        seeds, tmp_path / "r.json", lambda d: d["requests"]["r"].update(num_tokens=0)
    )
    assert_one_line_error(run("checksum", record), "r.json", "beyond the request's 0 tokens")


def test_a_wire_start_beyond_its_tokens_is_refused() -> None:
    good = WireChecksums(40, "request", [WireGroup(3, 1, 16, 2, np.ones(4))])
    assert decode_wire(encode_wire(good)).groups[0].start == 2
    late = WireChecksums(40, "request", [WireGroup(3, 1, 16, 3, np.ones(1))])
    with pytest.raises(WireFormatError, match=r"^rx: group 3 at byte 15: start position 3"):
        decode_wire(encode_wire(late), "rx")
    empty = WireChecksums(0, "request", [WireGroup(3, 1, 16, 9, np.ones(0))])
    assert decode_wire(encode_wire(empty)).groups[0].count == 0


def test_the_library_never_wraps_a_position(seeds: Seeds) -> None:
    summer = Checksummer(seeds.description, seed_tensors())
    with pytest.raises(KvauditError, match=f"request r group 0: 1 positions from {2**62}"):
        summer.checksum({"r": RequestBlocks(10, {0: (2**62, [1])})})
    with pytest.raises(KvauditError, match="num_tokens must be an integer from 0 to"):
        summer.checksum({"r": RequestBlocks(2**63, {0: (0, [1])})})
    # A position past the tokens (a trimmed request) counts none, exactly.
    late = summer.checksum({"r": RequestBlocks(10, {0: (2**20, [1])})})
    assert late.requests["r"].groups[0].values.tolist() == [[0]]


# Class 11: one dump set is one engine's workers in one role.


def test_a_dump_set_mixing_roles_is_refused(seeds: Seeds, tmp_path: Path) -> None:
    description = parse_description(DESCRIPTION, "d")
    for rank, role in enumerate(["producer", "consumer"]):
        write_dump(
            tmp_path / f"rank{rank}.safetensors",
            description,
            seed_tensors(),
            REQUESTS,
            worker=WorkerInfo(rank, 2, role=role, engine="e"),
        )
    files = [tmp_path / "rank0.safetensors", tmp_path / "rank1.safetensors"]
    with pytest.raises(
        KvauditError,
        match=r'rank1.safetensors: role "consumer", but .*rank0.safetensors is a "producer"',
    ):
        open_dump_set(files)
    assert open_dump(files[1]).worker.role == "consumer"
    line = assert_one_line_error(run("inspect", *files), "rank1.safetensors", "one role")
    assert "producer" in line


def test_a_record_mixing_roles_is_refused(seeds: Seeds, tmp_path: Path) -> None:
    def change(data: dict) -> None:
        second = {**worker_of(data), "tp_rank": 1, "role": "offload"}
        data["workers"] = [
            {**worker_of(data), "tp_size": 2},
            {**second, "tp_size": 2},
        ]

    record = record_file(seeds, tmp_path / "r.json", change)
    assert_one_line_error(run("checksum", record), "r.json", "workers", "offload", "one role")


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.safetensors", "x: " + "[" * 200_000 + "\n"),
        ("tagged.safetensors", "kvaudit: !!timestamp x\ngroups: []\n"),
        ("bomb.safetensors", alias_bomb()),
        ("deep.json", "x: " + "[" * 200_000 + "\n"),
        ("tagged.json", "kvaudit: !!int x\ngroups: []\n"),
    ],
)
def test_text_given_as_a_dump_or_record_is_sniffed_within_the_limits(
    tmp_path: Path, name: str, text: str
) -> None:
    """A text file given as a SOURCE is checked for being a description (a hint) with the
    description's strict YAML reading, so hostile text is still one line."""
    path = tmp_path / name
    path.write_text(text)
    with bounded(seconds=3):
        assert_one_line_error(run("inspect", path), name)


def test_a_key_named_twice_is_refused_not_resolved(seeds: Seeds, tmp_path: Path) -> None:
    # json keeps the last of two equal keys: a record or dump naming a request twice would
    # silently lose one.
    text = json.dumps(seeds.record_json)
    request = json.dumps(seeds.record_json["requests"]["r"])
    record = tmp_path / "r.json"
    record.write_text(text.replace('"requests": {', f'"requests": {{"r": {request}, ', 1))
    line = assert_one_line_error(run("checksum", record), "r.json")
    assert 'key "r" appears twice' in line
    requests = json.dumps(requests_with())
    doubled = requests[:-1] + ', "r": ' + json.dumps(requests_with()["r"]) + "}"
    dump = with_metadata(seeds, tmp_path / "d.safetensors", requests=doubled)
    line = assert_one_line_error(run("checksum", dump), "d.safetensors")
    assert 'kvaudit.requests: key "r" appears twice' in line


def test_a_long_flat_yaml_list_is_refused_as_it_is_read(tmp_path: Path) -> None:
    # Counted while composing (this message), not once every node is built (the
    # expansion count's): a 10 MB list of one-word items took minutes and gigabytes.
    path = tmp_path / "cache.yaml"
    path.write_text("kvaudit: 1\nnum_blocks: 4\ngroups:\n" + "- a\n" * 300_000)
    with pytest.raises(DescriptionError) as error:
        load_description(path)
    assert "holds more than 100000 values" in str(error.value)
    assert "line 99997:" in str(error.value)  # the value past the limit, not the end


# Round three: what one live request may cost the engine (the agent under misbehaving
# clients: tests/live/test_live_pressure.py).


@pytest.mark.parametrize("count", [8193, 100_000])
def test_a_live_request_naming_too_many_ids_is_refused_before_any_work(count: int) -> None:
    # 100,000 ids cost an engine's thread about 0.4 s a request before they were bounded.
    from kvaudit.live.protocol import request_id_list, token_limits

    ids = [f"r{i}" for i in range(count)]
    with pytest.raises(KvauditError, match="at most 8192 request ids"):
        request_id_list(ids, "agent.sock")
    with pytest.raises(KvauditError, match="num_tokens"):
        token_limits(dict.fromkeys(ids, 1), "agent.sock")
    assert request_id_list(ids[:8192], "agent.sock") == ids[:8192]
