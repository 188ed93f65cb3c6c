"""kvaudit's SGLang hooks write an output folder on each engine (``KVAUDIT_SGLANG_OUTPUT``,
docs/sglang.md "The output folder"): the prefill's per-block checksums of every request
it sends and, with rotating dumps, its blocks; the decode's checksums of every request it
checks and a dump of one whose check failed. ``kvaudit diff`` reads the two folders as
SOURCEs and the two dump folders of the failed request, and locates the planted fault.

The transfer runs through SGLang's real classes and methods as in test_inline.py (its
docstring lists what stands in): a TP=2 prefill (two processes, one gloo group) and a
TP=1 decode in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import reference as ref
from pd_world import (
    CHANGED,
    NAME,
    REQUESTS,
    Decode,
    kv_of,
    run_prefill,
)

from kvaudit.cli import main
from kvaudit.core.errors import KvauditError
from kvaudit.integrations.sglang import inline, plugin
from kvaudit.output_folders import read_output_folder

SENT = ("req-ok", "req-bad", "req-prefix")  # sent with kvaudit's hooks installed


@pytest.fixture(scope="module")
def prefill_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The prefill's output folder and both ranks' results."""
    out = tmp_path_factory.mktemp("prefill")
    folder = out / "kvaudit"
    return folder, run_prefill(out, output=str(folder))


@pytest.fixture
def decode_out(tp1_decode, monkeypatch, tmp_path) -> tuple[Decode, Path]:
    """A TP=1 decode writing its output folder (dumps up to 100 MB)."""
    folder = tmp_path / "decode"
    monkeypatch.setenv("KVAUDIT_SGLANG_OUTPUT", str(folder))
    monkeypatch.setenv("KVAUDIT_SGLANG_MAX_DUMP_BYTES", str(10**8))
    return Decode(tp1_decode, monkeypatch.setattr), folder


def _block_checksums(rid: str) -> np.ndarray:
    """The spec's per-block checksums of the request's global KV, from the decode's prefix
    page on (tests/helpers/reference.py)."""
    n, prefix = REQUESTS[rid]
    layers = tuple(
        ref.Layer(NAME.format(i=layer), torch.cat(kv, -1).contiguous().view(torch.uint8).numpy())
        for layer, kv in kv_of(rid).items()
    )
    return ref.total(ref.block_checksums(ref.Group(16, layers), n, start=prefix // 16))


def test_prefill_folder_holds_each_sent_request(prefill_out) -> None:
    folder, ranks = prefill_out
    marker = json.loads((folder / "kvaudit-output.json").read_text())
    assert marker == {"format": "kvaudit.engine-output/1", "engine": "sglang"}
    record = read_output_folder(folder)
    assert record.complete and len(record.workers) == 2
    assert sorted(record.requests) == sorted(SENT)
    for rid in SENT:
        group = record.requests[rid].groups[0]
        assert group.start == REQUESTS[rid][1] // 16
        np.testing.assert_array_equal(group.totals(), _block_checksums(rid))
    for rid in SENT:  # rotating dumps: both ranks' files of every sent request
        assert sorted(p.name for p in (folder / "dumps" / rid).iterdir()) == [
            "pp0-tp0.safetensors",
            "pp0-tp1.safetensors",
        ]
    assert not (folder / "dumps" / "req-plain").exists()
    assert not (folder / "dumps" / "HEALTH_CHECK_1").exists()
    assert ranks[0]["stats"]["dumps_written"] == 3


def test_decode_dumps_the_failed_request_and_diff_locates_it(prefill_out, decode_out) -> None:
    prefill_folder, ranks = prefill_out
    decode, folder = decode_out
    ok = decode.receive("req-ok", ranks, index=2)
    bad = decode.receive("req-bad", ranks, index=4)
    assert decode.verify([ok, bad]) == [ok]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["dumps_written"]) == (1, 1, 1)
    assert sorted(p.name for p in (folder / "dumps").iterdir()) == ["req-bad"]
    record = read_output_folder(folder)
    assert sorted(record.requests) == ["req-bad", "req-ok"]
    np.testing.assert_array_equal(
        record.requests["req-ok"].groups[0].totals(), _block_checksums("req-ok")
    )
    runner = CliRunner()

    def diff(*args: str) -> tuple[int, dict]:
        result = runner.invoke(main, ["diff", *args, "--format", "json"])
        return result.exit_code, json.loads(result.stdout)

    code, report = diff(str(prefill_folder), str(folder), "--request", "req-ok")
    assert (code, report["ok"]) == (0, True)
    code, report = diff(str(prefill_folder), str(folder), "--request", "req-bad")
    assert code == 1
    rid, layer, head, token = CHANGED
    assert report["requests"][rid]["groups"]["0"]["mismatched_positions"] == [token // 16]
    code, report = diff(str(prefill_folder / "dumps" / rid), str(folder / "dumps" / rid))
    assert code == 1
    (located,) = report["requests"][rid]["groups"]["0"]["located"]
    assert (located["layer"], located["head"], located["tokens"]) == (
        NAME.format(i=layer),
        head,
        [token],
    )


def test_bad_output_settings_stop_the_engine_in_one_line(monkeypatch) -> None:
    monkeypatch.setenv("KVAUDIT_SGLANG_INLINE", "1")
    monkeypatch.setenv("KVAUDIT_SGLANG_MAX_DUMP_BYTES", "lots")
    with pytest.raises(KvauditError) as caught:
        plugin.register()
    assert str(caught.value) == (
        "environment: KVAUDIT_SGLANG_MAX_DUMP_BYTES: expected a non-negative integer, got 'lots'"
    )
