"""kvaudit's inline check fails closed per request on a checksum row it cannot read
(docs/sglang.md, "Inline verification"): through SGLang 0.5.23's real classes and methods,
as in test_inline.py (its docstring lists what stands in), a TP=2 prefill's rows reach a
decode with one request's row damaged (word 7, the layer range, empty or inverted) in the
same batch as a request whose KV changed in transit.

The damaged request is admitted unverified (counted, its reason logged once), never
verified; the changed one is aborted through SGLang's own path; on a TP=2 decode whose
rank 1 alone holds the damaged row, both ranks take part in the same collectives and
reach the same verdicts.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from pd_world import PAGE, REQUESTS, Decode, decode_process, run_prefill

from kvaudit.integrations.sglang import carried, inline

ROOM_OK = 100 + list(REQUESTS).index("req-ok") + 1  # the bootstrap room the decode checks
DAMAGED = {
    # first | end << 16 | room << 32, with the request's own room: only the layers are wrong
    "empty": 1 | 1 << 16 | ROOM_OK << 32,
    "inverted": 2 | 0 << 16 | ROOM_OK << 32,
}


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Both TP=2 prefill ranks' rows (``pd_world.run_prefill``)."""
    return run_prefill(tmp_path_factory.mktemp("prefill"))


def damaged(rank: dict, rid: str, word: int) -> dict:
    """A copy of a prefill rank's results whose checksum row of ``rid`` carries ``word``
    as its layer word."""
    rows = dict(rank["rows"])
    words = np.frombuffer(bytes.fromhex(rows[rid][-1]), dtype="<u8").copy()
    words[carried.SLOT_LAYERS] = word
    rows[rid] = [*rows[rid][:-1], words.tobytes().hex()]
    return {**rank, "rows": rows}


@pytest.mark.parametrize("kind", sorted(DAMAGED))
def test_a_damaged_row_leaves_its_request_unverified_and_the_batch_checked(
    prefill, tp1_decode, monkeypatch, caplog, kind
) -> None:
    decode = Decode(tp1_decode, monkeypatch.setattr)
    senders = [damaged(rank, "req-ok", DAMAGED[kind]) for rank in prefill]
    ok = decode.receive("req-ok", senders, index=2)
    bad = decode.receive("req-bad", prefill, index=4)
    prefix = decode.receive("req-prefix", prefill, index=3)
    with caplog.at_level(logging.WARNING, logger="kvaudit"):
        kept = decode.verify([ok, bad, prefix])
    assert [req.rid for req in kept] == ["req-ok", "req-prefix"]
    assert decode.aborts == ["req-bad"] and decode.failed == [1]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (1, 1, 1)
    assert stats["reasons"] == {carried.MALFORMED: 1}
    (line,) = [m for m in caplog.messages if m.startswith("kvaudit: request")]
    assert "request req-ok" in line and "empty or inverted" in line
    assert not any("kvaudit failed" in reason for reason in stats["reasons"])


def test_a_carried_value_that_cannot_be_gathered_is_that_requests_alone(
    prefill, tp1_decode, monkeypatch
) -> None:
    # Past the row's own reading: a value on the request that no row could carry (inverted
    # layers) is unverified at the gather, the batch's other requests still checked.
    decode = Decode(tp1_decode, monkeypatch.setattr)
    ok = decode.receive("req-ok", prefill, index=2)
    bad = decode.receive("req-bad", prefill, index=4)
    state = inline.state_of(decode.sched)
    value = state.take(ok.rid)
    assert isinstance(value, carried.Carried)
    inverted = carried.Carried(value.sums, 0, 37, value.signature, (2, 0), 1, value.unit)
    state.keep(ok.rid, inverted)
    assert [req.rid for req in decode.verify([ok, bad])] == ["req-ok"]
    assert decode.aborts == ["req-bad"]
    stats = inline.inline_stats()
    assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (0, 1, 1)
    assert stats["reasons"] == {carried.MALFORMED: 1}


def test_one_reason_is_logged_once_however_many_requests(prefill, tp1_decode, monkeypatch, caplog):
    decode = Decode(tp1_decode, monkeypatch.setattr)
    senders = [damaged(rank, "req-ok", DAMAGED["empty"]) for rank in prefill]
    with caplog.at_level(logging.WARNING, logger="kvaudit"):
        for _ in range(3):
            decode.verify([decode.receive("req-ok", senders, index=2)])
    assert inline.inline_stats()["unverified"] == 3
    assert sum(m.startswith("kvaudit: request req-ok admitted") for m in caplog.messages) == 1


def _decode_rank(rank: int, init_file: str, out_dir: str, prefill: list[dict]) -> None:
    """One rank of a TP=2 decode with 32-token pages (a spawned process; SGLang's own check
    does not compare another page size): rank 1 alone holds a damaged row of ``req-ok``;
    ``req-bad``'s changed cell lies on rank 1."""
    with decode_process(rank, init_file, timeout=timedelta(seconds=120)) as group:
        decode = Decode(group, setattr, tp_rank=rank, tp_size=2, page=2 * PAGE)
        sender = prefill[rank]  # equal TP widths: decode rank d pulls prefill rank d
        ok = decode.receive(
            "req-ok", [damaged(sender, "req-ok", DAMAGED["inverted"]) if rank else sender], 2
        )
        bad = decode.receive("req-bad", [sender], index=4)
        kept = [req.rid for req in decode.verify([ok, bad])]
        # The ranks are still in step: one more batch, each rank's row intact.
        again = decode.receive("req-ok", [sender], index=5)
        kept_again = [req.rid for req in decode.verify([again])]
        out = {
            "kept": kept,
            "kept_again": kept_again,
            "aborts": decode.aborts,
            "stats": inline.inline_stats(),
        }
    Path(out_dir, f"decode{rank}.json").write_text(json.dumps(out))


def test_decode_at_tp2_with_one_ranks_row_damaged(prefill, tmp_path) -> None:
    """Both ranks reach the same verdicts: ``req-ok`` unverified (rank 1 read a damaged
    row, rank 0 learns it from the gather), ``req-bad`` aborted; a next batch, each
    rank's row intact, is verified in step."""
    import torch.multiprocessing as mp

    mp.spawn(_decode_rank, args=(str(tmp_path / "init"), str(tmp_path), prefill), nprocs=2)
    reasons = {0: inline.PEER_UNREADABLE, 1: carried.MALFORMED}
    for rank in range(2):
        out = json.loads((tmp_path / f"decode{rank}.json").read_text())
        assert out["kept"] == ["req-ok"], rank
        assert out["aborts"] == ["req-bad"], rank
        assert out["kept_again"] == ["req-ok"], rank
        stats = out["stats"]
        assert (stats["verified"], stats["mismatched"], stats["unverified"]) == (1, 1, 1), rank
        assert stats["reasons"] == {reasons[rank]: 1}, rank
