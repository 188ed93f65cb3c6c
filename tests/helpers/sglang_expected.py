"""The spec's checksums of the KV the CPU prefill/decode world writes
(examples/sglang_cpu/pd_world.py), computed independently (``reference``), for the SGLang
stage's inline tests."""

from __future__ import annotations

import numpy as np
import torch
from pd_world import LAYERS, NAME, PAGE, REQUESTS, kv_of, latent_of

from helpers import reference as ref


def expected_sum(rid: str, first: int, span: tuple[int, int] = (0, LAYERS)) -> int:
    """The spec's sum over the blocks from ``first`` of the request's global KV, over the
    layers of ``span`` (default: all)."""
    n = REQUESTS[rid][0]
    layers = tuple(
        ref.Layer(
            NAME.format(i=layer), torch.cat(kv, dim=-1).contiguous().view(torch.uint8).numpy()
        )
        for layer, kv in kv_of(rid).items()
        if span[0] <= layer < span[1]
    )
    totals = ref.total(ref.block_checksums(ref.Group(PAGE, layers), n, start=first // PAGE))
    return int(totals.sum(dtype=np.uint64))


def expected_mla_sum(rid: str, first: int) -> int:
    """The spec's sum over the blocks from ``first`` of the request's MLA latent rows."""
    n = REQUESTS[rid][0]
    layers = tuple(
        ref.Layer(NAME.format(i=layer), latent[:, None, :].contiguous().view(torch.uint8).numpy())
        for layer, latent in latent_of(rid).items()
    )
    totals = ref.total(ref.block_checksums(ref.Group(PAGE, layers), n, start=first // PAGE))
    return int(totals.sum(dtype=np.uint64))


def _uint(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned integers of their own width (2 or 4 bytes)."""
    width = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}[tensor.element_size()]
    return tensor.contiguous().view(width[0]).numpy().view(width[1])


def expected_group_sums(rid: str, first: int, kind: str) -> dict[int, int]:
    """The spec's sum per group of a hybrid world's request (pd_world's ``swa`` or
    ``linear``) over the range from ``first``: group 0 layer 0's blocks; ``swa``: group 1
    the window layer's blocks from the window's first page (``max(first, tokens -
    WINDOW)`` rounded down to a page); ``linear``: group 1 the request's Mamba state, each
    global row of its conv and temporal states one slice (spec "State (Mamba) groups")."""
    from pd_world import CONV_GROUPS, STATE_NAME, WINDOW, state_of

    from kvaudit.integrations.sglang.describe import STATE_BLOCK_TOKENS

    n = REQUESTS[rid][0]
    kv = kv_of(rid)

    def attention(layer: int, start: int) -> int:
        cells = torch.cat(kv[layer], dim=-1).contiguous().view(torch.uint8).numpy()
        group = ref.Group(PAGE, (ref.Layer(NAME.format(i=layer), cells),))
        totals = ref.total(ref.block_checksums(group, n, start=start // PAGE))
        return int(totals.sum(dtype=np.uint64))

    sums = {0: attention(0, first)}
    if kind == "swa":
        sums[1] = attention(1, (max(first, n - WINDOW) // PAGE) * PAGE)
        return sums
    conv, temporal = state_of(rid)
    caches = (
        ref.SplitState(
            STATE_NAME.format(i=1, state="conv"),
            (_uint(conv)[None],),
            (0,),
            (tuple((rows, 1) for rows in CONV_GROUPS),),
        ),
        ref.SplitState(
            STATE_NAME.format(i=1, state="temporal"),
            (_uint(temporal)[None],),
            (0,),
            (((temporal.shape[0], 1),),),
        ),
    )
    group = ref.Group(STATE_BLOCK_TOKENS, caches)
    sums[1] = int(ref.total(ref.block_checksums(group, n)).sum(dtype=np.uint64))
    return sums
