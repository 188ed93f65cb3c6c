"""Which vLLM is running, the tested range, and the one warning outside it."""

from __future__ import annotations

import logging

import pytest

from kvaudit.integrations.vllm import versions


def test_the_running_vllm_is_in_the_tested_range() -> None:
    version = versions.vllm_version()
    assert versions.minor_version(version) in versions.TESTED_MINOR_VERSIONS, version


@pytest.mark.parametrize(
    ("version", "minor"),
    [("0.32.0+cpu", (0, 32)), ("0.33.1rc1", (0, 33)), ("1.0", (1, 0)), ("unknown", None)],
)
def test_minor_versions_are_read(version: str, minor: tuple[int, int] | None) -> None:
    assert versions.minor_version(version) == minor


def test_an_untested_version_warns_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(versions, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="kvaudit.vllm"):
        assert not versions.warn_if_untested("0.32.0+cpu")
        assert versions.warn_if_untested("0.40.2")
        assert versions.warn_if_untested("0.41.0")
    lines = [r.getMessage() for r in caplog.records if "outside the versions" in r.getMessage()]
    assert lines == [
        "kvaudit: vLLM 0.40.2 is outside the versions kvaudit's connector is tested with "
        "(0.32, 0.33): it runs, and any failure of its own is logged and leaves the engine "
        "as without kvaudit"
    ]
