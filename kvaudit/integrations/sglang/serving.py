"""kvaudit's live agent inside a running SGLang scheduler: started once the scheduler's
pools exist and polled at each iteration of its event loop, through a plug-in hook
(``KVAUDIT_SGLANG_LIVE``; docs/sglang.md, "Serving a running engine to live: clients").

Every SGLang event loop (normal, overlap, PP, prefill and decode) calls the scheduler's
``ingest_requests`` once per iteration, between steps, when no forward or transfer
writes the pool: kvaudit's AROUND hook on it starts the agent at the first call and
answers clients there (``Agent.poll``). The requests served are those whose prompt KV is
whole in the pool: a prefill's requests being sent (its inflight queue), a decode's
requests whose transfer has been committed (its waiting queue and running batch), each
with its prompt's tokens. The agent is kept in the scheduler's ``SchedulerState``.
Imports SGLang.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ...live import Agent, socket_path
from . import hooked
from .live import sglang_agent
from .ranks import CONSUMER, PRODUCER, attention_tp, pipeline_ranks
from .recording import LIVE_VARIABLE
from .state import state_of

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

INGEST_TARGET = hooked.INGEST_REQUESTS.target
NOT_SERVED = "its requests are not served to live: clients"


def _queue(scheduler: Scheduler, name: hooked.Name) -> Iterable[Req]:
    """One of the scheduler's request queues (empty where it is None: a prefill's
    inflight queue on a decode; missing: logged once)."""
    return hooked.read_or_none(scheduler, name, NOT_SERVED) or ()


def _whole_requests(scheduler: Scheduler) -> Iterator[Req]:
    """The scheduler's requests whose prompt KV is whole in its pool."""
    yield from _queue(scheduler, hooked.INFLIGHT_QUEUE)
    yield from _queue(scheduler, hooked.WAITING_QUEUE)
    running = hooked.read_or_none(scheduler, hooked.RUNNING_BATCH, NOT_SERVED)
    if running is not None:
        yield from running.reqs


def held_requests(scheduler: Scheduler) -> dict[str, tuple[int, int]]:
    """The requests served now: request id to ``(req_pool_idx, prompt tokens)``.

    Args:
        scheduler: A prefill or decode scheduler.

    Returns:
        What ``sglang_agent``'s ``held`` returns (requests without a row left out).

    """
    held = {}
    for req in _whole_requests(scheduler):
        row = req.kv.req_pool_idx
        if row is not None and req.origin_input_ids:
            held[str(req.rid)] = (int(row), len(req.origin_input_ids))
    return held


def scheduler_agent(scheduler: Scheduler, folder: str) -> Agent:
    """The agent of one scheduler process, at ``FOLDER/ppP-tpT.sock``.

    Args:
        scheduler: The scheduler, its pools built.
        folder: The engine's socket folder (``live:FOLDER`` names every worker); its last
            part is the engine's name in records and dumps.

    Returns:
        The agent, listening; it answers in ``poll()``.

    """
    _, tp_rank, tp_size = attention_tp(scheduler)
    pp_rank, pp_size = pipeline_ranks()
    mode = hooked.read(scheduler, hooked.MODE).value
    folder = os.path.normpath(folder)
    root, engine = os.path.split(folder)
    return sglang_agent(
        socket_path(engine, pp_rank, tp_rank, root),
        scheduler.token_to_kv_pool_allocator.get_kvcache(),
        scheduler.req_to_token_pool,
        lambda: held_requests(scheduler),
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=int(scheduler.model_config.get_total_num_kv_heads()),
        pp_rank=pp_rank,
        pp_size=pp_size,
        role=PRODUCER if mode == "prefill" else CONSUMER,
        engine=engine,
        sliding_window=hooked.read_or_none(
            scheduler, hooked.SLIDING_WINDOW, "an SWAKVPool's window is not known"
        ),
    )


def agent_of(scheduler: Scheduler) -> Agent | None:
    """The scheduler's live agent (None until started, or where it failed).

    Args:
        scheduler: The scheduler.

    Returns:
        The agent, or None.

    """
    return state_of(scheduler).live.agent


def around_ingest_requests(
    original: Callable[..., Any], self: Scheduler, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook of ``Scheduler.ingest_requests``: the scheduler's own intake, then the
    agent started (the first time) and its clients answered. A failure is logged once and
    the engine goes on without the agent.

    Args:
        original: SGLang's ``ingest_requests``.
        self: The scheduler.
        *args: SGLang's arguments, passed on.
        **kwargs: SGLang's keyword arguments, passed on.

    Returns:
        What SGLang's method returns.

    """
    result = original(self, *args, **kwargs)
    try:
        live = state_of(self).live
    except hooked.NotInThisSglang as missing:
        hooked.report(missing, "no live agent")
        return result
    if live.failed:
        return result
    try:
        if live.agent is None:
            live.agent = scheduler_agent(self, os.environ[LIVE_VARIABLE])
            logger.info("kvaudit: serving this worker's KV pool on %s", live.agent.path)
        live.agent.poll()
    except Exception:
        live.failed = True
        logger.exception("kvaudit: the live agent failed; the engine goes on without it")
    return result


def hooks() -> list[tuple[str, Callable[..., Any]]]:
    """The live agent's ``HookRegistry`` AROUND hook: ``(target, hook)`` pairs."""
    return [(INGEST_TARGET, around_ingest_requests)]
