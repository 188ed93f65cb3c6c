"""``kvaudit checksum --format json`` on dump sets of several layouts, TP and PP sizes,
kernel block sizes and group kinds, against the independent reference (tests/helpers/reference.py).

Each engine is built from a seeded global model KV (tests/helpers/kvbuild.py), every worker's live
tensors are written as a dump (``write_dump``), and the command's record must hold, per
request, group and position, each replica key's value of the reference and the right total.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import engine_runs as er
from helpers import kvbuild as kb
from helpers import reference as ref

from kvaudit.cli import main
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import Record, WorkerInfo


def _mixed_model() -> kb.Model:
    """An attention group with an indexer cache in one layer module, an MLA group and a
    TP-split Mamba group: three groups of different kinds in one engine."""
    attention = kb.GroupModel(
        0,
        (
            kb.Attn(er.L0, heads=4, head_size=8),
            kb.Attn(er.L1, heads=4, head_size=8),
            kb.Attn(er.L3, heads=4, head_size=8),
            kb.Attn(er.INDEXER3, heads=1, head_size=16, type="mla", layout="NTC"),
        ),
        8,
        layout="NTHC",
    )
    mla = kb.GroupModel(
        1,
        (kb.Attn("model.layers.4.mla.attn", heads=1, head_size=16, type="mla", layout="NTC"),),
        8,
        layout="NTC",
    )
    states = er.mamba_model(split=True, numbers=(5, 6)).groups[0]
    return kb.Model((attention, mla, kb.GroupModel(2, states.layers, 8)))


CASES = {
    "nthc-tp2": (er.attn_model(layout="NTHC"), kb.Engine(tp_size=2, seed=1)),
    "knhtd-tp4-kernel-blocks": (
        er.attn_model(layout="KNHTD", heads=8, block_size=16),
        kb.Engine(tp_size=4, kernel_block_sizes={0: 4}, seed=2),
    ),
    "nkthd-tp2-pp2": (
        er.attn_model(layout="NKTHD", layers=4),
        kb.Engine(tp_size=2, pp_size=2, seed=3),
    ),
    "nthd-pairs-pp3": (er.attn_model(layout="NTHD", layers=3), kb.Engine(pp_size=3, seed=4)),
    "gqa-tp4-replicas": (
        er.attn_model(heads=2, layout="NHTC", model_kv_heads=2),
        kb.Engine(tp_size=4, seed=5),
    ),
    "mixed-groups-tp2": (_mixed_model(), kb.Engine(tp_size=2, seed=6)),
}


def _write_dumps(workers: list[kb.Worker], folder: Path, role: str) -> None:
    folder.mkdir()
    for worker in workers:
        write_dump(
            folder / f"pp{worker.pp_rank}-tp{worker.tp_rank}.safetensors",
            parse_description(worker.description, "test"),
            worker.tensors,
            er.request_blocks(worker),
            worker=WorkerInfo(
                worker.tp_rank, worker.tp_size, worker.pp_rank, worker.pp_size, role, "test"
            ),
        )


@pytest.mark.parametrize("role", ["producer", "consumer"])
@pytest.mark.parametrize("case", list(CASES))
def test_checksum_json_equals_the_reference(case: str, role: str, tmp_path: Path) -> None:
    model, engine = CASES[case]
    tokens = {"req-a": 29, "req-b": 45}
    requests, workers = er.build(model, engine, tokens)
    _write_dumps(workers, tmp_path / "dumps", role)

    result = CliRunner().invoke(main, ["checksum", str(tmp_path / "dumps"), "--format", "json"])
    assert result.exit_code == 0, result.output
    record = Record.from_json(json.loads(result.stdout), "stdout")
    assert record.complete

    for group in model.groups:
        block_size = engine.block_size(group)
        for rid in tokens:
            got = record.requests[rid].groups[group.id]
            want = er.expected(
                model, group.id, requests, workers, rid, engine.tp_size, "request", block_size
            )
            keys = {(r, i) for r in want for i in range(r if role == "consumer" else 1)}
            assert set(map(tuple, got.replica_keys)) == keys
            for k, (replicas, _) in enumerate(got.replica_keys):
                np.testing.assert_array_equal(got.values[:, k], want[replicas])
            np.testing.assert_array_equal(got.totals(), ref.total(want, got.count))
