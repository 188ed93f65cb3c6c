"""The parts of kvaudit's SGLang hooks that run without SGLang (``kvaudit.integrations.
sglang.recording``): the output settings read from the environment, and the writer of an
engine's output folder (checksum lines read back as a record, dumps within the budget,
rotating dumps removing the oldest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import kvbuild as kb
from helpers import reference as ref

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.dumps import open_dump
from kvaudit.integrations.sglang.recording import (
    InlineSettings,
    Recorder,
    settings_from_environment,
)
from kvaudit.output_folders import read_output_folder
from kvaudit.records import WorkerInfo

MODEL = kb.Model(
    (kb.GroupModel(0, tuple(kb.Attn(f"model.layers.{i}.self_attn.attn", 4) for i in range(2)),
                   16, layout="NTHC"),)
)  # fmt: skip
TOKENS = {"r1": 37, "r2": 20, "r3": 33}


def test_settings_from_the_environment() -> None:
    assert settings_from_environment({}) == InlineSettings()
    settings = settings_from_environment(
        {
            "KVAUDIT_SGLANG_OUTPUT": "/tmp/out",
            "KVAUDIT_SGLANG_MAX_DUMP_BYTES": "1000",
            "KVAUDIT_SGLANG_ROTATE_DUMPS": "1",
        }
    )
    assert settings == InlineSettings("/tmp/out", 1000, True)


@pytest.mark.parametrize(
    ("environ", "words"),
    [
        ({"KVAUDIT_SGLANG_MAX_DUMP_BYTES": "-1"}, "MAX_DUMP_BYTES: expected a non-negative"),
        ({"KVAUDIT_SGLANG_MAX_DUMP_BYTES": "1e9"}, "MAX_DUMP_BYTES: expected a non-negative"),
        ({"KVAUDIT_SGLANG_ROTATE_DUMPS": "yes"}, "ROTATE_DUMPS: expected 0 or 1, got 'yes'"),
        ({"KVAUDIT_SGLANG_MAX_DUMP_BYTES": "10"}, "need KVAUDIT_SGLANG_OUTPUT"),
    ],
)
def test_bad_settings_are_one_line_errors(environ: dict, words: str) -> None:
    with pytest.raises(KvauditError) as caught:
        settings_from_environment(environ)
    message = str(caught.value)
    assert message.startswith("environment: KVAUDIT_SGLANG_") and words in message
    assert "\n" not in message


def _worker() -> tuple[kb.Worker, Checksummer, WorkerInfo]:
    requests = {rid: kb.make_request(MODEL, n, i, 1) for i, (rid, n) in enumerate(TOKENS.items())}
    (worker,) = kb.build_engine(MODEL, requests, kb.Engine(seed=4))
    info = WorkerInfo(0, 1, 0, 1, "producer", "SGLang prefill")
    summer = Checksummer(
        parse_description(worker.description, "w"), worker.tensors, role="producer",
        engine="SGLang prefill",
    )  # fmt: skip
    return worker, summer, info


def _blocks(worker: kb.Worker, rid: str) -> RequestBlocks:
    n, groups = worker.requests[rid]
    return RequestBlocks(n, dict(groups))


def test_lines_read_back_as_the_engines_record(tmp_path: Path) -> None:
    worker, summer, info = _worker()
    settings = InlineSettings(str(tmp_path / "out"))
    recorder = Recorder(settings, info, summer.description, worker.description, worker.tensors)
    for rid in TOKENS:
        recorder.checksums(summer.checksum({rid: _blocks(worker, rid)}), rid)
    record = read_output_folder(tmp_path / "out")
    for i, (rid, n) in enumerate(TOKENS.items()):
        group = kb.reference_group(MODEL, 0, kb.make_request(MODEL, n, i, 1), 1)
        want = ref.total(ref.block_checksums(group, n))
        np.testing.assert_array_equal(record.requests[rid].groups[0].totals(), want)
    # no dump budget: nothing dumped
    assert recorder.dump("r1", _blocks(worker, "r1"), rotating=False) is None


def test_dumps_stay_within_the_budget_and_rotation_removes_the_oldest(tmp_path: Path) -> None:
    worker, summer, info = _worker()
    per_block = sum(
        part.numel() * part.element_size() // part.shape[0]
        for tensor in worker.tensors.values()
        for part in (tensor if isinstance(tensor, tuple) else (tensor,))
    )
    size = {rid: per_block * -(-n // 16) for rid, n in TOKENS.items()}  # 3, 2, 3 blocks
    budget = size["r1"] + size["r2"]
    settings = InlineSettings(str(tmp_path / "out"), budget, rotate_dumps=True)
    recorder = Recorder(settings, info, summer.description, worker.description, worker.tensors)
    paths = {rid: recorder.dump(rid, _blocks(worker, rid), rotating=True) for rid in TOKENS}
    assert all(paths.values())
    dumps = tmp_path / "out" / "dumps"
    assert sorted(p.name for p in dumps.iterdir()) == ["r2", "r3"]  # r1 made room for r3
    assert recorder.budget.used == size["r2"] + size["r3"] <= budget
    # A dump that could never fit removes nothing; a rewrite counts its file once.
    assert recorder.dump("r1", RequestBlocks(200, {0: (0, list(range(13)))}), rotating=True) is None
    assert sorted(p.name for p in dumps.iterdir()) == ["r2", "r3"]
    assert recorder.dump("r3", _blocks(worker, "r3"), rotating=True) == paths["r3"]
    assert recorder.budget.used == size["r2"] + size["r3"]
    assert sorted(p.name for p in dumps.iterdir()) == ["r2", "r3"]
    dump = open_dump(paths["r3"])
    assert set(dump.requests) == {"r3"}
    fixed = Recorder(
        InlineSettings(str(tmp_path / "fixed"), budget), info, summer.description,
        worker.description, worker.tensors,
    )  # fmt: skip
    kept = [fixed.dump(rid, _blocks(worker, rid), rotating=False) for rid in TOKENS]
    assert [path is not None for path in kept] == [True, True, False]  # r3 over the budget
