"""Sources: the registry (kinds by prefix or sniffing, objects by type) and the raw-KV
protocol that dumps and live tensors share for checksumming and locating.

A kind registered here, the way a new module would register it, is opened, checksummed
and located in like the built-in ones; expectations come from the tests' own planted
bytes and from the built-in dump path. The built-in kinds are recognised by one sniffer
(``kvaudit.sources.sniffing``), vLLM ExampleConnector folders among them, and no other
module recognises inputs.
"""

from __future__ import annotations

import ast
import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import kvaudit.testing  # noqa: F401  (registers LiveSide)
from kvaudit.checksum import checksum_dump_set
from kvaudit.cli import main
from kvaudit.compare import CompareOptions, diff_sources
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.dumps import open_dump_set, write_dump
from kvaudit.formats import record_to_json
from kvaudit.locate import locate_differences
from kvaudit.records import Record, WorkerInfo
from kvaudit.sources import (
    DumpSource,
    RawKVSource,
    RecordQuery,
    RecordSource,
    SourceKind,
    TensorWorker,
    open_source,
    registry,
    resolve_device,
    source_of,
)
from kvaudit.sources.raw import checksum_each
from kvaudit.sources.registry import source_kind
from kvaudit.sources.sniffing import RECORD_HINT, is_record
from kvaudit.views.inputs import RequestBlocks

PACKAGE = Path(__file__).resolve().parents[2] / "kvaudit"
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
DESCRIPTION = parse_description(
    {
        "kvaudit": 1,
        "num_blocks": 6,
        "groups": [
            {
                "spec": {
                    "type": "full_attention",
                    "block_size": 4,
                    "num_kv_heads": 2,
                    "head_size": 8,
                    "dtype": "bfloat16",
                    "layout": "NTHC",
                },
                "layers": LAYERS,
            }
        ],
    },
    "test",
)
REQUESTS = {"r": RequestBlocks(10, {0: (0, [4, 1, 3])})}
PRODUCER = WorkerInfo(0, 1, 0, 1, "producer", "p")
CONSUMER = WorkerInfo(0, 1, 0, 1, "consumer", "c")


def cache(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randint(-(2**15), 2**15, (6, 4, 2, 16), dtype=torch.int16, generator=generator)
        .view(torch.bfloat16)
        .clone()
        for name in LAYERS
    }


CACHES: dict[str, dict[str, torch.Tensor]] = {}
"""The memory kind's caches, by name."""


class MemorySource(RawKVSource):
    """A kind of source as a new module would add it: in-memory workers by name."""

    kind = "memory"

    def checksum(self, query: RecordQuery) -> Record:
        workers = ((worker.checksummer(), worker.requests) for worker in self.workers)
        return checksum_each(workers, query)

    def trimmed(self, num_tokens: Mapping[str, int]) -> MemorySource:
        return MemorySource(self.names, self.trimmed_workers(num_tokens))


def open_memory(
    names: Sequence[str], claimed: Sequence[str], options: registry.OpenOptions
) -> MemorySource:
    workers = [
        TensorWorker(name, CONSUMER, DESCRIPTION, CACHES[name], 6, dict(REQUESTS))
        for name in claimed
    ]
    return MemorySource(names, workers)


@pytest.fixture
def memory_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_KINDS", list(registry._KINDS))
    registry.register_kind(SourceKind("memory", open_memory, prefix="mem:"))


@pytest.fixture
def dump(tmp_path: Path) -> Path:
    path = tmp_path / "producer.safetensors"
    write_dump(path, DESCRIPTION, cache(), REQUESTS, worker=PRODUCER)
    return path


def test_a_registered_kind_is_opened_checksummed_and_located(memory_kind: None, dump: Path) -> None:
    broken = cache()
    # Block 1 is position 1 of the request: token 5 of layer 1, head 1, element 3.
    broken[LAYERS[1]].view(torch.int16)[1, 1, 1, 3] ^= 1
    CACHES.update({"mem:clean": cache(), "mem:broken": broken})
    clean = open_source(["mem:clean"])
    assert isinstance(clean, MemorySource)
    producer = open_source([str(dump)])
    runtime = resolve_device("cpu")

    report = diff_sources(producer, clean, CompareOptions(runtime=runtime))
    assert report.ok

    report = diff_sources(producer, open_source(["mem:broken"]), CompareOptions(runtime=runtime))
    assert not report.ok
    group = report.requests["r"][0]
    assert group.mismatched_positions == [1]
    assert [(e.position, e.layer, e.head, e.tokens) for e in group.located] == [
        (1, LAYERS[1], 1, [5])
    ]
    # The same checksums as the dump path reads from a dump of the same cache.
    assert clean.checksum(RecordQuery(runtime)).requests["r"].groups[0].totals().tolist() == (
        checksum_dump_set(open_dump_set([dump])).requests["r"].groups[0].totals().tolist()
    )


def test_locate_reads_dumps_and_live_tensors_alike(dump: Path) -> None:
    broken = cache()
    broken[LAYERS[0]].view(torch.int16)[3, 0, 0, 0] ^= 4  # block 3: position 2, token 8
    live = [TensorWorker("live", CONSUMER, DESCRIPTION, broken, 6, dict(REQUESTS))]
    dumps = open_dump_set([dump]).dumps
    found = locate_differences(dumps, live, "r", 0, [0, 1, 2], 4, 10)
    assert [(e.position, e.layer, e.head, e.tokens) for e in found] == [(2, LAYERS[0], 0, [8])]
    clean = [TensorWorker("live", CONSUMER, DESCRIPTION, cache(), 6, dict(REQUESTS))]
    assert locate_differences(dumps, clean, "r", 0, [0, 1, 2], 4, 10) == []


def test_objects_become_sources_by_type(dump: Path, tmp_path: Path) -> None:
    dump_set = open_dump_set([dump])
    record = checksum_dump_set(dump_set)
    assert isinstance(source_of(dump), DumpSource)
    assert isinstance(source_of(str(dump)), DumpSource)
    assert isinstance(source_of([dump]), DumpSource)
    assert source_of(dump_set).dump_set is dump_set
    assert source_of(record, label="saved").names == ["saved"]
    assert isinstance(source_of(record), RecordSource)
    saved = tmp_path / "record.json"
    saved.write_text(json.dumps(record_to_json(record)))
    assert isinstance(source_of(saved), RecordSource)
    for bad in (42, [], [1, 2], b"x"):
        with pytest.raises(KvauditError) as raised:
            source_of(bad, label="producer")
        assert str(raised.value) == (
            "the producer must be dump paths, a Record, a DumpSet or a LiveSide, "
            f"got {type(bad).__name__}"
        )


def test_kinds_do_not_mix(dump: Path, tmp_path: Path) -> None:
    saved = tmp_path / "record.json"
    saved.write_text(json.dumps(record_to_json(checksum_dump_set(open_dump_set([dump])))))
    with pytest.raises(KvauditError, match=r"^live: handles cannot be mixed with dumps"):
        open_source(["py:handle.py", str(dump)])
    with pytest.raises(KvauditError, match="a record stands alone"):
        open_source([str(dump), str(saved)])
    with pytest.raises(KvauditError, match="no such file or directory"):
        open_source([str(tmp_path / "missing")])
    with pytest.raises(KvauditError, match="no SOURCE given"):
        open_source([])


# The one sniffer (kvaudit.sources.sniffing): which kind a SOURCE argument is, and what a
# file that is no dump looks like instead, by one set of rules.


def connector_folder(folder: Path, tokens: int = 10) -> Path:
    """A folder as vLLM's ExampleConnector saves one request: ``[tokens, heads,
    2*head_size]`` per layer."""
    folder.mkdir(parents=True)
    for name in LAYERS:
        kv = torch.zeros(tokens, 2, 16, dtype=torch.bfloat16)
        save_file({"kv_cache": kv}, str(folder / f"{name}.safetensors"))
    return folder


def test_a_record_is_recognised_by_one_rule_for_its_kind_and_for_the_hint(
    dump: Path, tmp_path: Path
) -> None:
    """A record whose keys are sorted (``format`` not first) and whose name says nothing
    is a record as a SOURCE, and ``corrupt`` names it as one (the hints' own rule, which
    wanted ``format`` first, gave the safetensors reader's error)."""
    saved = tmp_path / "record.json"
    done = CliRunner().invoke(main, ["checksum", "-q", str(dump), "--format", "json"])
    assert done.exit_code == 0, done.output
    record = tmp_path / "sorted-record"
    record.write_text(json.dumps(json.loads(done.stdout), sort_keys=True, indent=1))
    assert not record.read_text().startswith('{\n "format"')
    kind, _ = source_kind([str(record)])
    assert kind.name == "record"
    saved.write_text(done.stdout)
    inspected = CliRunner().invoke(main, ["diff", "-q", str(record), str(saved)])
    assert inspected.exit_code == 0, inspected.output
    out = tmp_path / "out.safetensors"
    args = ["--request", "r", "--group", "0", "--position", "0"]
    result = CliRunner().invoke(main, ["corrupt", str(record), "-o", str(out), *args])
    assert result.exit_code == 2
    assert result.output.strip() == f"kvaudit: error: {record}: {RECORD_HINT}"
    assert not out.exists()


def test_a_safetensors_file_starting_with_a_brace_is_no_record(tmp_path: Path) -> None:
    """A safetensors file whose header length's low byte is ``{`` (123): its high bytes are
    NUL, so it is no record, whatever its name (it was one to the old sniffer)."""
    header = json.dumps({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
    header += b" " * (123 - len(header))
    path = tmp_path / "weights.bin"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    assert path.read_bytes()[:1] == b"{"
    assert not is_record(str(path))
    kind, _ = source_kind([str(path)])
    assert kind.name == "dumps"
    text = tmp_path / "text.bin"
    text.write_bytes(b'  {"format": "kvaudit.record/1"}')
    assert is_record(str(text))


def test_example_connector_folders_are_a_kind_of_their_own(dump: Path, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    first = connector_folder(storage / "0f3a")
    connector_folder(storage / "9e1d", tokens=7)
    for names in ([first], [storage], [first, storage / "9e1d"]):
        kind, _ = source_kind([str(name) for name in names])
        assert kind.name == "example-connector", names
    source = open_source([str(storage)], DESCRIPTION)
    assert isinstance(source, DumpSource)
    assert source.token_counts() == {"0f3a": 10, "9e1d": 7}
    # A directory of kvaudit dumps is not one; nor is a folder with kvaudit metadata.
    assert source_kind([str(dump.parent / "nothing")])[0].name == "dumps"
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dump.rename(dumps / dump.name)
    assert source_kind([str(dumps)])[0].name == "dumps"
    # They go with their own kind only.
    with pytest.raises(KvauditError) as error:
        open_source([str(first), str(dumps)], DESCRIPTION)
    assert str(error.value) == (
        f"{dumps}: ExampleConnector folders cannot be mixed with dumps or other sources; give "
        "the folders, or their storage directory, alone"
    )
    # The dump reader reads dump files only: the folder's files are no kvaudit dumps.
    with pytest.raises(KvauditError, match="not a kvaudit dump"):
        open_dump_set([first], DESCRIPTION)


RECOGNISERS = {
    "is_record",
    "looks_like_record",
    "looks_like_description",
    "is_description_data",
    "is_output_folder",
    "is_example_connector",
    "example_connector_folders",
    "python_target",
    "is_python_handle",
    "is_socket_source",
}
"""Names of functions that tell what an input is."""


def test_inputs_are_recognised_in_one_module() -> None:
    home = PACKAGE / "sources" / "sniffing.py"
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in RECOGNISERS and path != home:
                found.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert found == []
    assert "from ..sources" not in "".join(
        path.read_text(encoding="utf-8") for path in (PACKAGE / "dumps").glob("*.py")
    )
