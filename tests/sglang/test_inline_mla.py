"""kvaudit's inline verification on SGLang's ``MLATokenToKVPool`` (every TP rank holds the
whole latent row): a TP=2 prefill (two processes, one gloo group) hands requests to a TP=1
decode with 32-token pages, where SGLang's own check does not compare (another page
size), through SGLang's real classes and methods as in test_inline.py (its docstring
lists what stands in). The latent rows are written into ``kv_buffer`` directly (MLA's
``set_kv_buffer`` is a Triton kernel)."""

from __future__ import annotations

import pytest
from helpers.sglang_expected import expected_mla_moments
from pd_world import CHANGED, PAGE, REQUESTS, Decode, row_words, run_prefill

from kvaudit.integrations.sglang import carried, inline


@pytest.fixture(scope="module")
def prefill_mla(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_prefill(tmp_path_factory.mktemp("prefill_mla"), kind="mla")


def test_mla_prefill_ranks_carry_the_latents_checksum_once(prefill_mla) -> None:
    # Both ranks hold the same latent rows; the sum counts them once (replica 0's).
    for rid in ("req-ok", "req-bad", "req-prefix"):
        words = row_words(prefill_mla, rid, 0)
        assert words[1:] == row_words(prefill_mla, rid, 1)[1:]
        assert words[carried.SLOT_MARKER] >> 48 == carried.STRONG_TAG
        sums = tuple(words[carried.SLOT_SUMS : carried.SLOT_SUMS + 3])
        assert sums == expected_mla_moments(rid, REQUESTS[rid][1])


def test_mla_decode_verifies_and_catches(prefill_mla, tp1_decode, monkeypatch) -> None:
    decode = Decode(tp1_decode, monkeypatch.setattr, page=2 * PAGE, kind="mla")
    assert decode.queue._kv_checksum_comparable(prefill_mla[0]["signature"]) is False
    ok = decode.receive("req-ok", prefill_mla, index=2)
    prefix = decode.receive("req-prefix", prefill_mla, index=3)
    bad = decode.receive(CHANGED[0], prefill_mla, index=4)
    assert decode.verify([ok, prefix, bad]) == [ok, prefix]
    stats = inline.inline_stats()
    # req-prefix's range starts at token 16, not a page boundary of this decode: it is
    # admitted unverified, with the reason, never counted as passed.
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (1, 1, 1)
    (reason,) = stats["reasons"]
    assert reason == "range start 16 is not a block boundary of the decode (page size 32)"
    assert decode.aborts == ["req-bad"]
