"""Output folders written by kvaudit's own writers, as an engine's workers write them
(``kvaudit.output_folders``: the description, the marker, checksum lines; dumps by
``kvaudit.dumps.write_dump`` at ``output.dump_path``), from engines of known KV: what the
output-folder, source and command-line tests share. A byte may be flipped in a worker's
cache before it is checksummed and dumped, at a place the test knows (``Flip``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers import kvbuild as kb
from kvaudit import output_folders as output
from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.description import parse_description
from kvaudit.dumps import write_dump
from kvaudit.records import WorkerInfo

LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(2))
HEADS = 4
BLOCK = 16
MODEL = kb.Model(
    (kb.GroupModel(0, tuple(kb.Attn(name, HEADS) for name in LAYERS), BLOCK, layout="NHTC"),)
)
TOKENS = {"r1": 37, "r2": 20, "r3": 33}
CELL_BYTES = 2 * 8 * 2  # K then V rows of head size 8, bf16


@dataclass(frozen=True)
class Flip:
    """One byte flipped in a request's KV: its layer, global KV head, request position
    (token) and byte of the token's cell (K row then V row)."""

    request: str
    layer: str
    head: int
    token: int
    byte: int

    @property
    def position(self) -> int:
        """The block position that holds the token."""
        return self.token // BLOCK


def token_ids(request: str) -> list[int]:
    """The prompt's token ids of a request of ``TOKENS`` (distinct per request)."""
    index = list(TOKENS).index(request)
    return [1000 * (index + 1) + t for t in range(TOKENS[request])]


def write_folder(
    folder: Path,
    role: str,
    *,
    tp_size: int = 1,
    seed: int = 5,
    names: Mapping[str, str] | None = None,
    dumped: Collection[str] = (),
    prompts: bool = True,
    flip: Flip | None = None,
    requests: Collection[str] | None = None,
    engine: str | None = None,
    layer_sums: bool = False,
) -> list[kb.Worker]:
    """Write an engine's output folder: every worker's description and one checksum line
    per request (``requests``, default all of ``TOKENS``, in order), and a dump per
    worker of each request in ``dumped``.

    ``names`` gives a request the id its engine names it by (default its own);
    ``prompts`` writes each line's prompt digest; ``flip`` changes a byte of the KV
    first (on the worker that holds its head); ``layer_sums`` writes each block's layer
    sums in the lines, as the engine integrations do by default.
    """
    chosen = list(TOKENS) if requests is None else list(requests)
    kv = {
        rid: kb.make_request(MODEL, TOKENS[rid], list(TOKENS).index(rid), tp_size) for rid in chosen
    }
    workers = kb.build_engine(MODEL, kv, kb.Engine(tp_size=tp_size, seed=seed))
    engine = engine or f"test {role}"
    names = dict(names or {})
    if flip is not None:
        _flip(workers, flip, tp_size)
    for worker in workers:
        description = parse_description(worker.description, "w")
        info = WorkerInfo(worker.tp_rank, tp_size, 0, 1, role, engine)
        output.write_description(folder, worker.description, info)
        summer = Checksummer.of_worker(description, worker.tensors, info, layer_sums=layer_sums)
        lines = []
        for rid in chosen:
            num_tokens, groups = worker.requests[rid]
            blocks = RequestBlocks(num_tokens, dict(groups))
            record = summer.checksum({rid: blocks})
            name = names.get(rid, rid)
            digest = output.prompt_digest(token_ids(rid)) if prompts else None
            lines.append(output.checksum_line(record, record.requests[rid], name, role, digest))
            if rid in dumped:
                path = output.dump_path(folder, name, 0, worker.tp_rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_dump(path, description, worker.tensors, {name: blocks}, worker=info)
        output.append_checksums(folder, lines, info)
    return workers


def _flip(workers: list[kb.Worker], flip: Flip, tp_size: int) -> None:
    """Flip the byte in the worker that holds the head (heads split evenly over TP)."""
    local = HEADS // tp_size
    worker = workers[flip.head // local]
    _, groups = worker.requests[flip.request]
    start, block_ids = groups[0]
    block = block_ids[flip.position - start]
    cells = worker.tensors[flip.layer].view(torch.uint8)
    cells[block, flip.head % local, flip.token % BLOCK, flip.byte] ^= 0x10
