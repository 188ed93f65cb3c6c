"""The strong lane's cost on the CPU against the seed lane's, on the same bytes, in one run.

    python bench/strong_lane.py [--layers 8] [--blocks 1024] [--repeats 5]

A Llama-shaped cache (8 KV heads, head size 128, bf16, 16-token blocks, NHTC) of random
bits. Prints, medians of ``--repeats``:

- the two C loops alone, one thread, one call over every block of one layer:
  ``_row_sums.row_sums`` (the seed lane) and ``_strong_sums.strong_sums`` (the strong
  lane), with numpy's ``sum`` of the same bytes (about memory bandwidth) as a yardstick;
- whole ``Checksummer.checksum`` calls over every layer, seed lane alone
  (``strong_lane=False``) and both lanes, with the ratio.

Ratios are what to read: this machine's absolute rates move with its load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvaudit import Checksummer
from kvaudit.checksum.strong import head_weights, token_weights
from kvaudit.core.native import extension
from kvaudit.description import parse_description
from kvaudit.views.inputs import RequestBlocks

HEADS, HEAD_SIZE, TOKENS = 8, 128, 16


def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``call`` over ``repeats`` runs (after one warm-up)."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def loops(blocks: int, repeats: int) -> None:
    """The two C loops alone on one layer's blocks."""
    seed, strong = extension("kvaudit._native._row_sums"), extension("kvaudit._native._strong_sums")
    if seed is None or strong is None:
        print("C loops: not built (run setup.py build_ext --inplace)")
        return
    pieces = 2 * HEAD_SIZE * 2 // 8
    rng = np.random.default_rng(0)
    x = rng.integers(-(2**63), 2**63 - 1, size=(blocks, 1, HEADS, TOKENS, pieces), dtype=np.int64)
    ids = np.arange(blocks, dtype=np.int64)
    first = ids * TOKENS
    valid = np.full(blocks, TOKENS, dtype=np.int64)
    out = np.empty(blocks, dtype=np.int64)
    ones_pieces = np.ones(HEADS * pieces, dtype=np.int64)
    ones_heads = np.ones(HEADS, dtype=np.int64)
    weights, tokens = head_weights(0, HEADS, 0), token_weights()
    gb = x.nbytes / 1e9
    seed_s = median_seconds(
        lambda: seed.row_sums(x, ids, first, valid, ones_pieces, ones_heads, out), repeats
    )
    strong_s = median_seconds(
        lambda: strong.strong_sums(x, ids, first, valid, weights, tokens, out), repeats
    )
    sum_s = median_seconds(lambda: x.sum(), repeats)
    print(f"C loops, one thread, {gb * 1e3:.0f} MB of one layer:")
    print(f"  numpy sum (yardstick)  {gb / sum_s:6.2f} GB/s")
    print(f"  seed lane              {gb / seed_s:6.2f} GB/s")
    ratio = strong_s / seed_s
    print(f"  strong lane            {gb / strong_s:6.2f} GB/s   x{ratio:.2f} the seed's time")


def checksummers(layers: int, blocks: int, repeats: int) -> None:
    """Whole checksums of every layer, the seed lane alone and both lanes."""
    description = {
        "kvaudit": 1,
        "num_blocks": blocks,
        "groups": [
            {
                "spec": {
                    "type": "full_attention",
                    "block_size": TOKENS,
                    "num_kv_heads": HEADS,
                    "head_size": HEAD_SIZE,
                    "dtype": "bfloat16",
                    "layout": "NHTC",
                },
                "layers": [f"model.layers.{n}.self_attn.attn" for n in range(layers)],
            }
        ],
    }
    generator = torch.Generator().manual_seed(1)
    tensors = {
        f"model.layers.{n}.self_attn.attn": torch.randint(
            -(2**15),
            2**15,
            (blocks, HEADS, TOKENS, 2 * HEAD_SIZE),
            dtype=torch.int16,
            generator=generator,
        ).view(torch.bfloat16)
        for n in range(layers)
    }
    parsed = parse_description(description, "bench")
    request = {"r": RequestBlocks(blocks * TOKENS, {0: (0, list(range(blocks)))})}
    gb = sum(t.numel() * 2 for t in tensors.values()) / 1e9
    seed_only = Checksummer(parsed, tensors, backend="numpy", strong_lane=False)
    both = Checksummer(parsed, tensors, backend="numpy")
    seed_s = median_seconds(lambda: seed_only.checksum(request), repeats)
    both_s = median_seconds(lambda: both.checksum(request), repeats)
    print(f"Checksummer.checksum, {layers} layers, {gb:.2f} GB:")
    print(f"  seed lane alone        {gb / seed_s:6.2f} GB/s")
    print(f"  both lanes             {gb / both_s:6.2f} GB/s   x{both_s / seed_s:.2f} the time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loops(args.blocks, args.repeats)
    checksummers(args.layers, args.blocks, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
