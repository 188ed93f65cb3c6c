"""Plans: how a worker checksums a group's views.

A plan has one output column per replica key and fuses the parts that share one layout
(dtype, shape, strides, device) into one launch: one launch of the backend that
``kvaudit.kernels`` resolves (the Triton kernel, the CPU torch path), whichever it is.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .kernels import BackendChoice, Launch, LaunchPart, resolve_backend
from .scheme import ReplicaKey
from .views import LayerView


@dataclass
class GroupPlan:
    """How a worker checksums one group: one launch per layout, one column per replica key."""

    replica_keys: list[ReplicaKey]
    launches: list[Launch]
    device: torch.device

    @classmethod
    def create(
        cls,
        views: list[LayerView],
        *,
        first_replica_only: bool,
        backend: BackendChoice = "auto",
    ) -> GroupPlan | None:
        """The plan of ``views`` (only replica 0 of each layer for a producer), or None
        when nothing is left to checksum."""
        if first_replica_only:
            views = [view for view in views if view.replica_key[1] == 0]
        if not views:
            return None
        replica_keys = sorted(dict.fromkeys(view.replica_key for view in views))
        device = views[0].parts[0].pieces.device
        resolved = resolve_backend(backend, device.type)
        layouts: dict[tuple, list[LaunchPart]] = defaultdict(list)
        for view in views:
            column = replica_keys.index(view.replica_key)
            for part in view.parts:
                pieces = part.pieces
                key = (
                    pieces.dtype,
                    pieces.device,
                    tuple(pieces.shape),
                    pieces.stride(),
                    # A launch may address its parts in elements from the first one.
                    pieces.data_ptr() % pieces.element_size(),
                )
                layouts[key].append(
                    LaunchPart(
                        pieces, view.first_slice, column, part.piece_offset, part.cell_pieces
                    )
                )
        launches = [resolved.launch(parts) for parts in layouts.values()]
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
