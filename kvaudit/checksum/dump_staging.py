"""The torch path of a dump's batches (a GPU, or ``backend="torch"``): rows copied into
fixed buffers on the device, on CUDA through two pinned host buffers that take turns, so
that filling one overlaps the copy to the device and the checksums of the other."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..dumps import Dump
from ..dumps.layers import layer_groups, layer_parts, owner_layers
from ..dumps.safetensors_io import as_integers
from .checksummer import Checksummer
from .dump_batches import DumpBatches, Finish, Table, batch_rows, row_axis, strong_lanes
from .plans import launch_torch

if TYPE_CHECKING:
    import torch

    from ..core.arrays import Array
    from ..views import LayerTensor


_ALIGN = 256
"""Bytes each layer's buffers are aligned to within a slot's one allocation (the kernel's
aligned variant wants 16)."""


class StagedBatches(DumpBatches):
    """The torch path (a GPU, or ``--backend torch``): each batch copied into fixed
    buffers on the device, one checksummer per buffer set. With two sets (on CUDA) they
    take turns: rows are copied into one set's pinned host buffers while the GPU copies
    and checksums the other set. A batch goes to the device in one copy, on a copy stream
    that its checksums wait for; all of it is queued from the calling thread, which waits
    only when a set comes round again."""

    def __init__(
        self, dump: Dump, device: str, backend: str, batch_bytes: int, slots: int | None = None
    ) -> None:
        import torch

        super().__init__(dump, batch_rows(dump, batch_bytes))
        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.axes = {
            entry.name: row_axis(entry)
            for entry in owner_layers(dump.description)
            if entry.name in dump.layer_arrays
        }
        with warnings.catch_warnings():
            # The mapping is read-only and torch has no read-only tensors; nothing writes it.
            warnings.simplefilter("ignore", UserWarning)
            self.sources = {
                name: tuple(torch.from_numpy(part) for part in layer_parts(array))
                for name, array in dump.layer_arrays.items()
            }
        self.groups = layer_groups(dump.description)
        count = slots if slots is not None else (2 if self.cuda else 1)
        self.slots = [self._slot(backend) for _ in range(count)]
        self.turn = 0
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None

    def _slot(self, backend: str) -> _Slot:
        """A set of device buffers of ``rows`` rows, views of one allocation; their host
        buffers, views of one pinned allocation laid out alike (on CUDA; elsewhere the
        device buffers themselves); and a checksummer over them."""
        torch = self.torch
        placed: list[tuple[str, int, tuple[int, ...], torch.dtype]] = []
        size = 0
        for name, tensor in self.dump.tensors.items():
            axis, per_row = self.axes[name]
            for part in layer_parts(tensor):
                shape = (*part.shape[:axis], self.rows * per_row, *part.shape[axis + 1 :])
                placed.append((name, size, shape, part.dtype))
                size += -(-math.prod(shape) * part.dtype.itemsize // _ALIGN) * _ALIGN
        device_bytes = torch.empty(size, dtype=torch.uint8, device=self.device)
        host_bytes = (
            torch.empty(size, dtype=torch.uint8, pin_memory=True) if self.cuda else device_bytes
        )
        device_parts: dict[str, list[torch.Tensor]] = {name: [] for name in self.dump.tensors}
        host_parts: dict[str, list[torch.Tensor]] = {name: [] for name in self.dump.tensors}
        for name, offset, shape, dtype in placed:
            device_parts[name].append(_part_view(device_bytes, offset, shape, dtype))
            host_parts[name].append(as_integers(_part_view(host_bytes, offset, shape, dtype)))
        buffers: dict[str, LayerTensor] = {
            name: tuple(parts) if isinstance(self.dump.tensors[name], tuple) else parts[0]
            for name, parts in device_parts.items()
        }
        hosts = {name: tuple(parts) for name, parts in host_parts.items()}
        checksummer = Checksummer.of_worker(
            self.dump.description,
            buffers,
            self.dump.worker,
            backend=backend,
            num_blocks=self.rows,
            source=self.dump.path,
        )
        return _Slot(device_bytes, host_bytes, hosts, checksummer)

    @property
    def plans_of(self) -> Checksummer:
        return self.slots[0].checksummer

    def submit(self, first: int, count: int, tables: list[Table], done: Finish) -> None:
        slot = self.slots[self.turn % len(self.slots)]
        self.turn += 1
        # Its buffers are free once its last batch's checksums are in.
        self._finish(slot)
        names: Iterable[str] = self.sources
        if self.dump.per_group:
            # The batch's rows are rows of its groups' space: only their layers hold them.
            read = {group_id for group_id, _ in tables}
            names = [name for name in self.sources if self.groups[name] in read]
        for name in names:
            sources = self.sources[name]
            self.dump.check_unchanged()  # a shrunk file would end the read with SIGBUS
            axis, per_row = self.axes[name]
            start, length = first * per_row, count * per_row
            for source, host in zip(sources, slot.hosts[name], strict=True):
                if length != host.shape[axis]:
                    host = host.narrow(axis, 0, length)
                host.copy_(source.narrow(axis, start, length))
        # Once per batch, not per layer: each drop is a TLB flush on every core, which cost
        # as much as a third of the copies on a 16-core GPU machine (docs/dump-format.md).
        self.dump.drop_pages()
        # The buffers hold the batch from their first row.
        relative = [(group_id, table - [[first], [0], [0]]) for group_id, table in tables]
        plans = slot.checksummer.plans
        if not self.cuda:
            outs = [launch_torch(plans[group_id], table) for group_id, table in relative]
            # Now, while the slot's buffers hold this batch.
            slot.pending = _Pending(outs, done, None, strong_lanes(slot.checksummer, relative))
            return
        torch = self.torch
        # Everything is queued from this thread and nothing waited for: the checksums wait
        # for the copy on the GPU, and the host waits only when the slot comes round again.
        with torch.cuda.device(self.device):
            copied = self._send(slot)
            stream = torch.cuda.current_stream()
            stream.wait_event(copied)
            outs = [launch_torch(plans[group_id], table) for group_id, table in relative]
            strong = strong_lanes(slot.checksummer, relative)
            summed = torch.cuda.Event()
            summed.record(stream)
        slot.pending = _Pending(outs, done, summed, strong)

    def _finish(self, slot: _Slot) -> None:
        """Hand the slot's last batch's checksums on, once they are on the host."""
        pending, slot.pending = slot.pending, None
        if pending is None:
            return
        if pending.summed is not None:
            pending.summed.synchronize()
        pending.done(pending.outs, pending.strong)

    def _send(self, slot: _Slot) -> torch.cuda.Event:
        """Queue the copy of the slot's pinned buffers to its device buffers on the copy
        stream, all layers at once; the event that marks it done."""
        torch = self.torch
        with torch.cuda.stream(self.copy_stream):
            # Whole buffers, also for a last batch of fewer rows: one copy for all layers
            # costs less than one per layer (a layer's unused rows are never read).
            slot.device_bytes.copy_(slot.host_bytes, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        return copied

    def drain(self) -> None:
        # Oldest first: the next slot to take a turn holds the oldest batch.
        for index in range(len(self.slots)):
            self._finish(self.slots[(self.turn + index) % len(self.slots)])


class _Slot:
    """One set of device buffers (views of ``device_bytes``), their host staging buffers
    (views of ``host_bytes``, at the same offsets), the checksummer over them and the
    batch it is busy with."""

    def __init__(
        self,
        device_bytes: torch.Tensor,
        host_bytes: torch.Tensor,
        hosts: dict[str, tuple[torch.Tensor, ...]],
        checksummer: Checksummer,
    ) -> None:
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self.hosts = hosts
        self.checksummer = checksummer
        self.pending: _Pending | None = None


@dataclass
class _Pending:
    """A slot's batch whose checksums are queued: their host tensors, what takes them on,
    and (on CUDA) the event that marks them written."""

    outs: list[Array]
    done: Finish
    summed: torch.cuda.Event | None
    strong: list[np.ndarray | None]
    """The strong lane of each table (computed at submit: the buffers are reused)."""


def _part_view(
    flat: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` at byte ``offset`` of a flat byte buffer."""
    nbytes = math.prod(shape) * dtype.itemsize
    return flat[offset : offset + nbytes].view(dtype).view(shape)
