"""The dump sets the benchmarks write: one engine's TP workers of Llama-shaped layers
(16-token blocks, 8 KV heads x 128, bf16, NTHC), eight requests over the blocks in a
random order. The writer never holds the data: every layer is a view, at its own offset,
of one random buffer of a layer's size."""

from __future__ import annotations

import os
from typing import Literal

BLOCK_SIZE, HEADS, CELL = 16, 8, 256  # bf16 cell: K and V rows of 128
BLOCK_BYTES = BLOCK_SIZE * HEADS * CELL * 2
REQUESTS = 8
SHIFT = 32  # elements (64 bytes) between the layers' views of the buffer


def description(layers: int, num_blocks: int) -> dict:
    """The cache description of ``layers`` such layers of ``num_blocks`` blocks."""
    spec = {
        "type": "full_attention",
        "block_size": BLOCK_SIZE,
        "num_kv_heads": HEADS,
        "head_size": CELL // 2,
        "dtype": "bfloat16",
        "layout": "NTHC",
    }
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    return {"kvaudit": 1, "num_blocks": num_blocks, "groups": [{"spec": spec, "layers": names}]}


def write_llama_set(
    folder: str,
    size_gib: float,
    workers: int,
    *,
    layer_bytes: int = 64 << 20,
    role: str = "producer",
    seed: int = 0,
    values: Literal["bits", "normal"] = "bits",
    requests: int = REQUESTS,
) -> int:
    """Write the set's ``rank{r}.safetensors`` into ``folder``; returns its bytes.
    ``values="bits"`` fills the buffer with random bit patterns, ``"normal"`` with normal
    values (no NaN or Inf, as a comparison by value wants); ``requests`` requests share
    the blocks."""
    import torch

    from kvaudit.checksum.checksummer import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.dumps import write_dump
    from kvaudit.records import WorkerInfo

    layers = max(1, int(size_gib * (1 << 30)) // workers // layer_bytes)
    num_blocks = layer_bytes // BLOCK_BYTES
    desc = parse_description(description(layers, num_blocks), "bench")
    generator = torch.Generator().manual_seed(seed)
    elements = layer_bytes // 2 + (layers + workers) * SHIFT
    if values == "normal":
        base = torch.randn(elements, generator=generator).to(torch.bfloat16)
    else:
        base = torch.randint(
            -(2**15), 2**15, (elements,), dtype=torch.int16, generator=generator
        ).view(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    per_request = max(1, num_blocks // requests)
    held = {
        f"req-{i}": RequestBlocks(
            per_request * BLOCK_SIZE - 5, {0: (0, order[i * per_request : (i + 1) * per_request])}
        )
        for i in range(min(requests, num_blocks))
    }
    for rank in range(workers):
        tensors = {
            f"model.layers.{i}.self_attn.attn": base[
                (i + rank) * SHIFT : (i + rank) * SHIFT + layer_bytes // 2
            ].view(num_blocks, BLOCK_SIZE, HEADS, CELL)
            for i in range(layers)
        }
        write_dump(
            os.path.join(folder, f"rank{rank}.safetensors"),
            desc,
            tensors,
            held,
            worker=WorkerInfo(rank, workers, 0, 1, role, "bench"),
        )
    return workers * layers * layer_bytes
