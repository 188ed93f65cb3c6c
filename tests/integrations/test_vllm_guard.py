"""The guard around kvaudit's part of each vLLM connector hook (no vLLM needed): a failure
is caught, counted, logged with its traceback once per hook, and handed to the recovery,
whose own failure is logged, never raised."""

from __future__ import annotations

import logging

import pytest

from kvaudit.integrations.vllm.guard import AuditGuard


def test_a_failure_is_caught_counted_and_recovered_from(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recovered: list[str] = []
    guard = AuditGuard(recovered.append)
    after = []
    with caplog.at_level(logging.WARNING, logger="kvaudit.vllm"):
        for _ in range(3):
            with guard("build_connector_meta"):
                raise KeyError("a bug of kvaudit's")
            after.append("the hook goes on")
        with guard("update_connector_output"):
            raise ValueError("another")
        with guard("request_finished"):
            pass  # no failure: nothing counted
    assert after == ["the hook goes on"] * 3
    assert recovered == ["build_connector_meta"] * 3 + ["update_connector_output"]
    assert guard.take_errors() == 4
    assert guard.take_errors() == 0
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert [r.getMessage().split(" (")[0] for r in with_traceback] == [
        "kvaudit: internal error in build_connector_meta",
        "kvaudit: internal error in update_connector_output",
    ]
    again = [r.getMessage() for r in caplog.records if "again" in r.getMessage()]
    assert again == ["kvaudit: internal error in build_connector_meta again (see the first)"] * 2


def test_a_failing_recovery_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def recover(hook: str) -> None:
        raise RuntimeError("recovery failed too")

    guard = AuditGuard(recover)
    with caplog.at_level(logging.ERROR, logger="kvaudit.vllm"), guard("get_transfer_results"):
        raise RuntimeError("first")
    assert guard.take_errors() == 1
    assert any("while recovering" in r.getMessage() for r in caplog.records)


def test_what_is_not_an_exception_is_not_swallowed() -> None:
    guard = AuditGuard(lambda hook: None)
    with pytest.raises(KeyboardInterrupt), guard("shutdown"):
        raise KeyboardInterrupt
