"""A toy engine for the live tests: one worker's KV cache (CPU or CUDA tensors) with a
step loop that rewrites, frees and reuses blocks, serving a ``kvaudit.live.Agent``.

Run as a process (``python tests/helpers/live_engine.py --socket S ...``): it prints ``ready``
once its agent listens and runs until ``--lifetime`` seconds pass. Its requests:

- ``stable``: 22 tokens of fixed KV, moved to other blocks every few steps (the old
  blocks freed and overwritten with junk);
- ``flip``: 13 tokens whose KV is state A on even steps and state B on odd steps,
  rewritten layer by layer (slowly) during each step;
- ``tmp-N``: a request allocated in free blocks at step N and freed at step N + 1.

The tests import ``model_kv``, ``description`` and ``reference_cache`` to build the
same KV in their own process. ``--fault`` changes one element of ``stable``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np
import torch

LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
KV_HEADS = 4
HEAD_SIZE = 16
BLOCK_SIZE = 4
NUM_BLOCKS = 48
REQUESTS = {"stable": 22, "flip": 13}
FAULT = {"layer": 1, "token": 9, "head": 1}
"""The element ``--fault`` changes: request ``stable``, K of this layer, token, global head."""


def model_kv(request_id: str, state: int = 0, fault: bool = False) -> torch.Tensor:
    """A request's KV in global form: float32 ``[layers, tokens, heads, 2, head_size]``
    (``flip`` has states 0 and 1); ``fault`` changes one element of ``stable``."""
    seed = [sum(map(ord, request_id)), state]
    shape = (len(LAYERS), REQUESTS[request_id], KV_HEADS, 2, HEAD_SIZE)
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))
    if fault and request_id == "stable":
        values[FAULT["layer"], FAULT["token"], FAULT["head"], 0, 3] += 1.0
    return values


def description(tp_size: int, layout: str) -> dict:
    """One worker's cache description (heads per worker)."""
    return {
        "kvaudit": 1,
        "num_blocks": NUM_BLOCKS,
        "model_kv_heads": KV_HEADS,
        "groups": [
            {
                "id": 0,
                "spec": {
                    "type": "full_attention",
                    "block_size": BLOCK_SIZE,
                    "num_kv_heads": KV_HEADS // tp_size,
                    "head_size": HEAD_SIZE,
                    "dtype": "float32",
                    "layout": layout,
                },
                "layers": list(LAYERS),
            }
        ],
    }


def write_request(
    caches: list[torch.Tensor],
    values: torch.Tensor,
    blocks: list[int],
    tp_rank: int,
    tp_size: int,
    pause: float = 0.0,
) -> None:
    """Write a request's KV (global form) into its blocks of every layer's cache ``[N, T,
    H, 2, D]`` (this rank's heads), layer by layer, ``pause`` seconds between layers."""
    heads = KV_HEADS // tp_size
    tokens = torch.arange(values.shape[1])
    rows = torch.tensor(blocks)[tokens // BLOCK_SIZE].to(caches[0].device)
    slots = (tokens % BLOCK_SIZE).to(caches[0].device)
    for number, cache in enumerate(caches):
        part = values[number, :, tp_rank * heads : (tp_rank + 1) * heads]
        cache[rows, slots] = part.to(cache.device)
        if pause:
            time.sleep(pause)


def layer_tensor(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A cache ``[N, T, H, 2, D]`` viewed in the layout the description names (no copy)."""
    if layout == "NTHC":
        return cache.view(cache.shape[0], BLOCK_SIZE, cache.shape[2], 2 * HEAD_SIZE)
    if layout == "KNHTD":
        return cache.permute(3, 0, 2, 1, 4)
    raise ValueError(f"no layout {layout}")


class Engine:
    """The cache and block tables of one worker, and its step."""

    def __init__(self, tp_rank: int, tp_size: int, fault: bool, device: str, seed: int) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.rng = np.random.default_rng(seed)
        heads = KV_HEADS // tp_size
        self.caches = [
            torch.zeros((NUM_BLOCKS, BLOCK_SIZE, heads, 2, HEAD_SIZE), device=device)
            for _ in LAYERS
        ]
        self.stable = model_kv("stable", fault=fault)
        self.flips = [model_kv("flip", 0), model_kv("flip", 1)]
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}
        self.step_number = 0
        self._add("stable", self.stable)
        self._add("flip", self.flips[0])

    def _add(self, request_id: str, values: torch.Tensor) -> None:
        count = -(-values.shape[1] // BLOCK_SIZE)
        self.tables[request_id], self.free = self.free[:count], self.free[count:]
        self.tokens[request_id] = values.shape[1]
        write_request(self.caches, values, self.tables[request_id], self.tp_rank, self.tp_size)

    def _release(self, request_id: str) -> None:
        blocks = self.tables.pop(request_id)
        del self.tokens[request_id]
        for cache in self.caches:
            cache[torch.tensor(blocks, device=cache.device)] = float("nan")
        self.free.extend(blocks)

    def step(self, pause: float) -> None:
        """One step: rewrite ``flip`` in its next state, retire and allocate a ``tmp``
        request, and every third step move ``stable`` to other blocks."""
        self.step_number += 1
        state = self.step_number % 2
        write_request(
            self.caches, self.flips[state], self.tables["flip"], self.tp_rank, self.tp_size, pause
        )
        for request_id in [rid for rid in self.tables if rid.startswith("tmp-")]:
            self._release(request_id)
        junk = torch.from_numpy(
            self.rng.standard_normal((len(LAYERS), 9, KV_HEADS, 2, HEAD_SIZE), dtype=np.float32)
        )
        self._add(f"tmp-{self.step_number}", junk)
        if self.step_number % 3 == 0:
            old = self.tables.pop("stable")
            del self.tokens["stable"]
            self._add("stable", self.stable)
            self.tables["old"], self.tokens["old"] = old, 1
            self._release("old")

    def block_tables(self) -> dict[str, dict]:
        """The requests in the cache now, as the agent lists them."""
        return {
            rid: {"num_tokens": self.tokens[rid], "groups": {0: (0, list(blocks))}}
            for rid, blocks in self.tables.items()
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--layout", default="NTHC")
    parser.add_argument("--role", default="consumer")
    parser.add_argument("--fault", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=("poll", "thread", "stall", "die"), default="poll")
    parser.add_argument("--pause", type=float, default=0.002)
    parser.add_argument("--idle", type=float, default=0.005)
    parser.add_argument("--lifetime", type=float, default=60.0)
    args = parser.parse_args(argv)

    from kvaudit import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.live import Agent

    engine = Engine(args.tp_rank, args.tp_size, args.fault, args.device, 7 + args.tp_rank)
    cache_description = parse_description(description(args.tp_size, args.layout), "engine")
    tensors = {
        name: layer_tensor(cache, args.layout)
        for name, cache in zip(LAYERS, engine.caches, strict=True)
    }

    def tables() -> dict[str, RequestBlocks]:
        return {
            rid: RequestBlocks(entry["num_tokens"], entry["groups"])
            for rid, entry in engine.block_tables().items()
        }

    lock = threading.Lock() if args.mode == "thread" else None
    agent = Agent(
        args.socket,
        cache_description,
        tensors,
        tables,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        role=args.role,
        engine="toy",
        lock=lock,
        timeout=5.0,
    )
    print("ready", flush=True)
    end = time.monotonic() + args.lifetime
    try:
        while time.monotonic() < end:
            if lock is not None:
                with lock:
                    engine.step(args.pause)
                time.sleep(args.idle)
                continue
            engine.step(args.pause)
            time.sleep(args.idle)
            if args.mode == "die" and agent.waiting():
                os._exit(3)
            if args.mode != "stall":
                agent.poll()
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
