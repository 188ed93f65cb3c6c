"""kvaudit's inline verification of SGLang's hybrid pools (docs/sglang.md, "Hybrid
pools"): a TP=2 prefill (two spawned processes on a real gloo group) hands requests to a
TP=1 decode (this process), each side with SGLang 0.5.23's real ``SWAKVPool`` (and
``SWATokenToKVPoolAllocator``, whose ``full_to_swa_index_mapping`` places the window's
pages) or ``HybridLinearKVPool`` (with the ``HybridReqToTokenPool``'s ``MambaPool``, a
GatedDeltaNet-like conv state of q/k/v sub-blocks each sharded on its own). The world and
its stand-ins are tests/sglang/test_inline.py's (examples/sglang_cpu/pd_world.py).

Intact transfers verify, where SGLang's own check admits them unverified (the TP=2
prefill's layout is not the decode's); each fault of the field is planted by hand on the
decode and aborted through SGLang's own path, the verdict naming the group that failed:
the window's pages never written (a window not sent), a window page holding another
request's KV (stale), one element of the full layer, the conv state as a transfer that
slices it contiguously between TP widths leaves it, and a Mamba state held in another
dtype (a description mismatch, named). Carried sums are checked against the spec's,
computed by tests/helpers/reference.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.sglang_expected import expected_hybrid_strong
from pd_world import REQUESTS, Decode, run_prefill

from kvaudit.dumps import open_dump
from kvaudit.integrations.sglang import carried, inline


@pytest.fixture(scope="module")
def prefill_swa(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_prefill(tmp_path_factory.mktemp("prefill_swa"), kind="swa")


@pytest.fixture(scope="module")
def prefill_linear(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_prefill(tmp_path_factory.mktemp("prefill_linear"), kind="linear")


def room_words(prefill: list[dict], rid: str, rank: int = 1) -> list[int]:
    """The ``bootstrap_room`` row (the aux buffer before the checksum row) a rank sent."""
    return np.frombuffer(bytes.fromhex(prefill[rank]["rows"][rid][-2]), dtype="<u8").tolist()


def errors(caplog) -> list[str]:
    return [r.message for r in caplog.records if "kvaudit KV" in r.message]


@pytest.mark.parametrize("kind", ["swa", "linear"])
def test_prefill_carries_each_group(kind, prefill_swa, prefill_linear):
    """Both ranks send the same group words: each group's spec strong-lane sum and an id;
    the checksum row's moments are over every group's blocks (the window's pages at their
    positions, the state at weight 0), their moment of order 0 the groups' sums added."""
    prefill = prefill_swa if kind == "swa" else prefill_linear
    prime = carried.STRONG_PRIME
    for rid in ("req-ok", "req-bad", "req-prefix"):
        n, prefix = REQUESTS[rid]
        words = room_words(prefill, rid)
        assert words[1:] == room_words(prefill, rid, 0)[1:]
        assert words[1] == carried.GROUPS_TAG << 48 | 2
        sums, moments = expected_hybrid_strong(rid, prefix, kind)
        assert [words[2] >> 32, words[3], words[4] >> 32, words[5]] == [0, sums[0], 1, sums[1]]
        row = np.frombuffer(bytes.fromhex(prefill[1]["rows"][rid][-1]), dtype="<u8").tolist()
        assert row[carried.SLOT_MARKER] >> 48 == carried.STRONG_TAG
        assert tuple(row[carried.SLOT_SUMS : carried.SLOT_SUMS + 3]) == moments
        assert moments[0] == (sums[0] + sums[1]) % prime
        assert row[carried.SLOT_RANGE] == prefix | n << 32


@pytest.mark.parametrize("kind", ["swa", "linear"])
def test_intact_hybrid_transfer_verified(
    kind, prefill_swa, prefill_linear, tp1_decode, monkeypatch
):
    prefill = prefill_swa if kind == "swa" else prefill_linear
    decode = Decode(tp1_decode, monkeypatch.setattr, kind=kind)
    ok = decode.receive("req-ok", prefill, index=2)
    with_prefix = decode.receive("req-prefix", prefill, index=3)
    assert decode.queue._kv_checksum_comparable(prefill[0]["signature"]) is False
    assert ok.expected_kv_checksum == 0  # SGLang's own check admits it unverified
    assert decode.verify([ok, with_prefix]) == [ok, with_prefix]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (2, 0, 0)
    assert decode.aborts == [] and decode.failed == []


# The window (20 tokens) of req-bad's 40 covers pages 1 and 2; the state is the unit -1
# (weight 0) of the moments.
FAULTS = [
    (
        "swa",
        "window-not-sent",
        "blocks 1, 2 (tokens 16..31, 32..39, 16-token blocks) differ",
        "groups=1",
    ),
    ("swa", "stale-window", "block 1 (tokens 16..31, 16-token blocks) differs", "groups=1"),
    ("swa", "full-cell", "block 2 (tokens 32..39, 16-token blocks) differs", "groups=0"),
    ("linear", "contiguous-state", "the state differs", "groups=1"),
    ("linear", "full-cell", "block 2 (tokens 32..39, 16-token blocks) differs", "groups=0"),
]


@pytest.mark.parametrize(("kind", "fault", "where", "named"), FAULTS)
def test_fault_aborted_and_named_by_group(
    kind,
    fault,
    where,
    named,
    prefill_swa,
    prefill_linear,
    tp1_decode,
    monkeypatch,
    caplog,
    tmp_path,
):
    """The faulty request is aborted through SGLang's own path (its intact neighbour
    kept), the log line names the failed group, and the decode dumps the request, every
    group's blocks in its own block space; the strong lane's moments name the block (a
    window page at its positions) or the state."""
    prefill = prefill_swa if kind == "swa" else prefill_linear
    monkeypatch.setenv("KVAUDIT_SGLANG_OUTPUT", str(tmp_path))
    monkeypatch.setenv("KVAUDIT_SGLANG_MAX_DUMP_BYTES", str(10**8))
    decode = Decode(tp1_decode, monkeypatch.setattr, kind=kind, faults={"req-bad": fault})
    ok = decode.receive("req-ok", prefill, index=2)
    bad = decode.receive("req-bad", prefill, index=4)
    assert bad.expected_kv_checksum == 0  # SGLang's own check admits it unverified
    with caplog.at_level("ERROR"):
        assert decode.verify([ok, bad]) == [ok]
    assert decode.aborts == ["req-bad"] and decode.failed == [1]
    (line,) = errors(caplog)
    assert "req=req-bad" in line and line.endswith(named), line
    assert f" {where} (strong lane) " in line, line
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["dumps_written"]) == (1, 1, 1)
    (dump_path,) = (tmp_path / "dumps").rglob("*.safetensors")
    dump = open_dump(dump_path)
    assert [group.id for group in dump.description.groups] == [0, 1]
    assert set(dump.requests["req-bad"].groups) == {0, 1}


def test_state_in_another_dtype_is_a_named_description_mismatch(
    prefill_linear, tp1_decode, monkeypatch, caplog
):
    """The decode keeps the temporal state in bf16, the prefill sent fp32: aborted as a
    description mismatch of group 1, never admitted unverified."""
    decode = Decode(tp1_decode, monkeypatch.setattr, kind="linear", temporal_dtype=torch.bfloat16)
    ok = decode.receive("req-ok", prefill_linear, index=2)
    with caplog.at_level("ERROR"):
        assert decode.verify([ok]) == []
    (line,) = errors(caplog)
    assert "kvaudit KV description mismatch req=req-ok" in line
    assert "group 1 (mamba) described apart" in line and "bfloat16" in line
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (0, 1, 0)
