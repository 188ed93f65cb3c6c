"""An SGLang worker's KV pool served on a unix socket (``live:``), so that ``kvaudit diff
live:PREFILL live:DECODE --request RID`` compares two running engines, or an engine with
dumps (docs/live.md, docs/sglang.md).

The agent is kvaudit's own (``kvaudit.live.Agent``): this module only hands it what an
SGLang worker holds: the description of its pool (``describe_sglang_cache``), the pool's
buffers viewed without copying (``sglang_layer_caches``) and, whenever a client asks,
the requests in the cache now with their blocks read from their ``req_to_token`` rows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import KVCache, ReqToTokenPool

from ...core.validation import Role
from ...description import parse_description
from ...live import Agent
from ...views.inputs import RequestBlocks
from .describe import describe_sglang_cache, sglang_layer_caches
from .pages import pool_request_blocks
from .pools import DEFAULT_LAYER_NAME, STATE_LAYER_NAME, LayerNames

HeldRequests = Callable[[], Mapping[str, tuple[int, int]]]
"""Returns the requests a worker's pool holds now: request id to ``(req_pool_idx, tokens
held)``, the request's row of the ``ReqToTokenPool`` and how many of its tokens the pool
holds (a prefill: the prompt's; a decode: the prompt's and those decoded so far)."""


def sglang_agent(
    path: str | os.PathLike[str],
    pool: KVCache,
    req_to_token_pool: ReqToTokenPool,
    held: HeldRequests,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
    role: Role = "consumer",
    engine: str = "sglang",
    names: LayerNames = DEFAULT_LAYER_NAME,
    sliding_window: int | None = None,
    state_names: str = STATE_LAYER_NAME,
    lock: threading.Lock | threading.RLock | None = None,
    attention: Mapping[int, torch.nn.Module] | None = None,
    **options: Any,
) -> Agent:
    """An agent serving one SGLang worker's pool on ``path``.

    Call it in the worker's scheduler process, once its pool exists. Without ``lock``
    the agent answers in its ``poll()``, which the scheduler calls between steps; with
    the lock the scheduler holds during each step, the agent answers on its own thread
    while it holds it. Either way it reads the pool only between steps, never while a
    forward or a transfer writes it.

    Args:
        path: The unix socket (``kvaudit.live.socket_path(engine, pp_rank, tp_rank)``
            gives the conventional one: ``live:/run/kvaudit/ENGINE`` names every worker
            of the engine).
        pool: The worker's ``MHATokenToKVPool``, ``MLATokenToKVPool``, ``SWAKVPool`` or
            ``HybridLinearKVPool`` (each group served: a request's window pages and its
            Mamba state slot as ``pool_request_blocks`` finds them).
        req_to_token_pool: The worker's ``ReqToTokenPool`` (``HybridReqToTokenPool``
            with a ``HybridLinearKVPool``).
        held: The requests the pool holds now (``HeldRequests``), asked at each request.
        tp_rank: The worker's attention TP rank.
        tp_size: The attention TP size.
        total_kv_heads: The model's KV heads before TP (MHA at TP > 1).
        pp_rank: The worker's PP rank.
        pp_size: The PP size.
        role: ``producer`` (a prefill) or ``consumer`` (a decode).
        engine: The engine's name, kept in records and dumps.
        names: The layer names, as for ``describe_sglang_cache``.
        sliding_window: The window in tokens (an ``SWAKVPool``).
        state_names: The state layers' names (a ``HybridLinearKVPool``).
        attention: The model's ``RadixAttention`` layers by layer id
            (``sglang_attention_layers``), for the scales of an fp8 pool; None: none.
        lock: None to answer in ``poll()``; else the lock the scheduler holds during each
            step.
        **options: ``kvaudit.live.Agent``'s limits (``timeout``, ``wait_timeout``,
            ``max_reply_bytes``, ...) and ``backend``.

    Returns:
        The agent, listening; ``close()`` it when the worker stops.

    Raises:
        NotDescribable: A pool kvaudit does not describe.
        KvauditError: A description kvaudit refuses, or a socket that cannot be made.

    """
    raw = describe_sglang_cache(
        pool,
        tp_rank=tp_rank,
        tp_size=tp_size,
        total_kv_heads=total_kv_heads,
        names=names,
        sliding_window=sliding_window,
        state_names=state_names,
        attention=attention,
    )
    description = parse_description(raw, f"the SGLang pool of {engine} pp {pp_rank} tp {tp_rank}")

    def block_tables() -> dict[str, RequestBlocks]:
        # A window group covers the last ``sliding_window`` tokens held (page-aligned).
        return {
            request_id: pool_request_blocks(
                pool, req_to_token_pool, row, 0, tokens, sliding_window=sliding_window
            )
            for request_id, (row, tokens) in held().items()
        }

    return Agent(
        path,
        description,
        sglang_layer_caches(pool, names, state_names),
        block_tables,
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        role=role,
        engine=engine,
        lock=lock,
        **options,
    )
