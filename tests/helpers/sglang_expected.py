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
