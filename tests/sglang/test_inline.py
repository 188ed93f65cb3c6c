"""kvaudit's inline verification of an SGLang P/D transfer (``kvaudit.integrations.sglang.
inline``, docs/sglang.md "Inline verification"), run through SGLang 0.5.23's own code on
the CPU: a TP=2 prefill (two processes on a real 2-rank gloo group) hands requests to a
TP=1 decode (this process), and to a TP=2 decode with 32-token pages (two processes).

Real SGLang classes and methods: ``MHATokenToKVPool``, ``PagedTokenToKVPoolAllocator``,
``ReqToTokenPool`` and ``MetadataBuffers`` (checksum row on) on each rank, the real
``PrefillBootstrapQueue`` with the fake transfer backend (its ``FakeKVSender``, ``KVArgs``
and layout signature), ``kv_layout_signature`` on the decode, the real ``DecodeTransferQueue``
and ``DecodeRequest``; the hooks installed by ``inline.register()`` through SGLang's
``HookRegistry.apply_hooks()``; the real ``send_kv_chunk`` (with ``_send_kv_chunk`` and
``set_buf``), ``_commit_transfer_to_req``, ``_kv_checksum_comparable``,
``_verify_kv_checksums`` and ``_handle_kv_checksum_mismatch`` (with SGLang's
``prepare_abort``).

Stand-ins, and only these: the scheduler is a ``SimpleNamespace`` used ONLY as the ``self``
these real methods run on (a whole ``Scheduler`` is not constructed on the CPU); requests
are ``SimpleNamespace`` objects with the fields those methods read; SGLang's own digest
(``KvChecksumComputer.compute``, a CUDA kernel) is a zlib Adler-32 emulation of the same
bytes; ``release_kv_cache`` (which needs a real tree cache) is recorded instead of run;
the batch is a list with ``filter_batch`` keeping the given indices. The fake backend
moves no bytes, so the test moves the metadata rows from prefill to decode as a real
backend does (mooncake's ``send_aux``): each aux buffer's whole row of the prefill's slot
is copied byte for byte into the decode's slot, from both prefill ranks (the last
writer's row is what decode reads).

Expected values come from the test's own KV (which cell it changed) and, for the carried
sum, from ``tests/helpers/reference.py``'s independent computation of the spec.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers.sglang_expected import expected_sum
from pd_world import (
    PAGE,
    REQUESTS,
    Decode,
    decode_process,
    register_inline,
    row_words,
    run_prefill,
)
from sglang.srt.plugins.hook_registry import HookRegistry

from kvaudit.integrations.sglang import carried, inline, plugin, serving


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both prefill ranks' results: SGLang's signature, every request's aux rows, the
    fake sender's poll after the send, which methods the hooks wrap, kvaudit's counts."""
    return run_prefill(tmp_path_factory.mktemp("prefill"))


@pytest.fixture
def decode(tp1_decode, monkeypatch) -> Decode:
    return Decode(tp1_decode, monkeypatch.setattr)


def test_prefill_ranks_write_one_identical_row(prefill):
    """Both prefill ranks send the same kvaudit words (2..6) in the checksum row, the
    spec's sum among them; word 0 is SGLang's own per-rank digest (it differs)."""
    assert prefill[0]["wrapped"] == prefill[1]["wrapped"] == ["send_kv_chunk"]
    for rid in REQUESTS:
        assert row_words(prefill, rid, 0)[1:] == row_words(prefill, rid, 1)[1:], rid
        assert prefill[0]["polls"][rid] == prefill[1]["polls"][rid] == 4  # KVPoll.Success
    for rid in ("req-ok", "req-bad", "req-prefix"):
        n, prefix = REQUESTS[rid]
        words = row_words(prefill, rid)
        assert words[carried.SLOT_MARKER] == carried.MARKER
        assert words[carried.SLOT_SUM] == expected_sum(rid, prefix)
        assert (words[carried.SLOT_FIRST], words[carried.SLOT_END]) == (prefix, n)
        assert words[0] != 0 and words[1] == prefill[0]["signature"]  # SGLang's own digest
    assert row_words(prefill, "req-plain")[2:] == [0] * 6  # no kvaudit, SGLang's digest only
    assert row_words(prefill, "req-plain")[0] != 0
    assert row_words(prefill, "HEALTH_CHECK_1") == [0] * 8  # SGLang and kvaudit both skip it
    assert prefill[0]["stats"]["written"] == 3 and prefill[0]["stats"]["not_written"] == 0


def test_intact_transfer_verified_where_sglang_admits_unverified(prefill, decode):
    req = decode.receive("req-ok", prefill, index=2)
    # SGLang's own check: TP=2's layout signature is not the TP=1 decode's.
    assert prefill[0]["signature"] != decode.signature
    assert decode.queue._kv_checksum_comparable(prefill[0]["signature"]) is False
    assert req.expected_kv_checksum == 0  # SGLang admits it unverified
    prefix_req = decode.receive("req-prefix", prefill, index=3)
    assert decode.verify([req, prefix_req]) == [req, prefix_req]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (2, 0, 0)
    assert decode.aborts == [] and decode.failed == []
    # Verified once: a re-entry (retraction) is not checked again.
    assert decode.verify([req]) == [req]
    assert inline.inline_stats()["verified"] == 2


def test_changed_cell_aborts_through_sglang(prefill, decode, caplog):
    ok = decode.receive("req-ok", prefill, index=2)
    bad = decode.receive("req-bad", prefill, index=4)
    with caplog.at_level("ERROR"):
        kept = decode.verify([ok, bad])
    assert kept == [ok]
    assert decode.aborts == ["req-bad"] and decode.released == ["req-bad"]
    assert decode.failed == [1]
    assert bad.finished_reason.message == "KV checksum mismatch"
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (1, 1, 0)
    expected = expected_sum("req-bad", 0)
    (line,) = [r.message for r in caplog.records if "kvaudit KV checksum" in r.message]
    assert "req=req-bad" in line and "tokens=0..40" in line and f"{expected:#018x}" in line


def test_prefill_without_kvaudit_is_unverified(prefill, decode):
    req = decode.receive("req-plain", prefill, index=5)
    assert decode.verify([req]) == [req]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["unverified"]) == (0, 1)
    assert stats["reasons"] == {"no kvaudit checksum from the prefill": 1}


def test_health_check_skipped(prefill, decode):
    req = decode.receive("HEALTH_CHECK_1", prefill, index=6)
    assert decode.verify([req]) == [req]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["unverified"], stats["skipped"]) == (0, 0, 1)


@pytest.mark.parametrize(
    ("slot", "value", "reason"),
    [
        # as from a prefill with 8-token pages
        (carried.SLOT_FIRST, 8, "range start 8 is not a block boundary of the decode"),
        # a prefill page of 16 before a decode prefix of 32: its first page was not sent
        (carried.SLOT_FIRST, 16, "range start 16 is not where this decode's cached prefix"),
        (carried.SLOT_END, 32, "range 0..32 does not end at the request's 37 tokens"),
        # another transfer's row (bootstrap room 999): never compared as this one's
        (
            carried.SLOT_LAYERS,
            carried.layer_word((0, 2), 999),
            "the row carries bootstrap room 0x3e7, this request's is 0x66",
        ),
    ],
)
def test_a_row_that_does_not_describe_this_transfer_is_unverified(
    prefill, decode, slot, value, reason
):
    rows = [dict(rank, rows=dict(rank["rows"])) for rank in prefill]
    for rank in rows:
        words = np.frombuffer(bytes.fromhex(rank["rows"]["req-ok"][-1]), dtype="<u8").copy()
        words[slot] = value
        rank["rows"]["req-ok"] = [*rank["rows"]["req-ok"][:-1], words.tobytes().hex()]
    req = decode.receive("req-ok", rows, index=2)
    if slot == carried.SLOT_FIRST and value == 16:
        req.kv.cache_protected_len = 32
    assert decode.verify([req]) == [req]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["unverified"], stats["mismatched"]) == (0, 1, 0)
    (text,) = stats["reasons"]
    assert text.startswith(reason), text


def _decode_rank(rank: int, init_file: str, out_dir: str, prefill: list[dict]) -> None:
    """One rank of a TP=2 decode with 32-token pages (a spawned process): receives
    ``req-ok`` and ``req-bad`` (whose changed cell lies on rank 1) and verifies them in
    one batch."""
    with decode_process(rank, init_file) as group:
        decode = Decode(group, setattr, tp_rank=rank, tp_size=2, page=2 * PAGE)
        senders = [prefill[rank]]  # equal TP widths: decode rank d pulls prefill rank d
        ok = decode.receive("req-ok", senders, index=2)
        bad = decode.receive("req-bad", senders, index=4)
        kept = [req.rid for req in decode.verify([ok, bad])]
        out = {
            "kept": kept,
            "aborts": decode.aborts,
            "failed": decode.failed,
            "sglang_comparable": decode.queue._kv_checksum_comparable(prefill[0]["signature"]),
            "stats": inline.inline_stats(),
        }
    Path(out_dir, f"decode{rank}.json").write_text(json.dumps(out))


def test_decode_at_tp2(prefill, tmp_path):
    """A TP=2 decode with 32-token pages (two processes, one gloo group): SGLang's own
    check does not compare (another page size); kvaudit verifies the intact request on
    both ranks, and the change on rank 1 aborts the other on both ranks through SGLang's
    path."""
    import torch.multiprocessing as mp

    mp.spawn(_decode_rank, args=(str(tmp_path / "init"), str(tmp_path), prefill), nprocs=2)
    for rank in range(2):
        out = json.loads((tmp_path / f"decode{rank}.json").read_text())
        assert out["kept"] == ["req-ok"] and out["aborts"] == ["req-bad"], rank
        assert out["failed"] == [1]
        assert out["sglang_comparable"] is False
        stats = out["stats"]
        assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (1, 1, 0)


def test_installed_beside_sglang_it_turns_nothing_on(monkeypatch) -> None:
    HookRegistry.reset()
    assert "KVAUDIT_SGLANG_INLINE" not in os.environ
    monkeypatch.delenv("KVAUDIT_SGLANG_LIVE", raising=False)
    plugin.register()
    assert not HookRegistry._hooks
    register_inline()
    assert set(HookRegistry._hooks) == {
        inline.PREFILL_TARGET,
        inline.COMMIT_TARGET,
        inline.VERIFY_TARGET,
    }
    HookRegistry.reset()
    monkeypatch.setenv("KVAUDIT_SGLANG_LIVE", "/run/kvaudit/prefill")
    plugin.register()
    assert set(HookRegistry._hooks) == {serving.INGEST_TARGET}
    HookRegistry.reset()


_LOAD_PLUGINS = """
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.decode import DecodeTransferQueue, SchedulerDisaggregationDecodeMixin
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
from sglang.srt.managers.scheduler import Scheduler
methods = (
    SchedulerDisaggregationPrefillMixin.send_kv_chunk,
    DecodeTransferQueue._commit_transfer_to_req,
    SchedulerDisaggregationDecodeMixin._verify_kv_checksums,
    Scheduler.ingest_requests,
)
print("".join(str(int(hasattr(method, "__wrapped__"))) for method in methods))
"""


def test_sglang_loads_the_entry_point_and_the_variables_turn_it_on() -> None:
    # SGLang's own load_plugins(), as every scheduler process runs it, in fresh processes:
    # kvaudit's installed entry point hooks the inline check's three methods only with
    # KVAUDIT_SGLANG_INLINE=1, the scheduler's intake only with KVAUDIT_SGLANG_LIVE.
    import subprocess
    import sys

    shims = str(Path(__file__).parent / "shims")
    settings = {
        "inline": {"KVAUDIT_SGLANG_INLINE": "1"},
        "live": {"KVAUDIT_SGLANG_LIVE": "/run/kvaudit/decode"},
        "none": {},
    }
    runs = {}
    for name, values in settings.items():
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("KVAUDIT_SGLANG_INLINE", "KVAUDIT_SGLANG_LIVE")
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (shims, env.get("PYTHONPATH"))))
        env.update(values)
        runs[name] = subprocess.Popen(
            [sys.executable, "-c", _LOAD_PLUGINS], env=env, stdout=subprocess.PIPE, text=True
        )
    hooked = {
        name: run.communicate(timeout=300)[0].strip().splitlines()[-1] for name, run in runs.items()
    }
    assert hooked == {"inline": "1110", "live": "0001", "none": "0000"}
