"""Sources: the registry (kinds by prefix or sniffing, objects by type) and the raw-KV
protocol that dumps and live tensors share for checksumming and locating.

A kind registered here, the way a new module would register it, is opened, checksummed
and located in like the built-in ones; expectations come from the tests' own planted
bytes and from the built-in dump path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

import kvaudit.testing  # noqa: F401  (registers LiveSide)
from kvaudit.checksum import checksum_dump_set
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
from kvaudit.views.inputs import RequestBlocks

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
        open_source(["live:handle.py", str(dump)])
    with pytest.raises(KvauditError, match="a record stands alone"):
        open_source([str(dump), str(saved)])
    with pytest.raises(KvauditError, match="no such file or directory"):
        open_source([str(tmp_path / "missing")])
    with pytest.raises(KvauditError, match="no SOURCE given"):
        open_source([])
