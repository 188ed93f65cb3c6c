"""The checksums the tests expect, computed from the harness's token KV with the tests'
own numpy reference (tests/helpers/reference.py), never with kvaudit."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from harness import LAYER, token_kv
from helpers import reference as ref


def cells(prompt: Sequence[int], num_tokens: int, layer: int, heads: int, width: int) -> np.ndarray:
    """uint8 ``[num_tokens, heads, cell_bytes]`` of one layer, global heads."""
    return np.stack(
        [
            np.stack(
                [
                    token_kv(prompt[t], t, layer, h, width).view(torch.uint8).numpy()
                    for h in range(heads)
                ]
            )
            for t in range(num_tokens)
        ]
    )


def totals(
    prompt: Sequence[int], num_tokens: int, *, layers: int, heads: int, head_size: int,
    block_size: int, mla: bool = False, tp_size: int = 1, positions: str = "request",
    strong: bool = False,
) -> list[int]:  # fmt: skip
    """The producer totals of a prompt's first ``num_tokens`` tokens, per block position
    (``strong``: the strong lane's, modulo ``2**64 - 59``)."""
    width = head_size if mla else 2 * head_size
    caches = tuple(
        ref.Layer(
            LAYER.format(layer),
            cells(prompt, num_tokens, layer, 1 if mla else heads, width),
            tp_size if mla else 1,
        )
        for layer in range(layers)
    )
    group = ref.Group(block_size, caches)
    if strong:
        by_class = ref.strong_block_checksums(group, num_tokens, positions=positions)
        return [sum(column) % ref.STRONG_PRIME for column in zip(*by_class.values(), strict=True)]
    by_class = ref.block_checksums(group, num_tokens, positions=positions)
    return [int(v) for v in ref.total(by_class)]
