"""Write the kvaudit example: one model KV, dumped by a producer at TP=2 and by a consumer
at TP=4 with another layout and other block ids.

    python examples/make_example.py OUT_DIR [--seed N]

The model is a scaled-down Llama: 4 attention layers ``model.layers.{i}.self_attn.attn``,
8 KV heads of head size 128 in bfloat16, block size 16. Three requests of 40, 100 and 257
tokens have their KV drawn from the seed. The producer (a prefill engine, layout ``NTHC``:
blocks, tokens, heads, packed K/V cell, as a contiguous copy of vLLM's NHD order) holds
them in random blocks of its cache at TP=2 and writes
``OUT_DIR/producer/rank{0,1}.safetensors``; the consumer (a decode engine, layout
``KNHTD``) received the same KV into other random blocks at TP=4 and writes
``OUT_DIR/consumer/rank{0..3}.safetensors``. Every other cache slot holds junk, including
the slots past a request's last token, and the two engines' junk differs.

``OUT_DIR/consumer-broken/`` is the consumer with one realistic fault planted: on TP rank 1,
the block that holds tokens 64..79 of ``req-medium`` was reused for another request while
its transfer was in flight, so it holds that request's KV (``kvaudit corrupt`` mode
``stale``); the other ranks are the consumer's own files. The same seed gives
byte-identical files.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvaudit.checksum.checksummer import RequestBlocks
from kvaudit.corrupt import PlantedFault, corrupt_dump
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import WorkerInfo

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
KV_HEADS = 8
HEAD_SIZE = 128
BLOCK_SIZE = 16
REQUESTS = {"req-short": 40, "req-medium": 100, "req-long": 257}
"""Request id to its token count; 257 leaves one token in the last block."""


@dataclass(frozen=True)
class Engine:
    """One engine of the example: its TP size, cache layout and size, and role."""

    name: str
    tp_size: int
    layout: str
    num_blocks: int
    role: str
    engine: str


PRODUCER = Engine("producer", 2, "NTHC", 64, "producer", "vLLM prefill (kvaudit example)")
CONSUMER = Engine("consumer", 4, "KNHTD", 96, "consumer", "vLLM decode (kvaudit example)")


def model_kv(seed: int = 0) -> dict[str, torch.Tensor]:
    """Each request's KV in global form: bfloat16 ``[layers, tokens, heads, 2, head_size]``
    (K then V), drawn from ``seed``."""
    rng = np.random.default_rng([seed, 0])
    result = {}
    for request_id, num_tokens in REQUESTS.items():
        shape = (len(LAYERS), num_tokens, KV_HEADS, 2, HEAD_SIZE)
        values = rng.standard_normal(shape, dtype=np.float32)
        result[request_id] = torch.from_numpy(values).to(torch.bfloat16)
    return result


def block_tables(engine: Engine, rng: np.random.Generator) -> dict[str, list[int]]:
    """Each request's block ids in one engine's cache: distinct, drawn at random."""
    counts = [-(-num_tokens // BLOCK_SIZE) for num_tokens in REQUESTS.values()]
    ids = rng.choice(engine.num_blocks, size=sum(counts), replace=False).tolist()
    tables = {}
    for request_id, count in zip(REQUESTS, counts, strict=True):
        tables[request_id], ids = ids[:count], ids[count:]
    return tables


def description(engine: Engine) -> dict:
    """The cache description of one worker of the engine (heads are per worker)."""
    return {
        "kvaudit": 1,
        "num_blocks": engine.num_blocks,
        "model_kv_heads": KV_HEADS,
        "groups": [
            {
                "id": 0,
                "spec": {
                    "type": "full_attention",
                    "block_size": BLOCK_SIZE,
                    "num_kv_heads": KV_HEADS // engine.tp_size,
                    "head_size": HEAD_SIZE,
                    "dtype": "bfloat16",
                    "layout": engine.layout,
                },
                "layers": list(LAYERS),
            }
        ],
    }


def worker_cache(
    engine: Engine,
    tp_rank: int,
    kv: dict[str, torch.Tensor],
    tables: dict[str, list[int]],
    rng: np.random.Generator,
) -> dict[str, torch.Tensor]:
    """One worker's whole cache per layer, in the engine's layout: junk everywhere, then
    each request's tokens of this rank's heads written into its blocks."""
    heads = KV_HEADS // engine.tp_size
    first_head = tp_rank * heads
    tensors = {}
    for number, layer in enumerate(LAYERS):
        junk = rng.standard_normal(
            (engine.num_blocks, BLOCK_SIZE, heads, 2, HEAD_SIZE), dtype=np.float32
        )
        cache = torch.from_numpy(junk).to(torch.bfloat16)  # N T H K D
        for request_id, values in kv.items():
            tokens = torch.arange(values.shape[1])
            blocks = torch.tensor(tables[request_id])[tokens // BLOCK_SIZE]
            cache[blocks, tokens % BLOCK_SIZE] = values[number, :, first_head : first_head + heads]
        if engine.layout == "NTHC":
            tensors[layer] = cache.reshape(engine.num_blocks, BLOCK_SIZE, heads, 2 * HEAD_SIZE)
        elif engine.layout == "KNHTD":
            tensors[layer] = cache.permute(3, 0, 2, 1, 4).contiguous()
        else:
            raise ValueError(f"the example has no layout {engine.layout}")
    return tensors


def write_engine(out_dir: Path, engine: Engine, kv: dict[str, torch.Tensor], seed: int) -> None:
    """Write one dump per TP rank of the engine into ``out_dir / engine.name``."""
    rng = np.random.default_rng([seed, 1 if engine is PRODUCER else 2])
    tables = block_tables(engine, rng)
    cache_description = parse_description(description(engine), f"example {engine.name}")
    requests = {
        request_id: RequestBlocks(num_tokens, {0: (0, tables[request_id])})
        for request_id, num_tokens in REQUESTS.items()
    }
    folder = out_dir / engine.name
    folder.mkdir(parents=True, exist_ok=True)
    for tp_rank in range(engine.tp_size):
        worker = WorkerInfo(
            tp_rank=tp_rank,
            tp_size=engine.tp_size,
            role=engine.role,
            engine=engine.engine,
        )
        write_dump(
            folder / f"rank{tp_rank}.safetensors",
            cache_description,
            worker_cache(engine, tp_rank, kv, tables, rng),
            requests,
            worker=worker,
        )


BROKEN = {"request_id": "req-medium", "group_id": 0, "position": 4, "mode": "stale"}
"""The fault planted in ``consumer-broken``: a block of ``req-medium`` stale on one rank."""
BROKEN_RANK = 1


def write_broken(root: Path, seed: int) -> PlantedFault:
    """Write ``root / "consumer-broken"``: the consumer's dumps with ``BROKEN`` planted in
    rank ``BROKEN_RANK``'s; returns what ``corrupt_dump`` changed."""
    folder = root / "consumer-broken"
    folder.mkdir(parents=True, exist_ok=True)
    for tp_rank in range(CONSUMER.tp_size):
        name = f"rank{tp_rank}.safetensors"
        if tp_rank != BROKEN_RANK:
            shutil.copyfile(root / CONSUMER.name / name, folder / name)
    name = f"rank{BROKEN_RANK}.safetensors"
    return corrupt_dump(root / CONSUMER.name / name, folder / name, seed=seed, **BROKEN)


def make_example(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the producer, consumer and broken consumer dump sets of ``seed`` under
    ``out_dir``."""
    root = Path(out_dir)
    kv = model_kv(seed)
    for engine in (PRODUCER, CONSUMER):
        write_engine(root, engine, kv, seed)
    write_broken(root, seed)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the dump sets")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model KV and junk")
    args = parser.parse_args(argv)
    root = make_example(args.out_dir, args.seed)
    for path in sorted(root.glob("*/*.safetensors")):
        print(f"{path}  {path.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
