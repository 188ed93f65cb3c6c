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


def _moments(group: ref.Group, n: int, first: int) -> tuple[int, int, int]:
    """The strong lane's moments ``sum_p (p + 1)**m * S_p`` (m = 0, 1, 2) over the
    blocks ``p`` from ``first``'s, ``S_p`` the block's strong lane over every replica
    class (docs/sglang.md, units of one page), modulo ``2**64 - 59``."""
    start = first // PAGE
    by_class = ref.strong_block_checksums(group, n, start=start)
    prime = ref.STRONG_PRIME
    blocks = [sum(values) % prime for values in zip(*by_class.values(), strict=True)]
    return tuple(  # type: ignore[return-value]
        sum((start + i + 1) ** m * s for i, s in enumerate(blocks)) % prime for m in range(3)
    )


def expected_moments(
    rid: str, first: int, span: tuple[int, int] = (0, LAYERS)
) -> tuple[int, int, int]:
    """The strong lane's moments over the blocks from ``first`` of the request's global
    KV, over the layers of ``span`` (default: all)."""
    layers = tuple(
        ref.Layer(
            NAME.format(i=layer), torch.cat(kv, dim=-1).contiguous().view(torch.uint8).numpy()
        )
        for layer, kv in kv_of(rid).items()
        if span[0] <= layer < span[1]
    )
    return _moments(ref.Group(PAGE, layers), REQUESTS[rid][0], first)


def expected_mla_moments(rid: str, first: int) -> tuple[int, int, int]:
    """The strong lane's moments over the blocks from ``first`` of the MLA latent rows."""
    layers = tuple(
        ref.Layer(NAME.format(i=layer), latent[:, None, :].contiguous().view(torch.uint8).numpy())
        for layer, latent in latent_of(rid).items()
    )
    return _moments(ref.Group(PAGE, layers), REQUESTS[rid][0], first)


def _uint(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's elements as unsigned integers of their own width (2 or 4 bytes)."""
    width = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}[tensor.element_size()]
    return tensor.contiguous().view(width[0]).numpy().view(width[1])


def _hybrid_groups(rid: str, first: int, kind: str) -> dict[int, tuple[ref.Group, int]]:
    """A hybrid world's request (pd_world's ``swa`` or ``linear``) over the range from
    ``first``, per group its reference group and first block: group 0 layer 0's blocks;
    ``swa``: group 1 the window layer's blocks from the window's first page (``max(first,
    tokens - WINDOW)`` rounded down to a page); ``linear``: group 1 the request's Mamba
    state, each global row of its conv and temporal states one slice (spec "State (Mamba)
    groups"), its one block at 0."""
    from pd_world import CONV_GROUPS, STATE_NAME, WINDOW, state_of

    from kvaudit.integrations.sglang.describe import STATE_BLOCK_TOKENS

    n = REQUESTS[rid][0]
    kv = kv_of(rid)

    def attention(layer: int) -> ref.Group:
        cells = torch.cat(kv[layer], dim=-1).contiguous().view(torch.uint8).numpy()
        return ref.Group(PAGE, (ref.Layer(NAME.format(i=layer), cells),))

    groups = {0: (attention(0), first // PAGE)}
    if kind == "swa":
        groups[1] = (attention(1), max(first, n - WINDOW) // PAGE)
        return groups
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
    groups[1] = (ref.Group(STATE_BLOCK_TOKENS, caches), 0)
    return groups


def expected_group_sums(rid: str, first: int, kind: str) -> dict[int, int]:
    """The spec's (seed lane's) sum per group of a hybrid world's request over the range
    from ``first`` (``_hybrid_groups``)."""
    n = REQUESTS[rid][0]
    return {
        g: int(ref.total(ref.block_checksums(group, n, start=start)).sum(dtype=np.uint64))
        for g, (group, start) in _hybrid_groups(rid, first, kind).items()
    }


def expected_hybrid_strong(
    rid: str, first: int, kind: str
) -> tuple[dict[int, int], tuple[int, int, int]]:
    """The strong lane of a hybrid world's request over the range from ``first``
    (``_hybrid_groups``), as the inline check carries it (docs/sglang.md): per group its
    sum modulo ``2**64 - 59``, and the moments ``sum (j + 1)**m * S_j`` over every group's
    blocks, a page's at ``j`` its position, the state's at weight 0 (``m = 0`` only)."""
    n = REQUESTS[rid][0]
    prime = ref.STRONG_PRIME
    sums: dict[int, int] = {}
    moments = [0, 0, 0]
    for g, (group, start) in _hybrid_groups(rid, first, kind).items():
        by_class = ref.strong_block_checksums(group, n, start=start)
        blocks = [sum(values) % prime for values in zip(*by_class.values(), strict=True)]
        sums[g] = sum(blocks) % prime
        state = group.block_size != PAGE
        for i, value in enumerate(blocks):
            x = 0 if state else start + i + 1
            for m in range(3):
                moments[m] = (moments[m] + x**m * value) % prime
    return sums, (moments[0], moments[1], moments[2])
