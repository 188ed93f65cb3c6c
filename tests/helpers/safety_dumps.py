"""Small and large single-worker dumps for the safety tests: one full-attention layer
(8 KV heads of 128 bf16, block size 16, layout NTHC) whose content is a plain function
of the block, so that a test can name what any block holds."""

from __future__ import annotations

from pathlib import Path

import torch

from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import WorkerInfo

LAYER = "model.layers.0.self_attn.attn"
BLOCK_BYTES = 16 * 8 * 2 * 128 * 2
"""Bytes of one block of the layer."""


def description(num_blocks: int) -> dict:
    return {
        "kvaudit": 1,
        "num_blocks": num_blocks,
        "groups": [
            {
                "id": 0,
                "spec": {
                    "type": "full_attention",
                    "block_size": 16,
                    "num_kv_heads": 8,
                    "head_size": 128,
                    "dtype": "bfloat16",
                    "layout": "NTHC",
                },
                "layers": [LAYER],
            }
        ],
    }


def make_dump(
    path: Path,
    num_blocks: int = 4,
    *,
    request_id: str = "req-a",
    engine: str = "engine",
    role: str = "producer",
) -> Path:
    """A dump of one request over every block of a ``num_blocks`` cache, whole."""
    cache = torch.arange(num_blocks * 16 * 8 * 256, dtype=torch.int32).to(torch.bfloat16)
    cache = cache.reshape(num_blocks, 16, 8, 256)
    requests = {request_id: RequestBlocks(num_blocks * 16, {0: (0, list(range(num_blocks)))})}
    write_dump(
        path,
        parse_description(description(num_blocks), "safety test"),
        {LAYER: cache},
        requests,
        worker=WorkerInfo(tp_rank=0, tp_size=1, role=role, engine=engine),
        whole_cache=True,
    )
    return path
