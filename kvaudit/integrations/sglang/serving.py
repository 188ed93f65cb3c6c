"""kvaudit's live agent inside a running SGLang scheduler: started once the scheduler's
pools exist and polled at each iteration of its event loop, through a plug-in hook
(``KVAUDIT_SGLANG_LIVE``; docs/sglang.md, "Serving a running engine to live: clients").

Every SGLang event loop (normal, overlap, PP, prefill and decode) calls the scheduler's
``ingest_requests`` once per iteration, between steps, when no forward or transfer
writes the pool: kvaudit's AROUND hook on it starts the agent at the first call and
answers clients there (``Agent.poll``). The requests served are those whose prompt KV is
whole in the pool: a prefill's requests being sent (its inflight queue), a decode's
requests whose transfer has been committed (its waiting queue and running batch), each
with its prompt's tokens. Imports SGLang.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from ...live import Agent, socket_path
from .live import sglang_agent
from .ranks import CONSUMER, PRODUCER, attention_tp, pipeline_ranks
from .recording import LIVE_VARIABLE

logger = logging.getLogger(__name__)

INGEST_TARGET = "sglang.srt.managers.scheduler.Scheduler.ingest_requests"
_AGENT, _FAILED = "_kvaudit_agent", "_kvaudit_agent_failed"


def _whole_requests(scheduler: Any) -> Iterator[Any]:
    """The scheduler's requests whose prompt KV is whole in its pool."""
    for req in getattr(scheduler, "disagg_prefill_inflight_queue", None) or ():
        yield req
    for req in getattr(scheduler, "waiting_queue", None) or ():
        yield req
    running = getattr(scheduler, "running_batch", None)
    yield from getattr(running, "reqs", None) or ()


def held_requests(scheduler: Any) -> dict[str, tuple[int, int]]:
    """The requests served now: request id to ``(req_pool_idx, prompt tokens)``.

    Args:
        scheduler: A prefill or decode scheduler.

    Returns:
        What ``sglang_agent``'s ``held`` returns (requests without a row left out).

    """
    held = {}
    for req in _whole_requests(scheduler):
        row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
        if row is not None and req.origin_input_ids:
            held[str(req.rid)] = (int(row), len(req.origin_input_ids))
    return held


def scheduler_agent(scheduler: Any, folder: str) -> Agent:
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
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", None)
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
        sliding_window=getattr(scheduler, "sliding_window_size", None),
    )


def around_ingest_requests(original, self, *args, **kwargs):
    """AROUND hook of ``Scheduler.ingest_requests``: the scheduler's own intake, then the
    agent started (the first time) and its clients answered. A failure is logged once and
    the engine goes on without the agent."""
    result = original(self, *args, **kwargs)
    if getattr(self, _FAILED, False):
        return result
    try:
        agent = getattr(self, _AGENT, None)
        if agent is None:
            agent = scheduler_agent(self, os.environ[LIVE_VARIABLE])
            setattr(self, _AGENT, agent)
            logger.info("kvaudit: serving this worker's KV pool on %s", agent.path)
        agent.poll()
    except Exception:
        setattr(self, _FAILED, True)
        logger.exception("kvaudit: the live agent failed; the engine goes on without it")
    return result


def hooks() -> list[tuple[str, Any]]:
    """The live agent's ``HookRegistry`` AROUND hook: ``(target, hook)`` pairs."""
    return [(INGEST_TARGET, around_ingest_requests)]
