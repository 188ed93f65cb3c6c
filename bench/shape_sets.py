"""The dump sets of ``bench/cli.py``'s shape table: one engine's dumps of full-attention
layers (16-token blocks, bf16, NTHC) of a given head size, layer count and file count,
their blocks shared by requests of a given length in a random order.

A cell is one token's K and V rows of one head: ``2 * head_size`` bf16 values, so 512
bytes at head size 128 and 256 at 64 (64 and 32 pieces of 8 bytes). Files are TP ranks
of one engine, each with the same layers and requests over its own rows. Like
``llama_set``, the writer never holds the data: every layer is a view, at its own offset,
of one random buffer of a layer's size.

    python bench/shape_sets.py SHAPE FOLDER [--gib 4]   # write one shape's set
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from llama_set import REQUESTS, write_llama_set

BLOCK_SIZE = 16
SHIFT = 32  # elements (64 bytes) between the layers' views of the buffer
SHORT = 5  # each request's last block is partly filled: this many tokens short
LLAMA_LAYER_BYTES = 64 << 20  # write_llama_set's layers


@dataclass(frozen=True)
class Shape:
    """One shape of the table; ``tokens`` None for ``llama_set``'s own set (its requests
    and layer count)."""

    key: str
    head_size: int
    files: int
    layers: int = 8
    heads: int = 8
    tokens: int | None = None
    """Tokens of each request (the requests' count follows from the size)."""

    def cell_bytes(self) -> int:
        return 2 * self.head_size * 2

    def token_bytes(self) -> int:
        """Bytes one token takes in one file (every layer and head)."""
        return self.layers * self.heads * self.cell_bytes()


SHAPES = {
    shape.key: shape
    for shape in (
        Shape("a", 128, 1),  # llama_set: 64 layers of 64 MiB at 4 GiB, 8 requests
        Shape("b", 128, 2),  # the same in 2 files
        Shape("c", 64, 1, tokens=8192),  # few long requests (32 at 4 GiB)
        Shape("d", 64, 1, tokens=256),  # many short ones (1024 at 4 GiB)
        Shape("e", 64, 4, tokens=2048),  # in 4 files (32 requests each at 4 GiB)
    )
}


def describe(shape: Shape, size_gib: float) -> str:
    """The shape's line in the table: its layout, requests and cell."""
    if shape.tokens is None:
        layers = max(1, int(size_gib * (1 << 30)) // shape.files // LLAMA_LAYER_BYTES)
        return (
            f"llama_set: {layers} layers x {shape.heads} heads x {shape.head_size}, "
            f"{REQUESTS} requests, {shape.files} file(s) ({shape.cell_bytes()} B cells)"
        )
    requests = _requests(shape, size_gib)
    return (
        f"{shape.layers} layers x {shape.heads} heads x {shape.head_size}, {requests} "
        f"requests of {shape.tokens} tokens, {shape.files} file(s) "
        f"({shape.cell_bytes()} B cells)"
    )


def _requests(shape: Shape, size_gib: float) -> int:
    assert shape.tokens is not None
    per_file = int(size_gib * (1 << 30)) // shape.files
    return max(1, per_file // (shape.tokens * shape.token_bytes()))


def write_shape_set(folder: str, shape: Shape, size_gib: float) -> list[str]:
    """Write the shape's set of about ``size_gib`` into ``folder`` (created); its files."""
    os.makedirs(folder)
    if shape.tokens is None:
        write_llama_set(folder, size_gib, shape.files)
    else:
        _write(folder, shape, size_gib)
    return [os.path.join(folder, f"rank{rank}.safetensors") for rank in range(shape.files)]


def _write(folder: str, shape: Shape, size_gib: float) -> None:
    import torch

    from kvaudit.checksum.checksummer import RequestBlocks
    from kvaudit.description import parse_description
    from kvaudit.dumps import write_dump
    from kvaudit.records import WorkerInfo

    assert shape.tokens is not None
    requests = _requests(shape, size_gib)
    per_request = -(-shape.tokens // BLOCK_SIZE)
    num_blocks = requests * per_request
    cell = 2 * shape.head_size
    spec = {
        "type": "full_attention",
        "block_size": BLOCK_SIZE,
        "num_kv_heads": shape.heads,
        "head_size": shape.head_size,
        "dtype": "bfloat16",
        "layout": "NTHC",
    }
    names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
    raw = {"kvaudit": 1, "num_blocks": num_blocks, "groups": [{"spec": spec, "layers": names}]}
    desc = parse_description(raw, "bench")
    generator = torch.Generator().manual_seed(0)
    layer_elements = num_blocks * BLOCK_SIZE * shape.heads * cell
    elements = layer_elements + (shape.layers + shape.files) * SHIFT
    base = torch.randint(-(2**15), 2**15, (elements,), dtype=torch.int16, generator=generator).view(
        torch.bfloat16
    )
    order = torch.randperm(num_blocks, generator=generator).tolist()
    held = {
        f"req-{i}": RequestBlocks(
            shape.tokens - SHORT, {0: (0, order[i * per_request : (i + 1) * per_request])}
        )
        for i in range(requests)
    }
    for rank in range(shape.files):
        tensors = {
            name: base[(i + rank) * SHIFT : (i + rank) * SHIFT + layer_elements].view(
                num_blocks, BLOCK_SIZE, shape.heads, cell
            )
            for i, name in enumerate(names)
        }
        write_dump(
            os.path.join(folder, f"rank{rank}.safetensors"),
            desc,
            tensors,
            held,
            worker=WorkerInfo(rank, shape.files, 0, 1, "producer", "bench"),
        )


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="Write one shape's dump set of bench/cli.py's shape table (to profile it)."
    )
    parser.add_argument("shape", choices=sorted(SHAPES), help="the shape's key")
    parser.add_argument("folder", help="the folder written (it must not exist)")
    parser.add_argument("--gib", type=float, default=4.0, help="the set's size in GiB")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    print(describe(shape, args.gib))
    for path in write_shape_set(args.folder, shape, args.gib):
        print(path)


if __name__ == "__main__":
    main()
