"""The one sniffer (``kvaudit.sources.sniffing``): which kind a SOURCE argument is, and
what a file that is no dump looks like instead, by one set of rules; vLLM ExampleConnector
folders as a kind of their own; and no other module that recognises inputs."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.dumps import open_dump_set, write_dump
from kvaudit.records import WorkerInfo
from kvaudit.sources import DumpSource, open_source
from kvaudit.sources.registry import source_kind
from kvaudit.sources.sniffing import RECORD_HINT, is_record
from kvaudit.views.inputs import RequestBlocks

PACKAGE = Path(__file__).resolve().parents[2] / "kvaudit"
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
DATA = {
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
}
DESCRIPTION = parse_description(DATA, "test")


@pytest.fixture
def dump(tmp_path: Path) -> Path:
    path = tmp_path / "producer.safetensors"
    tensors = {name: torch.zeros(6, 4, 2, 16, dtype=torch.bfloat16) for name in LAYERS}
    requests = {"r": RequestBlocks(10, {0: (0, [4, 1, 3])})}
    write_dump(path, DESCRIPTION, tensors, requests, worker=WorkerInfo(role="producer"))
    return path


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
