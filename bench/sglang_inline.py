"""Per-request cost of kvaudit's SGLang inline check, against SGLang's own digest and a copy.

    python bench/sglang_inline.py [--device cpu] [--tokens 2048] [--tp 2] [--page-size 16]

One prefill rank's part of a Llama-3.1-8B-shaped request (32 layers, 8 KV heads of 128
bf16 over ``--tp`` ranks) in an SGLang ``MHATokenToKVPool``'s buffers: per layer a K and a
V tensor of ``[slots + page_size, local heads, 128]``, the request's pages scattered among
others, as SGLang's paged allocator hands them out. Timed, the median of ``--repeats``:

(a) what kvaudit's hook computes for the request (``inline``: the pages of the request's
    ``req_to_token`` row checksummed by ``Checksummer`` over the pool's ``NTHD`` page
    views, the per-block values summed), through the same description
    ``describe_sglang_cache`` gives of such a pool (tests/sglang/test_describe.py checks
    it against SGLang's real pool);
(b) on the CPU, SGLang's own digest of the same pages: Adler-32 buffer by buffer, page by
    page (``KvChecksumComputer``'s order), with zlib's C ``adler32`` (SGLang computes it
    with a CUDA kernel only; zlib is the same function on the CPU);
(c) a gather of the same pages into one buffer (``index_select``: the read-and-write
    bandwidth baseline).

The ratios (a)/(b) and (a)/(c) are the result (this machine's noise cancels out); it
checks that (a) equals a second run on the same pages. The gloo all-gather of one uint64
per rank that follows (a) on a TP>1 prefill is not timed here. Runs without SGLang (the
tensors are built by hand in SGLang's shapes), so that ``bench/gpu.py`` runs it too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvaudit.checksum.checksummer import Checksummer
from kvaudit.description import parse_description
from kvaudit.views.inputs import RequestBlocks

HEADS, HEAD_DIM = 8, 128
NAME = "model.layers.{i}.self_attn.attn"


def pool_buffers(
    layers: int, heads: int, pages: int, page_size: int, device: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V buffers ``[pages * page_size, heads, HEAD_DIM]`` per layer (page 0 is the
    padding page), random bf16 bits."""
    gen = torch.Generator().manual_seed(0)

    def one() -> torch.Tensor:
        bits = torch.randint(-(2**15), 2**15, (pages * page_size, heads, HEAD_DIM),
                             dtype=torch.int16, generator=gen)  # fmt: skip
        return bits.view(torch.bfloat16).to(device)

    return [one() for _ in range(layers)], [one() for _ in range(layers)]


def description(layers: int, heads: int, tp: int, pages: int, page_size: int) -> dict:
    """What ``describe_sglang_cache`` gives of TP rank 0's ``MHATokenToKVPool``."""
    spec = {"type": "full_attention", "block_size": page_size, "kernel_block_size": page_size,
            "num_kv_heads": heads, "head_size": HEAD_DIM, "head_size_v": HEAD_DIM,
            "dtype": "bfloat16", "layout": "NTHD"}  # fmt: skip
    return {
        "kvaudit": 1,
        "num_blocks": pages,
        "model_kv_heads": HEADS,
        "groups": [
            {
                "id": 0,
                "transfer": True,
                "host_resident": False,
                "spec": spec,
                "layers": [NAME.format(i=i) for i in range(layers)],
            }
        ],
    }


def median_ms(run: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    run()
    sync()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def measure(
    device: str, tokens: int, tp: int, page_size: int, layers: int = 32, repeats: int = 10
) -> dict[str, float]:
    """Times in ms of (a), (b) (CPU only) and (c), and the request's bytes on the rank."""
    heads = HEADS // tp
    request_pages = -(-tokens // page_size)
    pages = 1 + 2 * request_pages
    k, v = pool_buffers(layers, heads, pages, page_size, device)
    raw = description(layers, heads, tp, pages, page_size)
    caches = {
        NAME.format(i=i): (
            k[i].view(pages, page_size, heads, HEAD_DIM),
            v[i].view(pages, page_size, heads, HEAD_DIM),
        )
        for i in range(layers)
    }
    summer = Checksummer(parse_description(raw, "bench"), caches, tp_size=tp, role="producer")
    ids = (torch.randperm(pages - 1, generator=torch.Generator().manual_seed(1)) + 1)[
        :request_pages
    ]
    page_list = ids.tolist()
    blocks = RequestBlocks(tokens, {0: (0, page_list)})

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def kvaudit_sum() -> int:
        record = summer.checksum({"r": blocks})
        return int(record.requests["r"].groups[0].values.sum(dtype="uint64"))

    index = ids.to(device)

    def gather() -> None:
        for buffer in (*k, *v):
            buffer.view(pages, page_size, heads, HEAD_DIM).index_select(0, index)

    result = {
        "kvaudit_ms": median_ms(kvaudit_sum, repeats, sync),
        "copy_ms": median_ms(gather, repeats, sync),
        "request_mib": request_pages * page_size * heads * HEAD_DIM * 2 * 2 * layers / 2**20,
        "agree": float(kvaudit_sum() == kvaudit_sum()),
    }
    if device == "cpu":
        item = page_size * heads * HEAD_DIM * 2
        raws = [b.view(torch.uint8).reshape(-1).numpy() for b in (*k, *v)]

        def adler() -> int:
            value = 1
            for buffer in raws:
                for page in page_list:
                    value = zlib.adler32(buffer[page * item : (page + 1) * item], value)
            return value

        result["adler_ms"] = median_ms(adler, repeats, sync)
    return result


def report(result: dict[str, float], device: str, tokens: int, tp: int, page_size: int) -> str:
    mib = result["request_mib"]
    lines = [
        f"SGLang inline check, {device}, one {tokens}-token Llama-3.1-8B-shaped request on a "
        f"TP={tp} rank ({mib:.0f} MiB of KV, {page_size}-token pages):",
        f"  (a) kvaudit's checksum   {result['kvaudit_ms']:8.2f} ms  "
        f"{mib / 1024 / result['kvaudit_ms'] * 1000:6.2f} GiB/s",
    ]
    if "adler_ms" in result:
        lines.append(
            f"  (b) Adler-32 (zlib)      {result['adler_ms']:8.2f} ms  "
            f"{mib / 1024 / result['adler_ms'] * 1000:6.2f} GiB/s   (a)/(b) "
            f"{result['kvaudit_ms'] / result['adler_ms']:.2f}x"
        )
    lines.append(
        f"  (c) gather of the pages  {result['copy_ms']:8.2f} ms  "
        f"{mib / 1024 / result['copy_ms'] * 1000:6.2f} GiB/s   (a)/(c) "
        f"{result['kvaudit_ms'] / result['copy_ms']:.2f}x"
    )
    lines.append("  (a) repeated: same value" if result["agree"] else "  (a) DISAGREES")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--tp", type=int, default=2, choices=(1, 2, 4, 8))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    result = measure(args.device, args.tokens, args.tp, args.page_size, args.layers, args.repeats)
    print(report(result, args.device, args.tokens, args.tp, args.page_size))
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
