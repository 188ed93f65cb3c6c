"""What layer sums cost an in-engine audit: time per block and bytes per record line, with
and without them, in one run.

    python bench/layer_sums.py [--layers 32] [--tokens 2048] [--repeats 5] [--device cpu]

A Llama-shaped cache (8 KV heads, head size 128, bf16, 16-token blocks, ``--layers``
layers) holds one request of ``--tokens`` tokens in random block order. For each layout
(``KNTHD``: K and V planes apart, one part each; ``NHTC``: whole K-then-V cells, which
layer sums split into a K and a V part) and backend (on the CPU the numpy backend with its
C loop, and torch; on CUDA Triton), it times, alternating, medians of ``--repeats``:

- the request's checksums (``Checksummer.checksum``: what a step of the vLLM connector or
  a SGLang hook computes for it), per block;
- its checksum line (``kvaudit.output_folders.checksum_line``: what the worker writes
  once per request), and the line's bytes;

each with layer sums off and on, and the ratios (on / off).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.description import parse_description
from kvaudit.output_folders import checksum_line

HEADS, HEAD_SIZE, BLOCK = 8, 128, 16


def cache(layout: str, layers: int, blocks: int, device: str) -> tuple[dict, dict]:
    """A description and random bf16 tensors of ``layers`` layers in ``layout``."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    shape = {
        "KNTHD": (2, blocks, BLOCK, HEADS, HEAD_SIZE),
        "NHTC": (blocks, HEADS, BLOCK, 2 * HEAD_SIZE),
    }[layout]
    tensors = {
        name: torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device=device).view(
            torch.bfloat16
        )
        for name in names
    }
    spec = {
        "type": "full_attention",
        "block_size": BLOCK,
        "num_kv_heads": HEADS,
        "head_size": HEAD_SIZE,
        "dtype": "bfloat16",
        "layout": layout,
    }
    description = {
        "kvaudit": 1,
        "num_blocks": blocks,
        "groups": [{"id": 0, "spec": spec, "layers": names}],
    }
    return description, tensors


def median_seconds(work: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """The median wall time of ``work`` over ``repeats`` runs (after one warm-up)."""
    work()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Time and size each layout and backend with layer sums off and on."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--backends", nargs="+", help="default: numpy and torch on the CPU, triton on CUDA"
    )
    args = parser.parse_args()
    blocks = -(-args.tokens // BLOCK)
    cuda = args.device.startswith("cuda")
    backends = args.backends or (["triton"] if cuda else ["numpy", "torch"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    order = torch.randperm(blocks).tolist()
    request = {"r": RequestBlocks(args.tokens, {0: (0, order)})}
    print(
        f"{args.layers} layers x {HEADS} KV heads x head size {HEAD_SIZE} bf16, one request "
        f"of {args.tokens} tokens ({blocks} blocks of {BLOCK}), {args.device}, "
        f"medians of {args.repeats}"
    )
    header = (
        f"{'layout':7} {'backend':7} {'us/block off':>12} {'on':>8} {'ratio':>6} | "
        f"{'line bytes off':>14} {'on':>8} {'ratio':>6} | {'line ms off':>11} {'on':>6} "
        f"{'ratio':>6}"
    )
    print(header)
    for layout in ("KNTHD", "NHTC"):
        description, tensors = cache(layout, args.layers, blocks, args.device)
        parsed = parse_description(description, "bench")
        for backend in backends:
            summers = {
                flag: Checksummer(
                    parsed, tensors, role="producer", backend=backend, layer_sums=flag
                )
                for flag in (False, True)
            }
            for summer in summers.values():
                summer.checksum(request)  # warm up
            sync()
            times: dict[bool, list[float]] = {flag: [] for flag in summers}
            # Alternate off and on, each first in turn, so that both see the same load.
            for repeat in range(args.repeats):
                for flag in (False, True) if repeat % 2 else (True, False):
                    start = time.perf_counter()
                    summers[flag].checksum(request)
                    sync()
                    times[flag].append(time.perf_counter() - start)
            records = {flag: summer.checksum(request) for flag, summer in summers.items()}
            lines = {
                flag: checksum_line(record, record.requests["r"], "r", "producer")
                for flag, record in records.items()
            }
            line_seconds = {
                flag: median_seconds(
                    lambda r=record: checksum_line(r, r.requests["r"], "r", "producer"),
                    args.repeats,
                    lambda: None,
                )
                for flag, record in records.items()
            }
            per_block = {flag: statistics.median(times[flag]) / blocks * 1e6 for flag in times}
            size = {flag: len(line) for flag, line in lines.items()}
            print(
                f"{layout:7} {backend:7} {per_block[False]:12.1f} {per_block[True]:8.1f} "
                f"{per_block[True] / per_block[False]:6.2f} | {size[False]:14d} {size[True]:8d} "
                f"{size[True] / size[False]:6.1f} | {line_seconds[False] * 1e3:11.3f} "
                f"{line_seconds[True] * 1e3:6.3f} {line_seconds[True] / line_seconds[False]:6.2f}"
            )
    print(
        f"layer sums add {2 * args.layers} words per block ({2 * args.layers * 8} bytes; "
        f"about {2 * args.layers * 8 * 4 // 3} bytes of base64 in a line)"
    )


if __name__ == "__main__":
    main()
