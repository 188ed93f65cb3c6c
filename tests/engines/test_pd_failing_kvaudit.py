"""Whole vLLM engines, P/D over NIXL, kvaudit's own code raising in every hook
(``failing_audit.py``): the engines serve as without kvaudit, the failures counted and
logged, nothing verified."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pd_checks import (
    ROOT,
    audit,
    kvaudit_counters,
    log_text,
    pd,
    plain,
    usage,
    wait_until,
    words,
)
from pd_engines import EngineSettings, PDPair, start_pd

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def failing_pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    out = tmp_path_factory.mktemp("failing-pair")
    settings = {
        "connector": "FailingConnector",
        "module": "failing_audit",
        "env": {"PYTHONPATH": f"{ROOT}:{HERE}"},
    }
    prefill = EngineSettings(audit(out, "prefill"), **settings)
    decode = EngineSettings(audit(out, "decode", policy="fail"), **settings)
    with start_pd(model, out, prefill, decode, base_port=8120) as pair:
        yield pair


def test_the_engines_serve_as_without_kvaudit_when_its_code_fails(failing_pair: PDPair) -> None:
    prompts = [words(900 + 3 * i, 40 + 9 * i) for i in range(3)]
    expected = [plain(failing_pair, p) for p in prompts]
    assert [pd(failing_pair, p) for p in prompts] == expected
    for side in ("prefill", "decode"):
        counters = kvaudit_counters(failing_pair, side)
        assert counters["internal_errors"] > 0
        assert counters["consumer_requests"] == counters["mismatched_requests"] == 0
        text = log_text(failing_pair, side)
        assert "kvaudit: internal error in" in text
        assert "Traceback" in text
    assert wait_until(lambda: usage(failing_pair) == 0, 120)
