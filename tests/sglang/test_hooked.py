"""The SGLang names kvaudit reaches (``hooked.HOOKED``) against the SGLang installed, and
what kvaudit does where one is missing; kvaudit's one state object per scheduler and the
process's counts it adds up (docs/sglang.md, "What kvaudit reaches inside SGLang")."""

from __future__ import annotations

import gc
import importlib
import inspect
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvaudit.integrations.sglang import hooked, inline, serving
from kvaudit.integrations.sglang.carried import Unverified
from kvaudit.integrations.sglang.state import STATE_ATTRIBUTE, SchedulerState, state_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"


def _owner(name: hooked.Name) -> type:
    module, _, cls = name.owner.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def _assigned(cls: type, attribute: str) -> bool:
    """Whether ``self.ATTRIBUTE`` is assigned in the source of ``cls`` or a base of it
    (an attribute set in ``__init__`` is no class attribute)."""
    pattern = re.compile(rf"self\.{re.escape(attribute)}\s*(:[^=\n]*)?=[^=]")
    for base in cls.__mro__:
        if not base.__module__.startswith("sglang"):
            continue
        if pattern.search(inspect.getsource(base)):
            return True
    return False


@pytest.mark.parametrize("name", hooked.HOOKED, ids=lambda name: name.target)
def test_every_name_exists_in_the_sglang_installed(name: hooked.Name) -> None:
    cls = _owner(name)
    first = name.attribute.split(".")[0]
    if name.kind in ("hook", "call"):
        assert callable(inspect.getattr_static(cls, first))
    else:
        assert hasattr(cls, first) or _assigned(cls, first), name.target
    assert name.private == first.startswith("_")


def test_the_checked_version_is_the_one_installed_and_documented() -> None:
    assert hooked.installed_version() == hooked.SGLANG_CHECKED
    text = DOC.read_text(encoding="utf-8")
    assert f"SGLang {hooked.SGLANG_CHECKED}" in text
    for name in hooked.HOOKED:
        short = f"{name.owner.rpartition('.')[2]}.{name.attribute}"
        assert f"| `{short}` | {name.kind} |" in text, short


def test_the_hook_targets_are_the_tables() -> None:
    targets = {target for target, _ in inline.hooks() + serving.hooks()}
    assert targets == {name.target for name in hooked.HOOKED if name.kind == "hook"}


def test_a_missing_name_is_one_line_never_a_default(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = SimpleNamespace(sliding_window_size=16)
    assert hooked.read(scheduler, hooked.SLIDING_WINDOW) == 16
    with pytest.raises(hooked.NotInThisSglang, match=r"has no 'attn_tp_cpu_group'.*0\.5\.23"):
        hooked.read(scheduler, hooked.ATTN_TP_CPU_GROUP)
    # A dotted path names the part that is missing.
    runner = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace()))
    with caplog.at_level(logging.WARNING, logger="kvaudit"):
        for _ in range(3):
            assert hooked.read_or_none(runner, hooked.MODEL, "no scales (test)") is None
    lines = [m for m in caplog.messages if "no scales (test)" in m]
    assert len(lines) == 1 and "has no 'model'" in lines[0]


def test_one_state_per_scheduler_in_one_attribute() -> None:
    scheduler = SimpleNamespace(waiting_queue=[])
    before = set(vars(scheduler))
    state = state_of(scheduler)
    assert isinstance(state, SchedulerState) and state_of(scheduler) is state
    assert set(vars(scheduler)) - before == {STATE_ATTRIBUTE}
    with pytest.raises(AttributeError):  # frozen: its fields are never rebound
        state.counts = state.counts  # type: ignore[misc]
    with pytest.raises(hooked.NotInThisSglang, match="takes no attributes"):
        state_of(object())


def test_process_counts_add_every_scheduler_and_keep_those_gone() -> None:
    inline.reset_inline_stats()
    first, second = SimpleNamespace(), SimpleNamespace()
    state_of(first).counts.verified += 2
    state_of(second).count_unverified("req-1", "a reason")
    assert inline.inline_stats(first)["verified"] == 2
    assert inline.inline_stats(second)["verified"] == 0
    total = inline.inline_stats()
    assert (total["verified"], total["unverified"], total["reasons"]) == (2, 1, {"a reason": 1})
    del first
    gc.collect()
    assert inline.inline_stats() == total  # a scheduler gone: its counts stay
    inline.reset_inline_stats()
    assert inline.inline_stats()["verified"] == 0


def test_rows_kept_between_commit_and_check_are_bounded(monkeypatch) -> None:
    from kvaudit.integrations.sglang import state as state_module

    monkeypatch.setattr(state_module, "MAX_PENDING", 2)
    inline.reset_inline_stats()
    state = state_of(SimpleNamespace())
    for rid in ("a", "b", "c"):
        state.keep(rid, Unverified("kept"))
    assert list(state.pending) == ["b", "c"]
    assert state.counts.unverified == 1
    assert state.take("b") is not None and state.take("b") is None  # checked once
