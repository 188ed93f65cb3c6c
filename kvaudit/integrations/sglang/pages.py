"""A request's pages in SGLang's pools, as kvaudit's block lists: the full pool's pages
from the request's ``req_to_token`` row, an ``SWAKVPool``'s window pages through SGLang's
own index mapping, a ``HybridLinearKVPool``'s state slot (docs/sglang.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

from ...views.inputs import RequestBlocks
from .pools import HYBRID_GROUP, STATE_BLOCK_TOKENS, NotDescribable, pool_kind


def request_blocks(
    req_to_token_row: torch.Tensor | Sequence[int],
    num_tokens: int,
    page_size: int,
    *,
    group_id: int = 0,
) -> RequestBlocks:
    """A request's blocks from its ``req_to_token`` row (``ReqToTokenPool.req_to_token[
    req.kv.req_pool_idx]``): block ids are the pages holding its tokens, in order.

    Every token slot must lie at its place in its page (``slot % page_size`` equal to the
    token's position in its block), as SGLang's paged allocators hand slots out, and no
    token may lie in padding page 0.

    Args:
        req_to_token_row: The request's row of token slots (at least ``num_tokens``).
        num_tokens: The tokens of the request to cover.
        page_size: The pool's page size.
        group_id: The description's group id (0 for ``describe_sglang_cache``'s).

    Returns:
        The request's ``RequestBlocks``, from position 0.

    Raises:
        NotDescribable: A row shorter than ``num_tokens``, slots not page-aligned, or a
            token in page 0.

    """
    row = torch.as_tensor(req_to_token_row).detach().to("cpu", torch.int64).reshape(-1)
    if num_tokens < 0 or row.numel() < num_tokens:
        raise NotDescribable(f"the row holds {row.numel()} slots, not {num_tokens} tokens")
    slots = row[:num_tokens]
    padding = slots < page_size
    if bool(padding.any()):
        token = int(padding.nonzero()[0, 0])
        raise NotDescribable(f"token {token} lies in padding page 0: the row is not allocated")
    pages = slots[::page_size] // page_size
    positions = torch.arange(num_tokens, dtype=torch.int64)
    expected = pages.repeat_interleave(page_size)[:num_tokens] * page_size + positions % page_size
    if not torch.equal(slots, expected):
        token = int((slots != expected).nonzero()[0, 0])
        raise NotDescribable(
            f"token {token} lies in slot {int(slots[token])}, not at its place in a "
            f"{page_size}-token page"
        )
    return RequestBlocks(num_tokens=num_tokens, groups={group_id: (0, pages.tolist())})


def window_start(first: int, end: int, sliding_window: int, page_size: int) -> int:
    """The first position of a request's window that a transfer moves, as SGLang 0.5.23's
    prefill computes it (``_swa_payload``): ``max(first, end - sliding_window)`` rounded
    down to a page.

    Args:
        first: The first position sent (the decode's prefix, a page boundary).
        end: The end of the range sent (exclusive).
        sliding_window: The window in tokens.
        page_size: The page size.

    Returns:
        The window's first position, a page boundary.

    """
    return (max(first, end - sliding_window) // page_size) * page_size


def pool_request_blocks(
    pool: KVCache,
    req_to_token_pool: ReqToTokenPool,
    req_pool_idx: int,
    first: int,
    end: int,
    *,
    sliding_window: int | None = None,
) -> RequestBlocks:
    """A request's blocks over positions ``first .. end - 1`` in every group of a pool.

    Group 0: the pages of its ``req_to_token`` row. An ``SWAKVPool``'s window group:
    the window pool's pages of positions ``window_start(first, end, ...) .. end - 1``
    only (the positions SGLang's transfer moves), through SGLang's own
    ``full_to_swa_index_mapping``. A ``HybridLinearKVPool``'s state group: the request's
    state slot (``req_index_to_mamba_index_mapping``, translated as SGLang translates it
    for a transfer) as the block of position 0.

    Args:
        pool: The pool ``describe_sglang_cache`` described.
        req_to_token_pool: The worker's ``ReqToTokenPool`` (``HybridReqToTokenPool``
            for a ``HybridLinearKVPool``).
        req_pool_idx: The request's row.
        first: The first position (a page boundary).
        end: The end of the range (exclusive).
        sliding_window: The window in tokens (an ``SWAKVPool``).

    Returns:
        The request's ``RequestBlocks`` (``num_tokens`` is ``end``).

    Raises:
        NotDescribable: A range not on a page boundary, slots not where the pages put
            them, a window page SGLang's mapping does not map, a state slot out of range.

    """
    kind = pool_kind(pool)
    page = int(pool.page_size)
    if first % page or not 0 <= first < end:
        raise NotDescribable(f"the range {first}..{end} does not start on a {page}-token page")
    row = req_to_token_pool.req_to_token[int(req_pool_idx)]
    part = request_blocks(row[first:end], end - first, page)
    groups = {0: (first // page, part.groups[0][1])}
    if kind == "swa":
        if sliding_window is None:
            raise NotDescribable("an SWAKVPool needs its sliding window (sliding_window_size)")
        start = window_start(first, end, sliding_window, page)
        mapping = pool.full_to_swa_index_mapping
        if mapping is None:
            raise NotDescribable("the SWAKVPool has no full_to_swa_index_mapping registered")
        slots = mapping[row[start:end].long()]
        try:
            window = request_blocks(slots, end - start, page)
        except NotDescribable as error:
            raise NotDescribable(f"window positions {start}..{end - 1}: {error}") from None
        groups[HYBRID_GROUP] = (start // page, window.groups[0][1])
    elif kind == "linear":
        index = req_to_token_pool.req_index_to_mamba_index_mapping[int(req_pool_idx)]
        slot = int(req_to_token_pool.translate_mamba_indices(index.reshape(1))[0])
        slots = int(pool.mamba_pool.size) + 1
        if end > STATE_BLOCK_TOKENS:
            raise NotDescribable(f"{end} tokens exceed a state block of {STATE_BLOCK_TOKENS}")
        if not 0 <= slot < slots:
            raise NotDescribable(f"state slot {slot} is not one of the pool's {slots}")
        groups[HYBRID_GROUP] = (0, [slot])
    return RequestBlocks(num_tokens=end, groups=groups)
