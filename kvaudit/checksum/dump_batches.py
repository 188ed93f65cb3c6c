"""One dump checksummed batch by batch of consecutive rows: what every way of reading the
rows shares (``DumpBatches``), and the CPU's way, in place (``MappedBatches``).

Every listed position of a covered group is sorted by row; each batch is the positions
whose rows lie within ``rows`` consecutive rows, one launch per group of the checksummer's
plans, each row with its request position and valid tokens. The values land at their
positions, so the result is exactly that of a checksummer over the whole dump.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..core.scheme import valid_tokens
from ..core.validation import Positions
from ..description import LayerEntry
from ..dumps import Dump
from ..dumps.layers import kernel_blocks_per_block, layer_groups, layer_parts
from ..dumps.safetensors_io import tensor_nbytes
from ..records import GroupChecksums, RequestChecksums, WorkerRecord
from ..workers.protocol import Progress, request_rows
from .checksummer import Checksummer

if TYPE_CHECKING:
    from ..core.arrays import Array


def batch_rows(dump: Dump, batch_bytes: int) -> int:
    """Consecutive rows of a dump that make about ``batch_bytes`` (per group space: a
    row of every layer, as the staging buffers hold them)."""
    if isinstance(dump.num_rows, int):
        total = sum(
            tensor_nbytes(part)
            for tensor in dump.layer_arrays.values()
            for part in layer_parts(tensor)
        )
        row_bytes = total // dump.num_rows if dump.num_rows else 0
        return max(1, min(dump.num_rows, batch_bytes // max(row_bytes, 1)))
    groups = layer_groups(dump.description)
    row_bytes = 0
    for name, tensor in dump.layer_arrays.items():
        rows = dump.space(groups[name]).num_rows
        row_bytes += sum(tensor_nbytes(part) for part in layer_parts(tensor)) // max(rows, 1)
    return max(1, min(dump.max_rows(), batch_bytes // max(row_bytes, 1)))


Table = tuple[int, np.ndarray]
"""One group's rows of a batch: its id and ``[3, n]`` int64 dump rows, first tokens and
valid tokens."""
Finish = Callable[[list["Array"], list["np.ndarray | None"]], None]
"""What takes a batch's ``[rows, replica keys]`` values, one per table, on the host, and
the strong lane's (None where a plan computes none)."""


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
        """Checksum the tables' rows, all within dump rows ``first .. first + count - 1``
        (of one row space: the tables' groups share it), and pass their values to
        ``done``, now or by ``drain``."""

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
        strong: dict[int, np.ndarray | None] = {
            gid: np.zeros_like(group_values) if checksummer.strong_lane else None
            for gid, group_values in values.items()
        }
        # Groups with rows of their own (a dump listing blocks per group) are read space
        # by space; otherwise every group shares one space and the file is read once.
        spaces: dict[int, list[int]] = {}
        for group_id in entries.counts:
            spaces.setdefault(id(self.dump.space(group_id)), []).append(group_id)
        for members_of_space in spaces.values():
            in_space = np.flatnonzero(np.isin(group, members_of_space))
            columns = (row, group, position, tokens, slot)
            self._batches(in_space, columns, (values, strong), positions, progress, group_bytes)
        self.drain()
        for request_id, group_id, start, first_slot, count in entries.keys:
            views = checksummer.groups[group_id]
            record.requests[request_id].groups[group_id] = GroupChecksums(
                block_size=views.group.block_size,
                start=start,
                replica_keys=list(checksummer.plans[group_id].replica_keys),
                values=values[group_id][first_slot : first_slot + count].copy(),
                fingerprint=views.fingerprint,
                strong=_slots(strong[group_id], first_slot, count),
            )
        return record

    def _batches(
        self,
        selected: np.ndarray,
        columns: tuple[np.ndarray, ...],
        lanes: tuple[dict[int, np.ndarray], dict[int, np.ndarray | None]],
        positions: Positions,
        progress: Progress | None,
        group_bytes: dict[int, int],
    ) -> None:
        """Submit the ``selected`` entries (of one row space) batch by batch in row order,
        their values landing in ``lanes`` (the seed lane's, the strong lane's; a group's
        strong entry becomes None once a plan gives none) at their slots."""
        row, group, position, tokens, slot = columns
        values, strong = lanes
        order = selected[np.argsort(row[selected], kind="stable")]
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
                outs: list[Array], strong_outs: list[np.ndarray | None], members: list = members
            ) -> None:
                covered = 0
                for (group_id, m), out, strong_out in zip(members, outs, strong_outs, strict=True):
                    host = out if isinstance(out, np.ndarray) else out.cpu().numpy()
                    values[group_id][slot[m]] = host.view(np.uint64)
                    group_strong = strong[group_id]
                    if group_strong is not None and strong_out is None:
                        strong[group_id] = None
                    elif group_strong is not None and strong_out is not None:
                        group_strong[slot[m]] = strong_out
                    covered += len(m) * group_bytes[group_id]
                if progress is not None and covered:
                    progress(covered)

            self.submit(first, int(sorted_rows[end - 1]) - first + 1, tables, finish)
            done = end

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
        outs = [plans[group_id].checksum(*table) for group_id, table in tables]
        done(outs, strong_lanes(self.checksummer, tables))
        self.dump.drop_pages()

    def drain(self) -> None:
        """Nothing to wait for: each batch is done when submitted."""


def strong_lanes(checksummer: Checksummer, tables: list[Table]) -> list[np.ndarray | None]:
    """The strong lane of each table's rows (None for all when the checksummer computes
    the seed lane alone)."""
    if not checksummer.strong_lane:
        return [None] * len(tables)
    return [checksummer.plans[group_id].strong(*table) for group_id, table in tables]


def _slots(strong: np.ndarray | None, first: int, count: int) -> np.ndarray | None:
    """A group's strong values of ``count`` slots from ``first`` (None without them)."""
    return None if strong is None else strong[first : first + count].copy()


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
