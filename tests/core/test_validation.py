"""The shared checks of user input: roles, ranks, an engine's worker layout, messages."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvaudit.checksum.checksummer import Checksummer
from kvaudit.core.errors import DescriptionError, KvauditError
from kvaudit.core.validation import Checker, check_worker, is_int, short, worker_layout
from kvaudit.description import parse_description
from kvaudit.records import WorkerInfo


def workers(tp_size: int, pp_size: int) -> list[WorkerInfo]:
    return [
        WorkerInfo(tp, tp_size, pp, pp_size, "consumer", source=f"pp{pp}tp{tp}")
        for pp, tp in itertools.product(range(pp_size), range(tp_size))
    ]


def test_a_full_layout_misses_nothing_and_a_partial_one_lists_the_gaps() -> None:
    full = workers(3, 2)
    assert worker_layout(full) == []
    partial = [w for w in full if (w.pp_rank, w.tp_rank) not in {(0, 2), (1, 0)}]
    assert worker_layout(partial[::-1]) == [(0, 2), (1, 0)]


def test_layout_errors_name_the_workers() -> None:
    twice = [*workers(2, 1), WorkerInfo(1, 2, 0, 1, "consumer", source="again")]
    with pytest.raises(KvauditError) as caught:
        worker_layout(twice)
    assert str(caught.value) == "again: same worker (pp_rank 0, tp_rank 1) as pp0tp1"

    sizes = [*workers(2, 1), WorkerInfo(2, 4, 0, 1, "consumer", source="wide")]
    with pytest.raises(KvauditError, match=r"^wide: tp_size 4, but pp0tp0 has tp_size 2"):
        worker_layout(sizes)

    out_of_range = [WorkerInfo(0, 1, 3, 2, source="far")]
    with pytest.raises(KvauditError, match=r"^far: pp_rank: 3 is not in 0\.\.1$"):
        worker_layout(out_of_range)

    nameless = [WorkerInfo(0, 1), WorkerInfo(0, 1)]
    with pytest.raises(KvauditError, match="worker pp_rank=0 tp_rank=0: same worker"):
        worker_layout(nameless)


@pytest.mark.parametrize(
    ("worker", "role", "message"),
    [
        (
            WorkerInfo(0, 1),
            "boss",
            'f.st: w.role: expected one of producer, consumer, offload, got "boss"',
        ),
        (WorkerInfo(2, 2), "producer", "f.st: w.tp_rank: 2 is not in 0..1"),
        (WorkerInfo(0, 2, -1, 1), "offload", "f.st: w.pp_rank: -1 is not in 0..0"),
    ],
)
def test_check_worker_names_the_source_and_key(worker: WorkerInfo, role: str, message: str) -> None:
    with pytest.raises(KvauditError) as caught:
        check_worker(worker, role, "f.st", "w")
    assert str(caught.value) == message
    check_worker(WorkerInfo(1, 2, 0, 1), "offload", "f.st", "w")


def test_the_checksummer_rejects_what_a_dump_rejects() -> None:
    description = parse_description(
        {
            "kvaudit": 1,
            "num_blocks": 2,
            "groups": [
                {
                    "spec": {
                        "type": "mamba",
                        "block_size": 4,
                        "shapes": [[2]],
                        "dtypes": ["uint8"],
                    },
                    "layers": ["m"],
                }
            ],
        },
        "d",
    )
    with pytest.raises(KvauditError, match=r"^live: tp_rank: 4 is not in 0\.\.3$"):
        Checksummer(description, {}, tp_rank=4, tp_size=4, source="live")
    with pytest.raises(KvauditError, match=r"^role: expected one of producer, consumer, offload"):
        Checksummer(description, {}, role="observer")  # type: ignore[arg-type]


def test_messages_keep_values_short_and_errors_typed() -> None:
    assert short("x" * 100) == '"' + "x" * 56 + "..."
    assert len(short(list(range(100)), 40)) == 40
    assert short(object).startswith("<class")
    assert is_int(3) and is_int(np.int64(3)) and not is_int(True) and not is_int(3.0)

    class YamlChecker(Checker):
        error = DescriptionError

    with pytest.raises(DescriptionError) as caught:
        YamlChecker("d.yaml").fail("groups[0].id", "expected an integer")
    assert str(caught.value) == "d.yaml: groups[0].id: expected an integer"
    with pytest.raises(KvauditError) as caught:
        Checker("r.json").fail("", "not a record")
    assert str(caught.value) == "r.json: not a record"
