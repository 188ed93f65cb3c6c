"""kvaudit's state on one SGLang scheduler, one typed object: the inline check's counts
and the lines it logged once, its rank checksummers and output writer, the checksum rows
a decode keeps between a transfer's commit and its check, and the live agent.

The object is made the first time one of kvaudit's hooks runs on a scheduler and kept in
ONE attribute of the scheduler (``STATE_ATTRIBUTE``), nowhere else on SGLang's objects.
An attribute rather than a ``WeakKeyDictionary`` keyed by the scheduler: it lives exactly
as long as its scheduler with no registry to clean, and it needs nothing of the
scheduler's class (a dictionary key must be hashable and weakly referable, which the
plain objects that stand in for SGLang's scheduler in tests are not, and which a future
``Scheduler.__eq__`` would silently change).

The process's counts (``inline_stats``) are every scheduler's added up: those of a
scheduler that is gone are folded into one total when its state is collected, so nothing
is held past its scheduler.

This module imports neither SGLang nor anything that does.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .hooked import NotInThisSglang
from .recording import InlineSettings, settings_from_environment

if TYPE_CHECKING:
    from ...live import Agent
    from .carried import Carried, Unverified
    from .ranks import LayerSpan, RankChecksummer
    from .recording import Recorder

# One logger for the whole inline check, named as before it was split into modules: a
# deployment's logging settings for it keep working.
logger = logging.getLogger("kvaudit.integrations.sglang.inline")

STATE_ATTRIBUTE = "_kvaudit"
"""The one attribute kvaudit sets on an SGLang scheduler: its ``SchedulerState``."""
MAX_PENDING = 1 << 16
"""Checksum rows a decode keeps at most between commits and checks (a request aborted
in between never reaches the check: its row is dropped, oldest first, past this)."""


@dataclass(eq=False)
class InlineStats:
    """Counts of the inline check: requests verified, verified on some layers only
    (partial), caught (aborted), unverified and health checks skipped, with the reasons of
    the unverified and partial ones; prefill rows written and left empty; dumps written."""

    verified: int = 0
    partial: int = 0
    mismatched: int = 0
    unverified: int = 0
    skipped: int = 0
    written: int = 0
    not_written: int = 0
    dumps_written: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    def add(self, other: InlineStats) -> None:
        """Add ``other``'s counts to these."""
        theirs = vars(other)
        for item in fields(self):
            setattr(self, item.name, vars(self)[item.name] + theirs[item.name])

    def clear(self) -> None:
        """Zero every count."""
        for item in fields(self):
            setattr(self, item.name, Counter() if item.name == "reasons" else 0)

    def as_dict(self) -> dict[str, Any]:
        """The counts as a plain dict (``reasons`` a dict too)."""
        counts: dict[str, Any] = {item.name: vars(self)[item.name] for item in fields(self)}
        counts["reasons"] = dict(self.reasons)
        return counts


@dataclass(eq=False)
class Checksummers:
    """The scheduler's rank checksummers, by role and span of layers, of one pool (built
    again if the scheduler's pool is another object)."""

    pool: object | None = None
    built: dict[tuple[str, LayerSpan | None], RankChecksummer] = field(default_factory=dict)

    def of(self, pool: object) -> dict[tuple[str, LayerSpan | None], RankChecksummer]:
        """The checksummers built over ``pool`` (none yet if it is a new pool)."""
        if self.pool is not pool:
            self.pool, self.built = pool, {}
        return self.built


@dataclass(eq=False)
class LiveAgent:
    """The scheduler's live agent (None until started) and whether starting or polling
    it failed (then the engine goes on without it)."""

    agent: Agent | None = None
    failed: bool = False


@dataclass(frozen=True, eq=False)
class SchedulerState:
    """kvaudit's state on one SGLang scheduler (``state_of``). The fields are never
    rebound; each holds what changes (counts, caches) itself."""

    counts: InlineStats = field(default_factory=InlineStats)
    logged: set[str] = field(default_factory=set)
    """What was logged once (reasons, messages): bounded as the set of distinct keys."""
    checksummers: Checksummers = field(default_factory=Checksummers)
    recorders: dict[str, Recorder | None] = field(default_factory=dict)
    """The writer into the output folder, by role (None: no output folder)."""
    pending: OrderedDict[str, Carried | Unverified] = field(default_factory=OrderedDict)
    """A decode's rows kept at commit, by request id, until the request is checked."""
    live: LiveAgent = field(default_factory=LiveAgent)

    @cached_property
    def settings(self) -> InlineSettings:
        """The output settings, read from the environment when first needed."""
        return settings_from_environment()

    def first_time(self, key: str) -> bool:
        """Whether ``key`` (a reason, a message) is logged for the first time; it is
        remembered, so each is logged once and the set stays as bounded as the keys.

        Args:
            key: What would be logged.

        Returns:
            True the first time since the last ``reset_inline_stats``.

        """
        if key in self.logged:
            return False
        self.logged.add(key)
        return True

    def log_once(self, message: str) -> None:
        """Log ``message`` as a warning the first time only (``first_time``).

        Args:
            message: The warning, without the ``kvaudit:`` prefix.

        """
        if self.first_time(message):
            logger.warning("kvaudit: %s", message)

    def count_unverified(self, rid: str, reason: str, detail: str = "") -> None:
        """Count request ``rid`` unverified for ``reason``; log it once per reason (the
        first request's id and ``detail`` with it), so the log and the set of logged
        lines stay bounded however many requests arrive.

        Args:
            rid: The SGLang request's id (logged).
            reason: Why it is unverified (what is counted, and logged once).
            detail: What the log line adds in parentheses ("" for nothing).

        """
        self.counts.unverified += 1
        self.counts.reasons[reason] += 1
        if self.first_time(reason):
            logger.warning(
                "kvaudit: request %s admitted unverified: %s%s (logged once per reason)",
                rid,
                reason,
                f" ({detail})" if detail else "",
            )

    def log_fault(self, where: str) -> None:
        """A fault in kvaudit's own code: logged (once, with its traceback), counted; the
        engine goes on as without kvaudit. Called in an ``except`` block, whose exception
        is logged.

        Args:
            where: What kvaudit was doing (counted as ``kvaudit failed in WHERE``).

        """
        self.counts.reasons[f"kvaudit failed in {where}"] += 1
        if self.first_time(where):
            logger.exception("kvaudit: %s failed; the engine goes on without kvaudit there", where)

    def keep(self, rid: str, carried: Carried | Unverified) -> None:
        """Keep what request ``rid``'s row carried until its check (``take``); past
        ``MAX_PENDING`` rows the oldest is dropped and its request counted unverified.

        Args:
            rid: The request's id.
            carried: What its checksum row carried.

        """
        self.pending.pop(rid, None)
        self.pending[rid] = carried
        while len(self.pending) > MAX_PENDING:
            dropped, _ = self.pending.popitem(last=False)
            self.count_unverified(
                dropped, f"more than {MAX_PENDING} requests between commit and check"
            )

    def take(self, rid: str) -> Carried | Unverified | None:
        """What request ``rid``'s row carried, forgotten (a request is checked once: a
        retraction that brings it back finds nothing); None where nothing was kept.

        Args:
            rid: The request's id.

        Returns:
            What ``keep`` kept, or None.

        """
        return self.pending.pop(rid, None)


_retired = InlineStats()
"""The counts of schedulers whose state is gone."""
_states: weakref.WeakSet[SchedulerState] = weakref.WeakSet()
"""The states alive in this process."""


def state_of(scheduler: object) -> SchedulerState:
    """kvaudit's state on ``scheduler``, made on the first call (when a hook first runs
    on that scheduler).

    Args:
        scheduler: The SGLang scheduler (or the object a hook runs on in its place).

    Returns:
        Its ``SchedulerState``.

    Raises:
        NotInThisSglang: A scheduler that takes no attributes.

    """
    try:
        found = vars(scheduler).get(STATE_ATTRIBUTE)
    except TypeError:  # no __dict__: nowhere to keep the state
        raise NotInThisSglang(
            f"{type(scheduler).__name__} takes no attributes (kvaudit keeps its state in "
            f"{STATE_ATTRIBUTE})"
        ) from None
    if isinstance(found, SchedulerState):
        return found
    state = SchedulerState()
    setattr(scheduler, STATE_ATTRIBUTE, state)
    _states.add(state)
    # Its counts outlive it, in the process's total (the counts alone: the finalizer
    # holds no reference to the state, or it would never be collected).
    weakref.finalize(state, _retired.add, state.counts)
    return state


def inline_stats(scheduler: object | None = None) -> dict[str, Any]:
    """The inline check's counts: this process's (every scheduler's added up), or one
    scheduler's.

    Args:
        scheduler: A scheduler, or None for the whole process.

    Returns:
        ``verified``, ``partial``, ``mismatched``, ``unverified``, ``skipped``,
        ``written``, ``not_written``, ``dumps_written`` and ``reasons`` (a dict).

    """
    if scheduler is not None:
        return state_of(scheduler).counts.as_dict()
    total = InlineStats()
    total.add(_retired)
    for state in list(_states):
        total.add(state.counts)
    return total.as_dict()


def reset_inline_stats() -> None:
    """Zero the process's counts and forget which lines were logged once."""
    _retired.clear()
    for state in list(_states):
        state.counts.clear()
        state.logged.clear()
