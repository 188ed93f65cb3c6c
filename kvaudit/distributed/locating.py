"""The torchrun runtime's step after a diff: differences located and traced across the
processes. Rank 0 reads the differing blocks of each worker from the process that holds
its dump, which sends only those blocks; tracing exchanges digests (``tracing``).

It is a step of its own, not ``diff_sources``' locating with blocks fetched elsewhere:
every process must take part in each exchange, in the same order, and a failure on one
(a holder that cannot write its blocks, rank 0 failing to locate) must reach all of them
only at the end, where they settle it together, or the others would wait on a send.

For each run of consecutive differing positions, the holder of each worker writes a
small dump (the kvaudit dump format, ``write_dump``) of the request's blocks at those
positions and sends its bytes to rank 0; rank 0 opens it like any dump and locates with
``kvaudit.locate.locate_differences``, as one process does over the whole dumps.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence

from ..compare import DiffReport, shared_tokens
from ..compare.diff import viewed_shapes
from ..compare.trace import partial_note
from ..core.errors import KvauditError
from ..dumps import Dump, open_dump, write_dump
from ..locate import locate_differences
from ..sources import Source
from ..views.inputs import RequestBlocks
from .comm import Comm
from .spread_source import Held, SpreadSource
from .tracing import trace_across

ERROR_MARK = b"E"
DUMP_MARK = b"D"


def _runs(positions: Sequence[int]) -> Iterator[list[int]]:
    """Sorted positions cut into runs of consecutive ones."""
    run: list[int] = []
    for position in positions:
        if run and position != run[-1] + 1:
            yield run
            run = []
        run.append(position)
    if run:
        yield run


def _span(item: Held, request_id: str, group_id: int, run: Sequence[int], block_size: int):
    """The worker's own block positions ``[lo, hi)`` that hold the run's tokens (state
    blocks included), within those it lists; None when it lists none of them."""
    listed = item.requests.get(request_id)
    if listed is None or group_id not in listed.groups:
        return None
    start, block_ids = listed.groups[group_id]
    own = item.block_sizes[group_id]
    first, end = run[0] * block_size, (run[-1] + 1) * block_size
    lo = max(first // own, start)
    hi = min(-(-end // own), start + len(block_ids))
    return (lo, hi) if lo < hi else None


def block_dump(dump: Dump, request_id: str, group_id: int, lo: int, hi: int, path: str) -> bytes:
    """The bytes of a dump of one request's blocks at positions ``lo .. hi - 1`` of one
    group of ``dump``, rows as they are dumped (written to ``path`` and read back)."""
    request = dump.requests[request_id]
    start, block_ids = request.groups[group_id]
    rows = [dump.row_of(block_id, group_id) for block_id in block_ids[lo - start : hi - start]]
    description = dump.rows_description()
    blocks = {request_id: RequestBlocks(request.num_tokens, {group_id: (lo, rows)})}
    write_dump(path, description, dump.tensors, blocks, worker=dump.worker)
    try:
        with open(path, "rb") as handle:
            return handle.read()
    finally:
        os.remove(path)


class _Fetcher:
    """One process's part in fetching blocks: a holder sends, rank 0 receives and opens."""

    def __init__(self, comm: Comm, scratch: str) -> None:
        self.comm = comm
        self.scratch = scratch
        self.count = 0
        self.error: str | None = None
        self.skip = False

    def workers(
        self,
        side: SpreadSource,
        request_id: str,
        group_id: int,
        run: Sequence[int],
        block_size: int,
    ) -> list[Dump]:
        """On rank 0, the dumps holding the run's blocks on every worker of ``side``
        that lists them (its own whole, the others' blocks only); elsewhere, nothing but
        sending this process's."""
        rank = self.comm.place.rank
        found: list[Dump] = []
        for item in side.held:
            span = _span(item, request_id, group_id, run, block_size)
            if span is None:
                continue
            if item.rank == 0:
                if rank == 0:
                    found.append(side.local[item.name])
                continue
            self.count += 1
            path = os.path.join(self.scratch, f"blocks-{item.rank}-{self.count}.safetensors")
            if rank == item.rank:
                self.comm.send_bytes(
                    self._blocks(side.whole[item.name], request_id, group_id, span, path), 0
                )
            elif rank == 0:
                dump = self._receive(item, path)
                if dump is not None:
                    found.append(dump)
        return found

    def _blocks(
        self, dump: Dump, request_id: str, group_id: int, span: tuple[int, int], path: str
    ) -> bytes:
        try:
            return DUMP_MARK + block_dump(dump, request_id, group_id, *span, path)
        except KvauditError as error:
            self.error = self.error or str(error)
            return ERROR_MARK + str(error).encode()

    def _receive(self, item: Held, path: str) -> Dump | None:
        data = self.comm.recv_bytes(item.rank)
        if data[:1] != DUMP_MARK:
            self.skip = True  # the holder reports its own error when all settle
            return None
        with open(path, "wb") as handle:
            handle.write(data[1:])
        # Named as its holder names the dump, so that located entries name the real file.
        return dataclasses.replace(open_dump(path), path=item.name)


def _locate_fetched(
    report: DiffReport,
    producer: SpreadSource,
    consumer: SpreadSource,
    num_tokens: Mapping[str, int],
) -> None:
    """Fill each differing group's ``located`` on rank 0, as ``kvaudit.compare``'s
    ``locate_report`` does in one process; every process takes part.

    Raises:
        KvauditError: On every process, when a holder could not send its blocks.

    """
    comm = producer.comm
    with tempfile.TemporaryDirectory(prefix="kvaudit-blocks-") as scratch:
        fetcher = _Fetcher(comm, scratch)
        for request_id, gid, group in report.groups():
            positions = {*group.mismatched_positions, *(p for p, _, _ in group.replica_mismatches)}
            if not positions or request_id not in num_tokens:
                continue
            located = []
            for run in _runs(sorted(positions)):
                sides = [
                    fetcher.workers(side, request_id, gid, run, group.block_size)
                    for side in (producer, consumer)
                ]
                if comm.place.rank == 0 and fetcher.error is None and not fetcher.skip:
                    shape = viewed_shapes([*sides[0], *sides[1]]).get(gid)
                    if shape is not None:
                        group.layers, group.heads = shape
                    try:
                        located.extend(
                            locate_differences(
                                *sides,
                                request_id,
                                gid,
                                run,
                                group.block_size,
                                num_tokens[request_id],
                            )
                        )
                    except KvauditError as error:
                        fetcher.error = str(error)
            if comm.place.rank == 0:
                group.located = located

        def settled() -> None:
            if fetcher.error is not None:
                raise KvauditError(fetcher.error)

        comm.outcomes(settled)


def locate_across(
    report: DiffReport,
    producer: Source,
    consumer: Source,
    request_ids: Sequence[str] | None,
    locate: bool | None,
) -> None:
    """Locate the report's differences and trace them to the producer blocks they hold,
    as ``diff --locate`` does in one process, reading blocks from the processes that hold
    them (``locate``: None when both sides are dumps, True required, False never).

    Raises:
        KvauditError: ``locate=True`` with a side that holds only checksums.

    """
    if locate is False:
        return
    if not (isinstance(producer, SpreadSource) and isinstance(consumer, SpreadSource)):
        side = consumer if isinstance(producer, SpreadSource) else producer
        names = ", ".join(side.names)
        if side.raw_kv() is None:
            where = f"{names} is a {side.kind} that holds only checksums, not the KV"
            needs = "the raw KV on both sides"
        else:
            where = (
                f"{names} is a {side.kind} source, which is not spread over torchrun's "
                "processes: run the diff in one process to locate"
            )
            needs = "dumps on both sides under torchrun"
        if locate:
            raise KvauditError(f"--locate needs {needs}; {where}")
        if report.untraced is not None:  # diff_sources traced by checksums, saying why
            report.untraced = partial_note(where)
        return
    shared = shared_tokens(producer, consumer, request_ids)
    consumed = consumer.trimmed(shared)
    _locate_fetched(report, producer.trimmed(shared), consumed, shared)
    # The bytes decide now, as in one process: the checksums' trace is dropped.
    report.untraced = None
    for _, _, group in report.groups():
        group.stale_sources = {}
    trace_across(report, producer, consumed, shared)


__all__ = ["block_dump", "locate_across"]
