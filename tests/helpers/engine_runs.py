"""Engines built by ``kvbuild``, checksummed worker by worker and compared with the
reference: the helpers the engine tests share (torch CPU and Triton, dumps and CLI)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helpers import kvbuild as kb
from helpers import reference as ref
from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.description import parse_description
from kvaudit.records import Record, combine_workers

L0 = "model.layers.0.self_attn.attn"
L1 = "model.layers.1.self_attn.attn"
L2 = "model.layers.2.self_attn.attn"
L3 = "model.layers.3.self_attn.attn"
INDEXER3 = "model.layers.3.self_attn.indexer.k_cache"
MIXER = "model.layers.{}.mixer"

ALL_LAYOUTS = ("NTHC", "NHTC", "KNTHD", "KNHTD", "NKTHD", "NKHTD", "NTHD", "NHTD")


def attn_model(
    heads: int = 4,
    layers: int = 2,
    head_size: int = 8,
    dtype: str = "bfloat16",
    block_size: int = 8,
    layout: str = "NTHC",
    model_kv_heads: int | None = None,
    **attn: object,
) -> kb.Model:
    """One attention group of ``layers`` identical layers."""
    caches = tuple(
        kb.Attn(f"model.layers.{i}.self_attn.attn", heads, head_size, dtype=dtype, **attn)
        for i in range(layers)
    )
    return kb.Model((kb.GroupModel(0, caches, block_size, layout=layout),), model_kv_heads)


BACKEND = "torch"
"""The backend ``checksummers`` uses by default (test modules parametrize it)."""


def checksummers(
    workers: list[kb.Worker], role: str = "consumer", backend: str | None = None
) -> list[Checksummer]:
    """One checksummer per worker (on ``BACKEND`` unless ``backend`` names one)."""
    return [
        Checksummer(
            parse_description(w.description, source=f"worker pp{w.pp_rank} tp{w.tp_rank}"),
            w.tensors,
            tp_rank=w.tp_rank,
            tp_size=w.tp_size,
            pp_rank=w.pp_rank,
            pp_size=w.pp_size,
            role=role,
            backend=backend or BACKEND,
        )
        for w in workers
    ]


def request_blocks(worker: kb.Worker) -> dict[str, RequestBlocks]:
    return {
        rid: RequestBlocks(num_tokens=n, groups=dict(groups))
        for rid, (n, groups) in worker.requests.items()
    }


def run(
    workers: list[kb.Worker],
    role: str = "consumer",
    positions: str = "request",
    sums: list[Checksummer] | None = None,
) -> Record:
    """Every worker's checksums of its requests, summed over workers."""
    sums = sums or checksummers(workers, role)
    records = [
        cs.checksum(request_blocks(w), positions=positions)
        for cs, w in zip(sums, workers, strict=True)
    ]
    return combine_workers(records)


def columns(record: Record, rid: str, gid: int) -> dict[tuple[int, int], np.ndarray]:
    group = record.requests[rid].groups[gid]
    values = np.asarray(group.values, dtype=np.uint64)
    return {tuple(key): values[:, k] for k, key in enumerate(group.replica_keys)}


def expected(
    model: kb.Model,
    gid: int,
    requests: dict[str, kb.RequestKV],
    workers: list[kb.Worker],
    rid: str,
    tp_size: int,
    positions: str = "request",
    block_size: int | None = None,
) -> dict[int, np.ndarray]:
    """The reference's values of one request's listed positions, per replica class."""
    start, ids = workers[0].requests[rid][1][gid]
    group = kb.reference_group(model, gid, requests[rid], tp_size, block_size)
    return ref.block_checksums(group, requests[rid].num_tokens, start, len(ids), positions)


def assert_matches(
    record: Record,
    model: kb.Model,
    gid: int,
    requests: dict[str, kb.RequestKV],
    workers: list[kb.Worker],
    tp_size: int,
    role: str = "consumer",
    positions: str = "request",
    block_size: int | None = None,
) -> None:
    """Each replica key's column equals the reference of its class; a consumer has every
    replica index of each class, a producer only index 0."""
    for rid in requests:
        if gid not in record.requests[rid].groups:
            reasons = {w.not_covered.get(gid) for w in record.workers}
            pytest.fail(f"request {rid} group {gid} was not checksummed: {reasons}")
        want = expected(model, gid, requests, workers, rid, tp_size, positions, block_size)
        got = columns(record, rid, gid)
        group = record.requests[rid].groups[gid]
        assert group.start == workers[0].requests[rid][1][gid][0]
        if role == "producer":
            keys = {(r, 0) for r in want}
        else:
            keys = {(r, i) for r in want for i in range(r)}
        assert set(got) == keys, (rid, sorted(got), sorted(keys))
        if any(
            ref.valid_tokens(requests[rid].num_tokens, group.block_size, group.start + i)
            for i in range(group.count)
        ):
            assert any(values.any() for values in want.values()), "a trivial comparison"
        for (r, _), values in got.items():
            np.testing.assert_array_equal(values, want[r], err_msg=f"{rid} key {r}")
        np.testing.assert_array_equal(group.totals(), ref.total(want, group.count))
        assert group.strong is not None, "the strong lane is missing"
        start, ids = workers[0].requests[rid][1][gid]
        reference_group = kb.reference_group(model, gid, requests[rid], tp_size, block_size)
        strong_want = ref.strong_block_checksums(
            reference_group, requests[rid].num_tokens, start, len(ids), positions
        )
        for k, (r, _) in enumerate(group.replica_keys):
            got_strong = [int(v) for v in group.strong[:, k]]
            assert got_strong == strong_want[r], f"{rid} strong lane, key {r}"


def build(
    model: kb.Model,
    engine: kb.Engine,
    tokens: dict[str, int] | int = 29,
    seed: int = 1,
    positions: dict[str, dict[int, tuple[int, int]]] | None = None,
) -> tuple[dict[str, kb.RequestKV], list[kb.Worker]]:
    if isinstance(tokens, int):
        tokens = {"req-1": tokens}
    requests = {
        rid: kb.make_request(model, n, seed + i, engine.tp_size)
        for i, (rid, n) in enumerate(tokens.items())
    }
    return requests, kb.build_engine(model, requests, engine, positions)


def check(
    model: kb.Model,
    engine: kb.Engine,
    tokens: dict[str, int] | int = 29,
    role: str = "consumer",
    positions: str = "request",
    gids: tuple[int, ...] = (0,),
    seed: int = 1,
) -> Record:
    """Build, run and compare with the reference; the record for further checks."""
    requests, workers = build(model, engine, tokens, seed)
    record = run(workers, role, positions)
    for gid in gids:
        block_size = engine.block_size(model.group(gid))
        assert_matches(
            record, model, gid, requests, workers, engine.tp_size, role, positions, block_size
        )
    return record


def mamba_model(
    tp_replicated: bool = False,
    checksummed: int | None = None,
    split: bool = False,
    numbers: tuple[int, int] = (1, 3),
) -> kb.Model:
    if split:
        layer = kb.Mamba(
            MIXER.format(numbers[0]),
            shapes=((3, 24), (8, 4, 2)),
            dtypes=("bfloat16", "float32"),
            splits=((1, ((16, 8), (4, 1), (4, 1))), (0, ((8, 8),))),
            page_pad=12,
        )
    else:
        layer = kb.Mamba(
            MIXER.format(numbers[0]),
            shapes=((3, 8), (2, 4, 4), (5,)),
            dtypes=("bfloat16", "float32", "float16"),
            checksummed_states=checksummed,
            tp_replicated=tp_replicated,
        )
    second = dataclasses.replace(layer, name=MIXER.format(numbers[1]))
    return kb.Model((kb.GroupModel(0, (layer, second), block_size=8),))
