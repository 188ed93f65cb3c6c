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
from ..records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerRecord,
    combine_workers,
)
from ..scheme import valid_tokens
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
    layer tensor, and one ``Checksummer`` over them whose plans each batch's rows are fed
    to directly (a request's positions land wherever its rows fall)."""

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
        order = np.argsort(row, kind="stable")
        sorted_rows = row[order]
        done = 0
        while done < len(order):
            first = int(sorted_rows[done])
            end = int(np.searchsorted(sorted_rows, first + self.rows, side="left"))
            self.load(first, int(sorted_rows[end - 1]) - first + 1)
            batch = order[done:end]
            # Queue every group's launch before reading any back: one wait per batch.
            launched = []
            for group_id in dict.fromkeys(group[batch].tolist()):
                members = batch[group[batch] == group_id]
                out = self.launch(
                    group_id, row[members] - first, position[members], tokens[members], positions
                )
                launched.append((group_id, members, out))
            covered = 0
            for group_id, members, out in launched:
                values[group_id][slot[members]] = out.cpu().numpy().view(np.uint64)
                covered += len(members) * group_bytes[group_id]
            if progress is not None and covered:
                progress(covered)
            done = end
        for request_id, group_id, start, first_slot, count in entries.keys:
            views = checksummer.groups[group_id]
            record.requests[request_id].groups[group_id] = GroupChecksums(
                block_size=views.group.block_size,
                start=start,
                replica_keys=list(checksummer.plans[group_id].replica_keys),
                values=values[group_id][first_slot : first_slot + count].copy(),
                fingerprint=views.fingerprint,
            )
        return record

    def launch(
        self,
        group_id: int,
        rows: np.ndarray,
        block_positions: np.ndarray,
        num_tokens: np.ndarray,
        positions: Positions,
    ) -> torch.Tensor:
        """Queue the checksums of buffer ``rows`` holding a group's blocks at request
        ``block_positions`` of requests of ``num_tokens`` tokens; ``[rows, replica keys]``
        int64 on the plan's device."""
        plan = self.checksummer.plans[group_id]
        block_size = self.checksummer.groups[group_id].group.block_size
        first_tokens = block_positions * block_size
        if positions == "block":
            first_tokens = np.zeros_like(first_tokens)
        valid = valid_tokens(num_tokens, block_size, block_positions)
        table = torch.from_numpy(np.stack([rows, first_tokens, valid]).astype(np.int64))
        if plan.device.type == "cuda":
            table = table.pin_memory()
        ids, firsts, counts = table.to(plan.device, non_blocking=True)
        return plan.checksum(ids, firsts, counts)


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


def _row_axis(entry: LayerEntry) -> tuple[int, int]:
    """The axis of a layer's tensor that holds the rows, and its entries per row."""
    if entry.spec.is_state:
        return 0, 1
    return entry.spec.layout.index("N"), kernel_blocks_per_block(entry.spec)
