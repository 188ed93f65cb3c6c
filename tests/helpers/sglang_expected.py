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
