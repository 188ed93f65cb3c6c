"""Whole vLLM engines, P/D over NIXL: the decode's policy ``fail`` with vLLM's
``kv_load_failure_policy: recompute``: every damaged load caught and recomputed by the
decode, so that no output token comes from the bad KV."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pd_checks import (
    audit,
    kvaudit_counters,
    local_tokens,
    pd,
    plain,
    usage,
    wait_until,
    words,
)
from pd_engines import EngineSettings, PDPair, start_pd


@pytest.fixture(scope="module")
def fail_pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    out = tmp_path_factory.mktemp("fail-pair")
    decode = EngineSettings(
        audit(out, "decode", policy="fail"),
        connector="FaultyConnector",
        module="faulty_transfer",
        transfer={"kv_load_failure_policy": "recompute"},
    )
    with start_pd(model, out, EngineSettings(audit(out, "prefill")), decode,
                  base_port=8110) as pair:  # fmt: skip
        yield pair


def test_policy_fail_recomputes_every_damaged_load(fail_pair: PDPair) -> None:
    prompts = [words(300 + 13 * i, 49 + i) for i in range(4)]  # 49 and 51 tokens: damaged
    expected = [plain(fail_pair, p) for p in prompts]
    got = []
    for prompt in prompts:
        before = local_tokens(fail_pair)
        got.append(pd(fail_pair, prompt))
        computed = local_tokens(fail_pair) - before
        if len(prompt.split()) % 2:  # damaged in its first block: all recomputed here
            assert computed >= len(prompt.split()) - 1
        else:  # intact: only the last token, as P/D computes it
            assert computed <= 1
    assert got == expected
    counters = kvaudit_counters(fail_pair, "decode")
    assert counters["mismatched_requests"] == 2
    assert counters["internal_errors"] == 0
    assert wait_until(lambda: usage(fail_pair) == 0, 120)
