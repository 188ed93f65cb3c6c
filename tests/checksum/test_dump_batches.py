"""How a dump's batches are read changes nothing in its checksums: the CPU path in place,
the torch path through device buffers, and the pipelined turn-taking of two buffer sets
that CUDA uses, run here on the CPU with batches of a few rows."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.dumped_sets import Sets

from kvaudit.checksum import checksum_dump_set
from kvaudit.checksum.dump_staging import StagedBatches
from kvaudit.compare import compare_records
from kvaudit.core.validation import Positions
from kvaudit.dumps import open_dump_set
from kvaudit.formats import record_to_json


@pytest.mark.parametrize("positions", ["request", "block"])
def test_every_way_of_reading_batches_gives_the_same_record(
    sets: Sets, positions: Positions
) -> None:
    dump_set = open_dump_set(sets.consumer.paths)
    whole = record_to_json(checksum_dump_set(dump_set, positions=positions, batch_bytes=1 << 40))
    small = 3000  # a few rows per batch: many batches, runs cut at their edges
    in_place = checksum_dump_set(dump_set, positions=positions, batch_bytes=small)
    torch_path = checksum_dump_set(
        dump_set, positions=positions, backend="torch", batch_bytes=small
    )
    assert record_to_json(in_place) == whole
    assert record_to_json(torch_path) == whole
    for dump in dump_set.dumps:
        one = checksum_dump_set(
            open_dump_set([dump.path]), positions=positions, batch_bytes=1 << 40
        )
        pipelined = StagedBatches(dump, "cpu", "torch", small, slots=2)
        assert len(pipelined.slots) == 2 and pipelined.turn == 0
        record = pipelined.checksum(sorted(dump.requests), positions, None)
        assert pipelined.turn > 2, "the two buffer sets never took turns"
        assert set(record.requests) == set(one.requests)
        for request_id, request in record.requests.items():
            for group_id, group in request.groups.items():
                expected = one.requests[request_id].groups[group_id]
                assert group.values.tolist() == expected.values.tolist()
                assert group.strong is not None and expected.strong is not None
                assert group.strong.tolist() == expected.strong.tolist()


def test_both_lanes_of_dumps_agree_across_layouts_and_block_sizes(sets: Sets) -> None:
    """The producer's dumps (TP=2 PP=2, block size 16) and the consumer's (TP=4, block
    size 4, other layouts) of the same KV match in both lanes: the strong lane is summed
    over workers and coarsened over block sizes modulo its prime."""
    producer = checksum_dump_set(open_dump_set(sets.producer.paths), positions="request")
    consumer = checksum_dump_set(open_dump_set(sets.consumer.paths), positions="request")
    for record in (producer, consumer):
        assert all(
            group.strong is not None
            for request in record.requests.values()
            for group in request.groups.values()
        )
    report = compare_records(producer, consumer)
    assert report.ok and report.compared and not report.warnings
    assert all(group.seed_lane_only is None for _, _, group in report.groups())


def test_the_cpu_path_reads_dumps_without_torch(sets: Sets) -> None:
    code = (
        "import sys\n"
        "from kvaudit.dumps import open_dump_set\n"
        "from kvaudit.checksum import checksum_dump_set\n"
        f"record = checksum_dump_set(open_dump_set({sets.producer.paths!r}), batch_bytes=3000)\n"
        "assert record.requests\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
