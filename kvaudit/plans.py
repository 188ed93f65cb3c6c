"""Plans: how a worker checksums a group's views.

A plan has one output column per replica key and fuses the parts that share one layout
(dtype, shape, strides, device) into one launch: one Triton kernel launch over a small
device table of each part's offset, first slice, column and piece numbering, or one
prepared list of parts for the CPU path.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .kernels.torch_cpu import TorchLaunch, TorchPart
from .scheme import ReplicaKey
from .views import LayerView, PieceView

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto``: the Triton kernel on CUDA devices, the torch path elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}, expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


@dataclass(frozen=True)
class _Entry:
    """A part to add into ``column``, with its layer's first slice."""

    part: PieceView
    first_slice: int
    column: int


class TritonLaunch:
    """Parts that share one layout, each adding into its column in one Triton launch over a
    device table of (element offset from the first part, first slice, column, piece offset,
    cell pieces)."""

    def __init__(self, entries: list[_Entry]) -> None:
        self.template = entries[0].part.pieces
        itemsize = self.template.element_size()
        base = self.template.data_ptr()
        self.table = torch.tensor(
            [
                [
                    (entry.part.pieces.data_ptr() - base) // itemsize,
                    entry.first_slice,
                    entry.column,
                    entry.part.piece_offset,
                    entry.part.cell_pieces,
                ]
                for entry in entries
            ],
            dtype=torch.int64,
            device=self.template.device,
        )
        self.aligned = self.template.stride(-1) == 1 and all(
            entry.part.pieces.data_ptr() % 16 == 0 for entry in entries
        )

    def accumulate(
        self,
        block_ids: torch.Tensor,
        first_tokens: torch.Tensor,
        valid_tokens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Add every part's weighted sums of the rows into its column of ``out``."""
        from .kernels.triton_kernel import accumulate_triton

        accumulate_triton(
            self.template, self.table, block_ids, first_tokens, valid_tokens, out, self.aligned
        )

    def warm_up(self, num_columns: int) -> None:
        """Compile the kernel now rather than in a serving step."""
        from .kernels.triton_kernel import warm_up

        warm_up(self.template, num_columns, self.aligned)


def _launch(entries: list[_Entry], backend: str) -> TritonLaunch | TorchLaunch:
    """One launch of parts that share a layout, on the resolved backend."""
    if backend == "triton":
        return TritonLaunch(entries)
    return TorchLaunch(
        [
            TorchPart(
                entry.part.pieces,
                entry.first_slice,
                entry.column,
                entry.part.piece_offset,
                entry.part.cell_pieces,
            )
            for entry in entries
        ]
    )


@dataclass
class GroupPlan:
    """How a worker checksums one group: one launch per layout, one column per replica key."""

    replica_keys: list[ReplicaKey]
    launches: list[TritonLaunch | TorchLaunch]
    device: torch.device

    @classmethod
    def create(
        cls, views: list[LayerView], *, first_replica_only: bool, backend: str = "auto"
    ) -> GroupPlan | None:
        """The plan of ``views`` (only replica 0 of each layer for a producer), or None
        when nothing is left to checksum."""
        if first_replica_only:
            views = [view for view in views if view.replica_key[1] == 0]
        if not views:
            return None
        replica_keys = sorted(dict.fromkeys(view.replica_key for view in views))
        device = views[0].parts[0].pieces.device
        resolved = resolve_backend(backend, device)
        layouts: dict[tuple, list[_Entry]] = defaultdict(list)
        for view in views:
            column = replica_keys.index(view.replica_key)
            for part in view.parts:
                pieces = part.pieces
                key = (
                    pieces.dtype,
                    pieces.device,
                    tuple(pieces.shape),
                    pieces.stride(),
                    # The Triton table holds offsets in elements from the first part.
                    pieces.data_ptr() % pieces.element_size(),
                )
                layouts[key].append(_Entry(part, view.first_slice, column))
        launches = [_launch(entries, resolved) for entries in layouts.values()]
        return cls(replica_keys, launches, device)

    def warm_up(self) -> None:
        """Prepare every launch ahead of use (compile kernels, allocate buffers)."""
        for launch in self.launches:
            launch.warm_up(len(self.replica_keys))

    def checksum(
        self, block_ids: torch.Tensor, first_tokens: torch.Tensor, valid_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The ``[rows, replica keys]`` int64 checksums of the rows (on the plan's device)."""
        out = torch.zeros(
            (len(block_ids), len(self.replica_keys)), dtype=torch.int64, device=self.device
        )
        if len(block_ids):
            for launch in self.launches:
                launch.accumulate(block_ids, first_tokens, valid_tokens, out)
        return out
