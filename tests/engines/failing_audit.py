"""kvaudit's connector wrapping NIXL, whose own audit fails in every hook: every method of its
scheduler and worker audits raises (``PD_FAILING=hooks``), or its worker audit fails to
start (``PD_FAILING=start``). The engine must serve as without kvaudit."""

from __future__ import annotations

import os
from typing import Any

# The package, not its class: a config pairing this module with kvaudit's own class
# name then fails to load instead of loading kvaudit's connector without the change.
import kvaudit.integrations.vllm as kvaudit_vllm


class _Failing:
    """Stands in for an audit object: its methods raise, its plain attributes read."""

    def __init__(self, target: object) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value):
            return value

        def fail(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"injected failure in {type(self._target).__name__}.{name}")

        return fail


class FailingConnector(kvaudit_vllm.KVAuditHMAConnector):
    """NIXL wrapped by kvaudit's connector, kvaudit's part failing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.mode = os.environ.get("PD_FAILING", "hooks")
        if self.mode == "hooks" and self.scheduler_audit is not None:
            self.scheduler_audit = _Failing(self.scheduler_audit)  # type: ignore[assignment]

    def _start_worker_audit(self, kv_caches: Any) -> None:
        if self.mode == "start":
            raise RuntimeError("injected failure while starting the worker's audit")
        super()._start_worker_audit(kv_caches)
        if self.worker_audit is not None:
            self.worker_audit = _Failing(self.worker_audit)  # type: ignore[assignment]
