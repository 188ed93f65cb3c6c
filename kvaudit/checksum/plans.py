"""Plans: how a worker checksums a group's views.

A plan has one output column per replica key and fuses the parts that share one layout
(dtype, shape, strides, device) into one launch: one launch of the backend that
``kvaudit.checksum.kernels`` resolves (the Triton kernel, the numpy or torch CPU path), whichever it
is. A plan of the numpy backend takes and returns numpy arrays and never imports torch;
the others take and return torch tensors on the plan's device.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..core.arrays import Array, data_ptr, device_type, element_size, is_numpy, strides
from ..core.scheme import ReplicaKey, strong_add
from ..views import LayerView
from .kernels import BackendChoice, Launch, LaunchPart, resolve_backend

if TYPE_CHECKING:
    import torch


@dataclass
class GroupPlan:
    """How a worker checksums one group: one launch per layout, one column per replica key."""

    replica_keys: list[ReplicaKey]
    launches: list[Launch]
    device: str
    """The parts' device (``cpu``, ``cuda:0``)."""
    uses_torch: bool
    """Whether rows and results are torch tensors on ``device`` (else numpy arrays)."""
    parts: list[LaunchPart] = field(default_factory=list)
    """Every part of every launch, for the strong lane (:meth:`strong`)."""
    backend: str = ""
    """The resolved backend's name: a ``triton`` plan computes the strong lane with the
    Triton kernel too (on a GPU, or on the CPU under the interpreter)."""
    strong_launches: list | None = field(default=None, repr=False, compare=False)
    """The strong kernel's launches, built on first use (kernels/triton_strong.py)."""

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
        first = views[0].parts[0].pieces
        resolved = resolve_backend(backend, device_type(first))
        device = "cpu" if is_numpy(first) else str(first.device)
        layouts: dict[tuple, list[LaunchPart]] = defaultdict(list)
        for view in views:
            column = replica_keys.index(view.replica_key)
            for part in view.parts:
                pieces = _for_backend(part.pieces, resolved.uses_torch)
                key = (
                    str(pieces.dtype),
                    device_type(pieces),
                    tuple(pieces.shape),
                    strides(pieces),
                    # A launch may address its parts in elements from the first one.
                    data_ptr(pieces) % element_size(pieces),
                )
                layouts[key].append(
                    LaunchPart(
                        pieces, view.first_slice, column, part.piece_offset, part.cell_pieces
                    )
                )
        launches = [resolved.launch(parts) for parts in layouts.values()]
        every_part = [part for parts in layouts.values() for part in parts]
        return cls(replica_keys, launches, device, resolved.uses_torch, every_part, resolved.name)

    def warm_up(self) -> None:
        """Prepare every launch ahead of use (compile kernels, allocate buffers)."""
        for launch in self.launches:
            launch.warm_up(len(self.replica_keys))

    def checksum(self, block_ids: Array, first_tokens: Array, valid_tokens: Array) -> Array:
        """The ``[rows, replica keys]`` int64 checksums of the rows: numpy arrays in and
        out, or torch tensors on the plan's device when it ``uses_torch``."""
        shape = (len(block_ids), len(self.replica_keys))
        out: Array
        if self.uses_torch:
            import torch

            out = torch.zeros(shape, dtype=torch.int64, device=self.device)
        else:
            out = np.zeros(shape, dtype=np.int64)
        if len(block_ids):
            for launch in self.launches:
                launch.accumulate(block_ids, first_tokens, valid_tokens, out)
        return out

    def strong(
        self, block_ids: np.ndarray, first_tokens: np.ndarray, valid_tokens: np.ndarray
    ) -> Array:
        """The strong lane's ``[rows, replica keys]`` residues of the rows (docs/checksum.md,
        "The strong lane"): uint64 numpy on the CPU paths; from the Triton kernel (a ``triton``
        plan, or any plan off the CPU) int64 bits in a torch tensor, on a GPU a pinned host
        tensor whose copy is queued, not waited for (see ``triton_strong.strong_sums``).

        Args:
            block_ids: The rows' block ids (numpy int64).
            first_tokens: Each row's first token position.
            valid_tokens: Each row's valid token count.

        Returns:
            The residues modulo ``2**64 - 59``, one column per replica key.

        """
        from .strong import StrongPart

        if self.device != "cpu" or self.backend == "triton":
            from .kernels import triton_strong

            return triton_strong.strong_sums(self, block_ids, first_tokens, valid_tokens)
        out = np.zeros((len(block_ids), len(self.replica_keys)), dtype=np.uint64)
        if not len(block_ids):
            return out
        counted = np.flatnonzero(valid_tokens > 0)
        for part in self.parts:
            from .kernels.numpy_cpu import as_numpy

            strong_part = StrongPart.of(part, as_numpy(part.pieces))
            sums = strong_part.row_sums(
                block_ids[counted], first_tokens[counted], valid_tokens[counted]
            )
            out[counted, part.column] = strong_add(out[counted, part.column], sums)
        return out


def _for_backend(pieces: Array, uses_torch: bool) -> Array:
    """A piece view as the backend reads it: a CPU tensor as a numpy array for numpy, a
    numpy array as a CPU tensor for torch (both share the memory)."""
    if uses_torch and is_numpy(pieces):
        return _tensor(pieces)
    if not uses_torch and not is_numpy(pieces):
        from .kernels.numpy_cpu import as_numpy

        return as_numpy(pieces)
    return pieces


def _tensor(array: np.ndarray) -> torch.Tensor:
    import warnings

    import torch

    with warnings.catch_warnings():
        # A dump's mapping is read-only and torch has no read-only tensors; nothing writes.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
