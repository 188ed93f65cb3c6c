"""The shapes engines hold: vLLM's ``kv_caches`` list (tensors in the description's layer
order) and block ids given as Python ints, numpy arrays or torch tensors, for
``Checksummer`` and ``write_dump``; the values are checked against the numpy reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import kvbuild as kb
from helpers import reference as ref

from kvaudit.checksum.checksummer import Checksummer, RequestBlocks
from kvaudit.core.errors import KvauditError
from kvaudit.description import CacheDescription, parse_description
from kvaudit.dumps import open_dump, write_dump
from kvaudit.records import WorkerInfo, combine_workers

L = "model.layers.{}.self_attn.attn"
# Group 0: layers 0 and 2, layer 4 sharing layer 0's cache; group 1: layers 1 and 3.
MODEL = kb.Model(
    (
        kb.GroupModel(
            0, (kb.Attn(L.format(0), 4), kb.Attn(L.format(2), 4), kb.Attn(L.format(4), 4,
                                                                           shares=L.format(0)))
        ),
        kb.GroupModel(1, (kb.Attn(L.format(1), 4), kb.Attn(L.format(3), 4)), 16),
    )
)  # fmt: skip
TOKENS = {"r1": 37, "r2": 9}


def kv_caches_list(worker: kb.Worker) -> list[torch.Tensor]:
    """The worker's tensors as vLLM's list: one per layer of its description dict, group
    by group in the order listed; a sharing layer holds its target's tensor."""
    out = []
    for group in worker.description["groups"]:
        for entry in group["layers"]:
            name = entry if isinstance(entry, str) else entry["name"]
            target = entry.get("shares", name) if isinstance(entry, dict) else name
            out.append(worker.tensors[target])
    return out


def engine(tp_size: int = 2) -> tuple[dict[str, kb.RequestKV], list[kb.Worker]]:
    requests = {
        rid: kb.make_request(MODEL, n, seed, tp_size)
        for seed, (rid, n) in enumerate(TOKENS.items())
    }
    return requests, kb.build_engine(MODEL, requests, kb.Engine(tp_size=tp_size, seed=4))


def expected_totals(requests: dict[str, kb.RequestKV], rid: str, gid: int) -> np.ndarray:
    group = kb.reference_group(MODEL, gid, requests[rid], 2)
    by_class = ref.block_checksums(group, requests[rid].num_tokens)
    return ref.total(by_class)


BLOCK_ID_FORMS = {
    "list": lambda ids: list(ids),
    "numpy int64": lambda ids: np.array(ids, dtype=np.int64),
    "numpy int32": lambda ids: np.array(ids, dtype=np.int32),
    "torch int64": lambda ids: torch.tensor(ids, dtype=torch.int64),
    "torch int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
    "numpy scalars": lambda ids: [np.int64(i) for i in ids],
    "tensor scalars": lambda ids: [torch.tensor(i) for i in ids],
}


def blocks_as(worker: kb.Worker, form: str) -> dict[str, RequestBlocks]:
    convert = BLOCK_ID_FORMS[form]
    return {
        rid: RequestBlocks(n, {gid: (start, convert(ids)) for gid, (start, ids) in groups.items()})
        for rid, (n, groups) in worker.requests.items()
    }


@pytest.mark.parametrize("form", list(BLOCK_ID_FORMS))
def test_checksummer_takes_the_kv_caches_list_and_any_block_id_form(form: str) -> None:
    requests, workers = engine()
    records = []
    for w in workers:
        description = parse_description(w.description, "worker")
        summer = Checksummer(
            description, kv_caches_list(w), tp_rank=w.tp_rank, tp_size=2, role="producer"
        )
        records.append(summer.checksum(blocks_as(w, form)))
    record = combine_workers(records)
    for rid in TOKENS:
        assert record.requests[rid].num_tokens == TOKENS[rid]
        for gid in (0, 1):
            totals = record.requests[rid].groups[gid].totals()
            want = expected_totals(requests, rid, gid)
            assert want.any()
            np.testing.assert_array_equal(totals, want, err_msg=f"{form} {rid} {gid}")


@pytest.mark.parametrize("form", ["torch int64", "numpy int32", "tensor scalars"])
def test_write_dump_takes_the_list_and_tensor_block_ids(form: str, tmp_path: Path) -> None:
    _, workers = engine()
    w = workers[1]
    description = parse_description(w.description, "worker")
    info = WorkerInfo(w.tp_rank, 2, 0, 1, "producer", "t")
    plain = tmp_path / "dict.safetensors"
    write_dump(plain, description, w.tensors, blocks_as(w, "list"), worker=info)
    listed = tmp_path / "list.safetensors"
    write_dump(listed, description, kv_caches_list(w), blocks_as(w, form), worker=info)
    # The same dump, byte for byte, whatever form the engine's inputs had.
    assert listed.read_bytes() == plain.read_bytes()
    dump = open_dump(listed)
    assert {rid: r.num_tokens for rid, r in dump.requests.items()} == TOKENS
    assert dump.requests["r1"].groups[0] == w.requests["r1"][1][0]


def description_of(worker: kb.Worker) -> CacheDescription:
    return parse_description(worker.description, "worker")


@pytest.mark.parametrize(
    ("tensors", "words"),
    [
        (lambda w: kv_caches_list(w)[:-1], "holds 4 tensors, the description has 5 layers"),
        (lambda w: [*kv_caches_list(w), kv_caches_list(w)[0]], "holds 6 tensors"),
        (lambda w: kv_caches_list(w)[0], "got Tensor"),
    ],
)
def test_a_list_that_does_not_fit_is_a_one_line_error(
    tensors: Callable[[kb.Worker], object], words: str
) -> None:
    _, workers = engine()
    w = workers[0]
    with pytest.raises(KvauditError) as caught:
        Checksummer(description_of(w), tensors(w), tp_rank=0, tp_size=2, source="rank0")
    assert words in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).startswith("rank0: ")


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        (torch.tensor([1.0, 2.0]), "1-D integer tensor, got torch.float32"),
        (torch.tensor([[1, 2]]), "shape (1, 2)"),
        (torch.tensor([True]), "torch.bool"),
        (np.array([1.5]), "1-D integer array, got float64"),
        (np.array([[1], [2]]), "shape (2, 1)"),
        (5, "got int"),
        ("12", "got str"),
        ([torch.tensor(1.0)], "not in the cache"),
    ],
)
def test_block_ids_of_the_wrong_kind_are_one_line_errors(ids: object, words: str,
                                                         tmp_path: Path) -> None:  # fmt: skip
    _, workers = engine()
    w = workers[0]
    requests = {"r1": RequestBlocks(5, {0: (0, ids)})}
    summer = Checksummer(description_of(w), w.tensors, tp_rank=0, tp_size=2, source="rank0")
    with pytest.raises(KvauditError) as caught:
        summer.checksum(requests)
    assert words in str(caught.value) and "request r1 group 0" in str(caught.value)
    info = WorkerInfo(0, 2, 0, 1, "producer", "t")
    target = tmp_path / "d.safetensors"
    with pytest.raises(KvauditError) as caught:
        write_dump(target, description_of(w), w.tensors, requests, worker=info)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(str(target))
    assert not target.exists()
