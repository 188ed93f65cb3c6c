"""The parts of the vLLM connector that run without vLLM: its settings, the worker audit on
plain tensors (values against the numpy reference), the output folder it writes and its
reading back as a SOURCE of ``kvaudit checksum`` and ``diff``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import kvbuild as kb
from helpers import reference as ref

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.description import parse_description
from kvaudit.integrations.vllm.config import AuditConfig, parse_config
from kvaudit.integrations.vllm.jobs import AuditJob, AuditStep
from kvaudit.integrations.vllm.scheduler import SchedulerAudit
from kvaudit.integrations.vllm.worker import WorkerAudit
from kvaudit.output_folders import read_output_folder
from kvaudit.records import WorkerInfo

MODEL = kb.Model(
    (kb.GroupModel(0, tuple(kb.Attn(f"model.layers.{i}.self_attn.attn", 4) for i in range(2)),
                   16, layout="NHTC"),)
)  # fmt: skip
TOKENS = {"r1": 37, "r2": 20}


def test_settings_defaults_and_values() -> None:
    assert parse_config(None) == AuditConfig()
    config = parse_config({"output": "/tmp/x", "policy": "fail", "max_dump_bytes": 10,
                           "dump_sample_rate": 0.5, "positions": "block"})  # fmt: skip
    assert (config.output, config.policy, config.max_dump_bytes) == ("/tmp/x", "fail", 10)
    assert (config.dump_sample_rate, config.positions) == (0.5, "block")
    assert not config.rotate_dumps and parse_config({"rotate_dumps": True}).rotate_dumps


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ({"outptu": "/x"}, "unknown key 'outptu'"),
        ({"policy": "stop"}, "policy: expected one of log, fail"),
        ({"max_dump_bytes": -1}, "max_dump_bytes"),
        ({"max_dump_bytes": True}, "max_dump_bytes"),
        ({"dump_sample_rate": 2}, "dump_sample_rate"),
        ({"dump_sample_rate": float("nan")}, "dump_sample_rate"),
        ({"rotate_dumps": "yes"}, "rotate_dumps: expected true or false"),
        ({"output": ""}, "output"),
        ("x", "expected a mapping"),
    ],
)
def test_bad_settings_are_one_line_errors(raw: object, words: str) -> None:
    with pytest.raises(KvauditError) as caught:
        parse_config(raw)
    message = str(caught.value)
    assert message.startswith("kv_connector_extra_config.kvaudit: ") and words in message
    assert "\n" not in message


def engine(tmp_path: Path, side: str, tp_size: int = 2) -> tuple[list[kb.Worker], dict]:
    requests = {
        rid: kb.make_request(MODEL, n, i, tp_size) for i, (rid, n) in enumerate(TOKENS.items())
    }
    workers = kb.build_engine(MODEL, requests, kb.Engine(tp_size=tp_size, seed=5))
    for w in workers:
        audit = WorkerAudit(
            parse_description(w.description, "w"), w.description, w.tensors,
            WorkerInfo(w.tp_rank, tp_size, 0, 1, "producer", side),
            AuditConfig(output=str(tmp_path / side)),
        )  # fmt: skip
        jobs = [
            AuditJob(f"engine-{rid}", rid, "producer", n, dict(groups))
            for rid, (n, groups) in w.requests.items()
        ]
        audit.bind(AuditStep(jobs=jobs))
        audit.forward_done()
        [partial] = audit.partials()
        assert set(partial.record().requests) == {f"engine-{rid}" for rid in TOKENS}
        audit.close()
    return workers, requests


def test_the_output_folder_is_a_record_of_the_engine(tmp_path: Path) -> None:
    _, requests = engine(tmp_path, "prefill")
    record = read_output_folder(tmp_path / "prefill")
    assert record.complete and len(record.workers) == 2
    for rid, n in TOKENS.items():
        group = kb.reference_group(MODEL, 0, requests[rid], 2)
        want = ref.total(ref.block_checksums(group, n))
        assert want.any()
        np.testing.assert_array_equal(record.requests[rid].groups[0].totals(), want)
        assert record.requests[rid].num_tokens == n
    assert (tmp_path / "prefill" / "cache.yaml").is_file()


def test_checksum_and_diff_read_output_folders(tmp_path: Path) -> None:
    engine(tmp_path, "prefill")
    engine(tmp_path, "decode")
    runner = CliRunner()
    result = runner.invoke(main, ["checksum", str(tmp_path / "prefill"), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["requests"]) == set(TOKENS)
    same = runner.invoke(main, ["diff", str(tmp_path / "prefill"), str(tmp_path / "decode")])
    assert same.exit_code == 0, same.output
    # One worker's value of r1 position 1 changed on the decode side.
    path = tmp_path / "decode" / "workers" / "pp0-tp1" / "checksums.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    row = next(line for line in lines if line["request"] == "r1")["groups"]["0"]["values"][1]
    row[0] = f"{int(row[0], 16) ^ 1:016x}"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    differ = runner.invoke(main, ["diff", str(tmp_path / "prefill"), str(tmp_path / "decode"),
                                  "--format", "json"])  # fmt: skip
    assert differ.exit_code == 1
    report = json.loads(differ.stdout)
    assert report["requests"]["r1"]["groups"]["0"]["mismatched_positions"] == [1]
    assert report["requests"]["r2"]["groups"]["0"]["mismatched_positions"] == []


def test_folders_of_earlier_versions_still_read(tmp_path: Path) -> None:
    # Before the SGLang hooks shared the format, the connector marked its folder
    # kvaudit-vllm.json and named its lines kvaudit.vllm-checksums/1.
    _, requests = engine(tmp_path, "prefill")
    folder = tmp_path / "prefill"
    marker = json.loads((folder / "kvaudit-output.json").read_text())
    assert marker == {"format": "kvaudit.engine-output/1", "engine": "vllm"}
    (folder / "kvaudit-output.json").unlink()
    (folder / "kvaudit-vllm.json").write_text('{"format": "kvaudit.vllm-output/1"}')
    for path in folder.glob("workers/*/checksums.jsonl"):
        path.write_text(path.read_text().replace("kvaudit.engine-checksums/1",
                                                 "kvaudit.vllm-checksums/1"))  # fmt: skip
    record = read_output_folder(folder)
    for rid, n in TOKENS.items():
        want = ref.total(ref.block_checksums(kb.reference_group(MODEL, 0, requests[rid], 2), n))
        np.testing.assert_array_equal(record.requests[rid].groups[0].totals(), want)


def test_unreadable_output_folders_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(KvauditError, match="not a kvaudit output folder"):
        read_output_folder(tmp_path)
    engine(tmp_path, "prefill", tp_size=1)
    path = tmp_path / "prefill" / "workers" / "pp0-tp0" / "checksums.jsonl"
    path.write_text(path.read_text() + "{not json\n")
    result = CliRunner().invoke(main, ["checksum", str(tmp_path / "prefill")])
    assert result.exit_code == 2
    assert f"{path}: line 3: not a checksum line" in result.output
    assert "Traceback" not in result.output


def test_launch_then_result_is_the_checksum(tmp_path: Path) -> None:
    """``Checksummer.launch`` gives what ``checksum`` gives; on the CPU it is ready."""
    requests = {rid: kb.make_request(MODEL, n, i, 1) for i, (rid, n) in enumerate(TOKENS.items())}
    [w] = kb.build_engine(MODEL, requests, kb.Engine(seed=2))
    summer = Checksummer(parse_description(w.description, "w"), w.tensors)
    blocks = {rid: RequestBlocks(n, dict(groups)) for rid, (n, groups) in w.requests.items()}
    pending = summer.launch(blocks)
    assert pending.ready()
    launched = pending.result()
    direct = summer.checksum(blocks)
    for rid in TOKENS:
        np.testing.assert_array_equal(
            launched.requests[rid].groups[0].values, direct.requests[rid].groups[0].values
        )


def dump_engine(tmp_path: Path, max_bytes: int) -> list[Path]:
    """One worker auditing both requests with dumps asked for; the dump files written."""
    requests = {rid: kb.make_request(MODEL, n, i, 1) for i, (rid, n) in enumerate(TOKENS.items())}
    [w] = kb.build_engine(MODEL, requests, kb.Engine(seed=3))
    audit = WorkerAudit(
        parse_description(w.description, "w"), w.description, w.tensors,
        WorkerInfo(0, 1, 0, 1, "producer", "p"),
        AuditConfig(output=str(tmp_path), max_dump_bytes=max_bytes, dump_sample_rate=1.0),
    )  # fmt: skip
    jobs = [AuditJob(rid, rid, "producer", n, dict(groups), dump=True)
            for rid, (n, groups) in w.requests.items()]  # fmt: skip
    audit.bind(AuditStep(jobs=jobs))
    audit.forward_done()
    return sorted(tmp_path.glob("dumps/*/*.safetensors"))


def test_dumps_stay_within_max_dump_bytes(tmp_path: Path) -> None:
    # r1 (37 tokens: 3 blocks of 2 layers x 4 heads x 16 tokens x 16 bf16 cells) fits
    # alone; r2 (2 blocks) would pass the bound of 3 blocks.
    block_bytes = 2 * 4 * 16 * 16 * 2
    written = dump_engine(tmp_path / "small", 3 * block_bytes)
    assert [p.parent.name for p in written] == ["r1"]
    assert len(dump_engine(tmp_path / "large", 5 * block_bytes)) == 2
    assert dump_engine(tmp_path / "none", 0) == []


def test_both_engines_sample_the_same_requests() -> None:
    """The dump sample is a fraction of request ids chosen by their hash alone."""
    config = AuditConfig(output="/o", dump_sample_rate=0.25, max_dump_bytes=1)
    scheduler = SchedulerAudit(config, {}, producer=True, world_size=1, single_group=True)
    other = SchedulerAudit(config, {}, producer=False, world_size=4, single_group=True)
    ids = [f"cmpl-{i}" for i in range(4000)]
    chosen = [rid for rid in ids if scheduler.dump_sampled(rid)]
    assert chosen == [rid for rid in ids if other.dump_sampled(rid)]
    assert 0.22 < len(chosen) / len(ids) < 0.28
    never = SchedulerAudit(AuditConfig(output="/o", dump_sample_rate=1.0), {}, producer=True,
                           world_size=1, single_group=True)  # fmt: skip
    assert not any(never.dump_sampled(rid) for rid in ids[:50])  # max_dump_bytes 0: no dumps
