"""One dump checksummed batch by batch of consecutive rows: what every way of reading the
rows shares (``DumpBatches``), and the CPU's way, in place (``MappedBatches``).

Every listed position of a covered group is sorted by row; each batch is the positions
whose rows lie within ``rows`` consecutive rows, one launch per group of the checksummer's
plans, each row with its request position and valid tokens. The values land at their
positions, so the result is exactly that of a checksummer over the whole dump.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..core.scheme import valid_tokens
from ..core.validation import Positions
from ..description import LayerEntry
from ..dumps import Dump
from ..dumps.layers import kernel_blocks_per_block, layer_parts
from ..dumps.safetensors_io import tensor_nbytes
from ..records import GroupChecksums, RequestChecksums, WorkerRecord
from ..sources.base import Progress
from ..sources.raw import request_rows
from .checksummer import Checksummer
from .plans import GroupPlan

if TYPE_CHECKING:
    from ..core.arrays import Array


def batch_rows(dump: Dump, batch_bytes: int) -> int:
    """Consecutive rows of a dump that make about ``batch_bytes``."""
    total = sum(
        tensor_nbytes(part) for tensor in dump.layer_arrays.values() for part in layer_parts(tensor)
    )
    row_bytes = total // dump.num_rows if dump.num_rows else 0
    return max(1, min(dump.num_rows, batch_bytes // max(row_bytes, 1)))


Table = tuple[int, np.ndarray]
"""One group's rows of a batch: its id and ``[3, n]`` int64 dump rows, first tokens and
valid tokens."""
Finish = Callable[[list["Array"], list["np.ndarray | None"]], None]
"""What takes a batch's ``[rows, replica keys]`` values, one per table, on the host, and
the strong lane's residues of the same rows (None where the plan's device has no strong
path)."""


def strong_sums(plan: GroupPlan, table: np.ndarray) -> np.ndarray | None:
    """The strong lane of a table's rows (docs/checksum.md), or None where the plan's
    device has no strong kernel installed: the record then carries the seed lane alone,
    which a comparison says."""
    if plan.device != "cpu" and importlib.util.find_spec(_DEVICE_STRONG) is None:
        return None
    return plan.strong(*table)


_DEVICE_STRONG = "kvaudit.checksum.kernels.triton_strong"
"""The module of the strong lane's device kernel."""


class DumpBatches(ABC):
    """One dump checksummed batch by batch of ``rows`` consecutive rows, each batch's rows
    fed to the group plans directly (a request's positions land wherever its rows fall);
    subclasses say where a batch's rows are read (``submit``)."""

    def __init__(self, dump: Dump, rows: int) -> None:
        self.dump = dump
        self.rows = rows

    @property
    @abstractmethod
    def plans_of(self) -> Checksummer:
        """A checksummer of the dump's layout (for its plans, groups and fingerprints)."""

    @abstractmethod
    def submit(self, first: int, count: int, tables: list[Table], done: Finish) -> None:
        """Checksum the tables' rows, all within dump rows ``first .. first + count - 1``,
        and pass their values to ``done``, now or by ``drain``."""

    @abstractmethod
    def drain(self) -> None:
        """Wait for every submitted batch."""

    def checksum(
        self,
        request_ids: Sequence[str],
        positions: Positions,
        progress: Progress | None,
    ) -> WorkerRecord:
        """The worker's record of the requests."""
        checksummer = self.plans_of
        listed = request_rows(self.dump, request_ids)
        group_bytes = self.dump.row_bytes()
        record = checksummer.checksum({}, positions)
        entries = _Entries()
        for request_id, request in listed.items():
            record.requests[request_id] = RequestChecksums(request.num_tokens)
            for group_id, (start, rows) in request.groups.items():
                if group_id in checksummer.plans:
                    entries.add(request_id, group_id, start, rows, request.num_tokens)
                elif progress is not None and rows and group_bytes[group_id]:
                    progress(len(rows) * group_bytes[group_id])
        row, group, position, tokens, slot = entries.arrays()
        values = {
            gid: np.zeros((count, len(checksummer.plans[gid].replica_keys)), np.uint64)
            for gid, count in entries.counts.items()
        }
        # The strong lane per group, dropped (None) where a batch could not compute it.
        strong: dict[int, np.ndarray | None] = {
            gid: np.zeros_like(array) if checksummer.strong_lane else None
            for gid, array in values.items()
        }
        order = np.argsort(row, kind="stable")
        sorted_rows = row[order]
        done = 0
        while done < len(order):
            first = int(sorted_rows[done])
            end = int(np.searchsorted(sorted_rows, first + self.rows, side="left"))
            batch = order[done:end]
            members = [
                (group_id, batch[group[batch] == group_id])
                for group_id in dict.fromkeys(group[batch].tolist())
            ]
            tables = [
                (group_id, self._table(group_id, row[m], position[m], tokens[m], positions))
                for group_id, m in members
            ]

            def finish(
                outs: list[Array], strongs: list[np.ndarray | None], members: list = members
            ) -> None:
                covered = 0
                for (group_id, m), out, lane in zip(members, outs, strongs, strict=True):
                    host = out if isinstance(out, np.ndarray) else out.cpu().numpy()
                    values[group_id][slot[m]] = host.view(np.uint64)
                    residues = strong[group_id]
                    if lane is None:
                        strong[group_id] = None
                    elif residues is not None:
                        residues[slot[m]] = lane
                    covered += len(m) * group_bytes[group_id]
                if progress is not None and covered:
                    progress(covered)

            self.submit(first, int(sorted_rows[end - 1]) - first + 1, tables, finish)
            done = end
        self.drain()
        for request_id, group_id, start, first_slot, count in entries.keys:
            views = checksummer.groups[group_id]
            record.requests[request_id].groups[group_id] = GroupChecksums(
                block_size=views.group.block_size,
                start=start,
                replica_keys=list(checksummer.plans[group_id].replica_keys),
                values=values[group_id][first_slot : first_slot + count].copy(),
                fingerprint=views.fingerprint,
                strong=_rows_of(strong[group_id], first_slot, count),
            )
        return record

    def _table(
        self,
        group_id: int,
        rows: np.ndarray,
        block_positions: np.ndarray,
        num_tokens: np.ndarray,
        positions: Positions,
    ) -> np.ndarray:
        """A group's dump ``rows`` at request ``block_positions`` of requests of
        ``num_tokens`` tokens as the plans take them: ``[3, n]`` int64 rows, first tokens
        and valid tokens."""
        block_size = self.plans_of.groups[group_id].group.block_size
        first_tokens = block_positions * block_size
        if positions == "block":
            first_tokens = np.zeros_like(first_tokens)
        valid = valid_tokens(num_tokens, block_size, block_positions)
        return np.stack([rows, first_tokens, valid]).astype(np.int64)


def _rows_of(lane: np.ndarray | None, first: int, count: int) -> np.ndarray | None:
    """A copy of ``count`` rows of a group's strong lane from ``first`` (None: none)."""
    return None if lane is None else lane[first : first + count].copy()


class MappedBatches(DumpBatches):
    """The CPU path: one checksummer over the file mapping itself (numpy views), each
    batch read in place and its pages dropped after."""

    def __init__(self, dump: Dump, backend: str, batch_bytes: int) -> None:
        super().__init__(dump, batch_rows(dump, batch_bytes))
        self.checksummer = Checksummer.of_worker(
            dump.description,
            dump.layer_arrays,
            dump.worker,
            backend=backend,
            num_blocks=dump.num_rows,
            source=dump.path,
        )

    @property
    def plans_of(self) -> Checksummer:
        return self.checksummer

    def submit(self, first: int, count: int, tables: list[Table], done: Finish) -> None:
        plans = self.checksummer.plans
        self.dump.check_unchanged()  # a shrunk file would end the read with SIGBUS
        strongs = [
            strong_sums(plans[group_id], table) if self.checksummer.strong_lane else None
            for group_id, table in tables
        ]
        done([plans[group_id].checksum(*table) for group_id, table in tables], strongs)
        self.dump.drop_pages()

    def drain(self) -> None:
        """Nothing to wait for: each batch is done when submitted."""


class _Entries:
    """Every listed position of a covered group, as numpy columns: its dump row, group,
    request position, request token count and slot (its index among its group's
    positions); ``keys`` gives each request's group as ``(request, group, start, first
    slot, count)``."""

    def __init__(self) -> None:
        self.columns: list[list[int]] = [[], [], [], [], []]
        self.counts: dict[int, int] = {}
        self.keys: list[tuple[str, int, int, int, int]] = []

    def add(
        self, request_id: str, group_id: int, start: int, rows: Sequence[int], num_tokens: int
    ) -> None:
        """One request's listed rows of one group, from position ``start``."""
        first_slot = self.counts.get(group_id, 0)
        count = len(rows)
        self.counts[group_id] = first_slot + count
        self.keys.append((request_id, group_id, start, first_slot, count))
        row, group, position, tokens, slot = self.columns
        row.extend(rows)
        group.extend([group_id] * count)
        position.extend(range(start, start + count))
        tokens.extend([num_tokens] * count)
        slot.extend(range(first_slot, first_slot + count))

    def arrays(self) -> list[np.ndarray]:
        """The columns as int64 arrays."""
        return [np.asarray(column, dtype=np.int64) for column in self.columns]


def row_axis(entry: LayerEntry) -> tuple[int, int]:
    """The axis of a layer's tensor that holds the rows, and its entries per row."""
    if entry.spec.is_state:
        return 0, 1
    return entry.spec.layout.index("N"), kernel_blocks_per_block(entry.spec)
