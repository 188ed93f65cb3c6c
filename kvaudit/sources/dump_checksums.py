"""Checksums of a dump set, computed in batches of rows with bounded memory.

Each dump's rows are copied from its file mapping into fixed buffers (on the chosen
device), the mapping's pages dropped right after, and one ``Checksummer`` over the buffers
checksums every requested block whose row the batch holds: memory stays bounded whatever
the dumps' size, and each file is read once, in order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..checksummer import Checksummer
from ..description import LayerEntry
from ..dumps import Dump, DumpSet
from ..dumps.layers import kernel_blocks_per_block, layer_parts, owner_layers
from ..dumps.safetensors_io import as_integers, tensor_nbytes
from ..errors import KvauditError
from ..inputs import RequestBlocks
from ..records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerRecord,
    combine_workers,
)
from ..validation import POSITION_NUMBERINGS, Positions
from .base import Progress
from .raw import request_rows

if TYPE_CHECKING:
    from ..views import LayerTensor

BATCH_BYTES = 64 << 20
"""Dumped bytes ``checksum_dump_set`` reads per batch before dropping the mapped pages."""


def _set_source(dump_set: DumpSet) -> str:
    paths = [dump.path for dump in dump_set.dumps]
    if len(paths) == 1:
        return paths[0]
    try:
        return os.path.commonpath(paths) or "dump set"
    except ValueError:
        return "dump set"


def _selected(dump_set: DumpSet, request_ids: Sequence[str] | None) -> list[str]:
    if request_ids is None:
        return dump_set.request_ids
    ids = list(dict.fromkeys(request_ids))
    for request_id in ids:
        if not any(request_id in dump.requests for dump in dump_set.dumps):
            raise KvauditError(
                f"no dump of the set holds request {request_id!r}", _set_source(dump_set)
            )
    return ids


def total_bytes(dump_set: DumpSet, request_ids: Sequence[str] | None = None) -> int:
    """The dumped bytes ``checksum_dump_set`` goes through for the requests (each listed
    block row of each group, every worker): the total of its ``progress`` calls."""
    ids = _selected(dump_set, request_ids)
    total = 0
    for dump in dump_set.dumps:
        row_bytes = dump.row_bytes()
        for request_id in ids:
            request = dump.requests.get(request_id)
            if request is None:
                continue
            for group_id, (_, block_ids) in request.groups.items():
                total += len(block_ids) * row_bytes[group_id]
    return total


def checksum_dump_set(
    dump_set: DumpSet,
    *,
    request_ids: Sequence[str] | None = None,
    positions: Positions = "request",
    backend: str = "auto",
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
    batch_bytes: int = BATCH_BYTES,
) -> Record:
    """Every worker's checksums of the requests (default: all), summed into a ``Record``.

    Each dump is read in batches of consecutive rows, about ``batch_bytes`` of them:
    copied from the mapping into fixed buffers (on ``device``), the mapping's pages dropped
    right after, then every requested block position whose row the batch holds is
    checksummed. Memory stays bounded whatever the dump's size, and the file is read once,
    in order. ``progress(n)`` is called with the bytes each step covered (an increment;
    ``total_bytes`` gives their sum). An incomplete set gives a record with ``complete``
    False and its missing workers.

    Raises:
        KvauditError: A request no dump holds, an unknown position numbering, or workers
            whose records cannot be summed.

    """
    if positions not in POSITION_NUMBERINGS:
        raise KvauditError(f"unknown position numbering {positions!r}, expected request or block")
    ids = _selected(dump_set, request_ids)
    records = []
    for dump in dump_set.dumps:
        held = [request_id for request_id in ids if request_id in dump.requests]
        batches = _DumpBatches(dump, torch.device(device), backend, batch_bytes)
        records.append(batches.checksum(held, positions, progress))
    return combine_workers(records)


class _DumpBatches:
    """One dump checksummed batch by batch: buffers of ``rows`` consecutive rows of every
    layer tensor, and one ``Checksummer`` over them."""

    def __init__(self, dump: Dump, device: torch.device, backend: str, batch_bytes: int) -> None:
        self.dump = dump
        axes = {
            entry.name: _row_axis(entry)
            for entry in owner_layers(dump.description)
            if entry.name in dump.tensors
        }
        self.axes = axes
        total = sum(
            tensor_nbytes(part) for tensor in dump.tensors.values() for part in layer_parts(tensor)
        )
        row_bytes = total // dump.num_rows if dump.num_rows else 0
        self.rows = max(1, min(dump.num_rows, batch_bytes // max(row_bytes, 1)))
        self.buffers: dict[str, LayerTensor] = {}
        for name, tensor in dump.tensors.items():
            axis, per_row = axes[name]
            buffers = tuple(
                torch.empty(
                    (*part.shape[:axis], self.rows * per_row, *part.shape[axis + 1 :]),
                    dtype=part.dtype,
                    device=device,
                )
                for part in layer_parts(tensor)
            )
            self.buffers[name] = buffers if isinstance(tensor, tuple) else buffers[0]
        worker = dump.worker
        self.checksummer = Checksummer(
            dump.description,
            self.buffers,
            tp_rank=worker.tp_rank,
            tp_size=worker.tp_size,
            pp_rank=worker.pp_rank,
            pp_size=worker.pp_size,
            role=worker.role,
            backend=backend,
            num_blocks=self.rows,
            engine=worker.engine,
            source=dump.path,
        )

    def load(self, first: int, count: int) -> None:
        """Copy rows ``first .. first + count - 1`` of every tensor into the buffers,
        dropping the mapped pages after each tensor."""
        for name, tensor in self.dump.tensors.items():
            axis, per_row = self.axes[name]
            for part, buffer in zip(
                layer_parts(tensor), layer_parts(self.buffers[name]), strict=True
            ):
                as_integers(buffer.narrow(axis, 0, count * per_row)).copy_(
                    as_integers(part.narrow(axis, first * per_row, count * per_row))
                )
                self.dump.drop_pages()

    def checksum(
        self,
        request_ids: Sequence[str],
        positions: Positions,
        progress: Progress | None,
    ) -> WorkerRecord:
        """The worker's record of the requests."""
        checksummer = self.checksummer
        blocks = request_rows(self.dump, request_ids)
        group_bytes = self.dump.row_bytes()
        record = checksummer.checksum({}, positions)
        # Every listed position of a covered group: its (request, group) key, its index
        # in the group's list and its row.
        keys: list[tuple[str, int, int]] = []
        values: list[np.ndarray] = []
        rows: list[int] = []
        key_of: list[int] = []
        index_of: list[int] = []
        for request_id, request in blocks.items():
            record.requests[request_id] = RequestChecksums(request.num_tokens)
            for group_id, (start, group_rows) in request.groups.items():
                plan = checksummer.plans.get(group_id)
                if plan is None:
                    if progress is not None and group_rows and group_bytes[group_id]:
                        progress(len(group_rows) * group_bytes[group_id])
                    continue
                key = len(keys)
                keys.append((request_id, group_id, start))
                values.append(np.zeros((len(group_rows), len(plan.replica_keys)), np.uint64))
                rows.extend(group_rows)
                key_of.extend([key] * len(group_rows))
                index_of.extend(range(len(group_rows)))
        row_array = np.asarray(rows, dtype=np.int64)
        order = np.argsort(row_array, kind="stable")
        sorted_rows = row_array[order]
        done = 0
        while done < len(order):
            first = int(sorted_rows[done])
            end = int(np.searchsorted(sorted_rows, first + self.rows, side="left"))
            self.load(first, int(sorted_rows[end - 1]) - first + 1)
            batch = sorted(order[done:end].tolist(), key=lambda n: (key_of[n], index_of[n]))
            runs = _runs(batch, key_of, index_of)
            requests = {}
            for number, (key, index, members) in enumerate(runs):
                request_id, group_id, start = keys[key]
                requests[str(number)] = RequestBlocks(
                    blocks[request_id].num_tokens,
                    {group_id: (start + index, [rows[n] - first for n in members])},
                )
            result = checksummer.checksum(requests, positions)
            covered = 0
            for number, (key, index, members) in enumerate(runs):
                group_id = keys[key][1]
                group = result.requests[str(number)].groups[group_id]
                values[key][index : index + len(members)] = group.values
                covered += len(members) * group_bytes[group_id]
            if progress is not None and covered:
                progress(covered)
            done = end
        for key, (request_id, group_id, start) in enumerate(keys):
            views = checksummer.groups[group_id]
            record.requests[request_id].groups[group_id] = GroupChecksums(
                block_size=views.group.block_size,
                start=start,
                replica_keys=list(checksummer.plans[group_id].replica_keys),
                values=values[key],
                fingerprint=views.fingerprint,
            )
        return record


def _runs(
    batch: Sequence[int], key_of: Sequence[int], index_of: Sequence[int]
) -> list[tuple[int, int, list[int]]]:
    """Entries sorted by key and index, cut into runs of consecutive positions of one key:
    ``(key, first index, entries)``."""
    runs: list[tuple[int, int, list[int]]] = []
    for n in batch:
        if runs:
            key, index, members = runs[-1]
            if key == key_of[n] and index + len(members) == index_of[n]:
                members.append(n)
                continue
        runs.append((key_of[n], index_of[n], [n]))
    return runs


def _row_axis(entry: LayerEntry) -> tuple[int, int]:
    """The axis of a layer's tensor that holds the rows, and its entries per row."""
    if entry.spec.is_state:
        return 0, 1
    return entry.spec.layout.index("N"), kernel_blocks_per_block(entry.spec)
