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
import torch
from helpers.sglang_expected import expected_moments, expected_sum
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

from kvaudit.core.scheme import STRONG_PRIME
from kvaudit.integrations.sglang import carried, inline, plugin, serving
from kvaudit.integrations.sglang.ranks import block_sums


def carried_words(words: list[int]) -> tuple[int, tuple[int, ...], tuple[int, int]]:
    """A version 3 row's unit, moments and token range (its tag checked)."""
    marker, span = words[carried.SLOT_MARKER], words[carried.SLOT_RANGE]
    assert marker >> 48 == carried.STRONG_TAG
    sums = tuple(words[carried.SLOT_SUMS : carried.SLOT_SUMS + 3])
    return (marker >> 32) & 0xFFFF, sums, (span & 0xFFFF_FFFF, span >> 32)


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both prefill ranks' results: SGLang's signature, every request's aux rows, the
    fake sender's poll after the send, which methods the hooks wrap, kvaudit's counts."""
    return run_prefill(tmp_path_factory.mktemp("prefill"))


@pytest.fixture
def decode(tp1_decode, monkeypatch) -> Decode:
    return Decode(tp1_decode, monkeypatch.setattr)


def test_prefill_ranks_write_one_identical_row(prefill):
    """Both prefill ranks send the same kvaudit words (2..7) in the checksum row, the
    strong lane's moments over the prefill's pages among them (version 3, summed over the
    ranks modulo 2**64 - 59); word 0 is SGLang's own per-rank digest (it differs)."""
    assert prefill[0]["wrapped"] == prefill[1]["wrapped"] == ["send_kv_chunk"]
    for rid in REQUESTS:
        assert row_words(prefill, rid, 0)[1:] == row_words(prefill, rid, 1)[1:], rid
        assert prefill[0]["polls"][rid] == prefill[1]["polls"][rid] == 4  # KVPoll.Success
    for rid in ("req-ok", "req-bad", "req-prefix"):
        n, prefix = REQUESTS[rid]
        words = row_words(prefill, rid)
        assert carried_words(words) == (PAGE, expected_moments(rid, prefix), (prefix, n))
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
    expected = expected_moments("req-bad", 0)[0]
    (line,) = [r.message for r in caplog.records if "kvaudit KV checksum" in r.message]
    assert "req=req-bad" in line and "tokens=0..40" in line and f"{expected:#018x}" in line
    # The changed cell's token 33 lies in the prefill's block 2: named.
    assert " block 2 (tokens 32..39, 16-token blocks) differs (strong lane) " in line


SIGN_FLIPS = [(0, 1, 20, 0), (1, 3, 27, 1)]
"""``(layer, head, token, piece)`` of two K cells of ``req-ok``'s block 1 (tokens 16..31)
whose piece's bit 63 (the sign of bf16 element ``4 * piece + 3``) the decode flips."""


def flip_signs(decode: Decode, rid: str) -> None:
    """Flip the top bit of the ``SIGN_FLIPS`` pieces in the decode's pool: each changes
    the seed lane by 2**63 times an odd weight, so the two cancel there."""
    world = decode.world
    for layer, head, token, piece in SIGN_FLIPS:
        slot = int(world.req_to_token.req_to_token[world.rows[rid], token])
        cell = world.pool.k_buffer[layer][slot, head].view(torch.int16)
        cell[4 * piece + 3] ^= -0x8000


def test_two_sign_flips_in_one_block_are_caught_and_the_block_named(prefill, decode, caplog):
    flip_signs(decode, "req-ok")
    # The seed lane alone is blind to them: kvaudit's seed sum of the decode's KV is the
    # reference's of the intact KV.
    summer = inline.rank_checksummer(decode.sched, "consumer")
    row = decode.world.req_to_token.req_to_token[decode.world.rows["req-ok"]]
    record = summer.range_record("req-ok", summer.range_blocks(row, 0, 37))
    assert block_sums(record, "req-ok")[0] == expected_sum("req-ok", 0)
    req = decode.receive("req-ok", prefill, index=2)
    with caplog.at_level("ERROR"):
        assert decode.verify([req]) == []
    assert decode.aborts == ["req-ok"] and decode.failed == [1]
    (line,) = [r.message for r in caplog.records if "kvaudit KV checksum" in r.message]
    assert line.startswith("kvaudit KV checksum mismatch req=req-ok tokens=0..37 layers=0..1 ")
    assert " block 1 (tokens 16..31, 16-token blocks) differs (strong lane) " in line


def seed_lane_rows(prefill: list[dict], rid: str, signature: int) -> list[dict]:
    """The prefill ranks' results with ``rid``'s row rewritten as an older kvaudit
    prefill writes it (version 2: the seed lane's sum over the range, the reference's)."""
    n, first = REQUESTS[rid]
    out = []
    for rank in prefill:
        rows = dict(rank["rows"])
        words = np.frombuffer(bytes.fromhex(rows[rid][-1]), dtype="<u8").copy()
        layers, room = carried.split_layer_word(int(words[carried.SLOT_LAYERS]))
        seed = [carried.MARKER, expected_sum(rid, first), first, n, signature]
        words[2:] = [*seed, carried.layer_word(layers, room)]
        rows[rid] = [*rows[rid][:-1], words.tobytes().hex()]
        out.append({**rank, "rows": rows})
    return out


def test_an_older_prefills_seed_lane_row_is_compared_by_the_seed_lane(prefill, decode, caplog):
    """A version 2 row (the seed lane alone): compared by the seed lane, and the log says
    so once; the two sign flips then pass (that lane cannot see them), a changed value
    does not."""
    flip_signs(decode, "req-ok")
    signature = inline.rank_checksummer(decode.sched, "consumer").signature
    ok = decode.receive("req-ok", seed_lane_rows(prefill, "req-ok", signature), index=2)
    bad = decode.receive("req-bad", seed_lane_rows(prefill, "req-bad", signature), index=4)
    with caplog.at_level("WARNING"):
        assert decode.verify([ok, bad]) == [ok]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (1, 1, 0)
    (line,) = [r.message for r in caplog.records if "kvaudit KV checksum" in r.message]
    assert line.startswith("kvaudit KV checksum mismatch req=req-bad tokens=0..40 ")
    assert line.count("compared by the seed lane only") == 1
    notes = [m for m in caplog.messages if m.startswith("kvaudit: request")]
    assert len(notes) == 1 and "compared by the seed lane only" in notes[0]


def moments_of(deltas: dict[int, int]) -> list[int]:
    """The moments' differences of per-unit differences ``deltas``, computed directly."""
    return [sum((j + 1) ** m * d for j, d in deltas.items()) % STRONG_PRIME for m in range(3)]


def test_the_moments_name_the_differing_blocks() -> None:
    big = STRONG_PRIME - 12345  # a difference of -12346 and others, as residues
    # Up to three units: every differing one, solved exactly.
    assert carried.locate(moments_of({4: big}), [4]) == [4]
    assert carried.locate(moments_of({7: 5, 9: big}), [7, 8, 9]) == [7, 9]
    assert carried.locate(moments_of({0: 1, 1: 2, 2: big}), [0, 1, 2]) == [0, 1, 2]
    # Longer ranges: one differing unit anywhere is named; two are not located.
    assert carried.locate(moments_of({41: big}), list(range(100))) == [41]
    assert carried.locate(moments_of({3: 1, 50: big}), list(range(100))) is None
    # Two differences of opposite sign: moment 0 cancels, the others do not.
    differences = moments_of({3: 1, 50: STRONG_PRIME - 1})
    assert differences[0] == 0 and differences[1] != 0
    assert carried.locate(differences, list(range(100))) is None


def test_the_moments_name_a_state_block_at_weight_zero() -> None:
    """A hybrid pool's state block is the unit -1 (weight 0, in moment 0 alone): named
    alone or with pages, never taken for a page, and absent from a range without it."""
    big = STRONG_PRIME - 777
    pages = list(range(5))
    assert carried.locate(moments_of({-1: big}), [-1, *pages]) == [-1]
    assert carried.locate(moments_of({-1: 3, 1: big}), [-1, 0, 1]) == [-1, 1]
    assert carried.locate(moments_of({3: big}), [-1, *pages]) == [3]
    # Without the state unit, a state-only difference is not taken for a page.
    assert carried.locate(moments_of({-1: big}), pages) is None


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
    ("field", "value", "reason"),
    [
        # as from a prefill with 8-token pages
        ("first", 8, "range start 8 is not a block boundary of the decode"),
        # a prefill page of 16 before a decode prefix of 32: its first page was not sent
        ("first", 16, "range start 16 is not where this decode's cached prefix"),
        ("end", 32, "range 0..32 does not end at the request's 37 tokens"),
        # another transfer's row (bootstrap room 999): never compared as this one's
        (
            "layers",
            carried.layer_word((0, 2), 999),
            "the row carries bootstrap room 0x3e7, this request's is 0x66",
        ),
    ],
)
def test_a_row_that_does_not_describe_this_transfer_is_unverified(
    prefill, decode, field, value, reason
):
    rows = [dict(rank, rows=dict(rank["rows"])) for rank in prefill]
    for rank in rows:
        words = np.frombuffer(bytes.fromhex(rank["rows"]["req-ok"][-1]), dtype="<u8").copy()
        span = int(words[carried.SLOT_RANGE])
        if field == "first":
            words[carried.SLOT_RANGE] = value | (span >> 32) << 32
        elif field == "end":
            words[carried.SLOT_RANGE] = (span & 0xFFFF_FFFF) | value << 32
        else:
            words[carried.SLOT_LAYERS] = value
        rank["rows"]["req-ok"] = [*rank["rows"]["req-ok"][:-1], words.tobytes().hex()]
    req = decode.receive("req-ok", rows, index=2)
    if field == "first" and value == 16:
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
