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
from ..views.model import PieceView
from .kernels import BackendChoice, Launch, LaunchPart, resolve_backend

if TYPE_CHECKING:
    import torch

    from .strong import StrongPart


@dataclass
class GroupPlan:
    """How a worker checksums one group: one launch per layout, one column per replica key
    (or, with layer sums, one per replica key, layer number and plane)."""

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
    strong_parts: list[StrongPart] | None = field(default=None, repr=False, compare=False)
    """The strong lane's CPU parts, built on first use (:meth:`strong`)."""
    """The strong kernel's launches, built on first use (kernels/triton_strong.py)."""
    columns: list[tuple[ReplicaKey, int, str]] | None = None
    """With layer sums, each output column's replica key, layer number and plane; None:
    one column per replica key."""

    @property
    def width(self) -> int:
        """The number of columns ``checksum`` returns."""
        return len(self.replica_keys) if self.columns is None else len(self.columns)

    @property
    def layer_parts(self) -> list[tuple[int, str]]:
        """The labels of the layer sums ``split`` returns (none without layer sums)."""
        if self.columns is None:
            return []
        return sorted({(number, plane) for key, number, plane in self.columns if key[1] == 0})

    def split(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Host checksums ``[rows, width]`` (uint64) as per-replica-key values and layer sums.

        Args:
            values: What ``checksum`` returned, on the host as uint64.

        Returns:
            ``[rows, replica keys]`` values, and ``[rows, layer_parts]`` layer sums (of the
            replica-0 columns) or None without layer sums.

        """
        if self.columns is None:
            return values, None
        keyed = np.zeros((values.shape[0], len(self.replica_keys)), dtype=np.uint64)
        parts = self.layer_parts
        sums = np.zeros((values.shape[0], len(parts)), dtype=np.uint64)
        key_index = {key: k for k, key in enumerate(self.replica_keys)}
        part_index = {part: k for k, part in enumerate(parts)}
        # uint64 addition wraps modulo 2**64: the columns add up to each key's checksum.
        for c, (key, number, plane) in enumerate(self.columns):
            keyed[:, key_index[key]] += values[:, c]
            if key[1] == 0:
                sums[:, part_index[number, plane]] += values[:, c]
        return keyed, sums

    @classmethod
    def create(
        cls,
        views: list[LayerView],
        *,
        first_replica_only: bool,
        backend: BackendChoice = "auto",
        layer_sums: bool = False,
    ) -> GroupPlan | None:
        """The plan of ``views`` (only replica 0 of each layer for a producer), or None
        when nothing is left to checksum.

        With ``layer_sums`` each part adds into a column of its replica key, layer number
        and plane instead of its replica key's: the kernels compute every part's sum
        anyway, so the split costs no second read of the KV, only wider results
        (docs/checksum.md, "Layer sums").
        """
        if first_replica_only:
            views = [view for view in views if view.replica_key[1] == 0]
        if not views:
            return None
        replica_keys = sorted(dict.fromkeys(view.replica_key for view in views))
        first = views[0].parts[0].pieces
        resolved = resolve_backend(backend, device_type(first))
        device = "cpu" if is_numpy(first) else str(first.device)
        layouts: dict[tuple, list[LaunchPart]] = defaultdict(list)
        parts_of = {id(view): _parts(view, layer_sums) for view in views}
        labels = sorted(
            {(v.replica_key, v.number, plane_of(part)) for v in views for part in parts_of[id(v)]}
        )
        for view in views:
            for part in parts_of[id(view)]:
                if layer_sums:
                    column = labels.index((view.replica_key, view.number, plane_of(part)))
                else:
                    column = replica_keys.index(view.replica_key)
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
        # The strong lane reads each view's own parts into its replica key's column: the
        # layer sums' columns and K/V halves are the seed lane's alone.
        every_part = [
            LaunchPart(
                _for_backend(part.pieces, resolved.uses_torch),
                view.first_slice,
                replica_keys.index(view.replica_key),
                part.piece_offset,
                part.cell_pieces,
            )
            for view in views
            for part in view.parts
        ]
        return cls(
            replica_keys,
            launches,
            device,
            resolved.uses_torch,
            every_part,
            backend=resolved.name,
            columns=labels if layer_sums else None,
        )

    def warm_up(self) -> None:
        """Prepare every launch ahead of use (compile kernels, allocate buffers)."""
        for launch in self.launches:
            launch.warm_up(self.width)

    def checksum(self, block_ids: Array, first_tokens: Array, valid_tokens: Array) -> Array:
        """The ``[rows, width]`` int64 checksums of the rows: numpy arrays in and out, or
        torch tensors on the plan's device when it ``uses_torch``."""
        shape = (len(block_ids), self.width)
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
        if self.device != "cpu" or self.backend == "triton":
            from .kernels import triton_strong

            return triton_strong.strong_sums(self, block_ids, first_tokens, valid_tokens)
        out = np.zeros((len(block_ids), len(self.replica_keys)), dtype=np.uint64)
        if not len(block_ids):
            return out
        counted = np.flatnonzero(valid_tokens > 0)
        for part in self._strong_parts():
            sums = part.row_sums(block_ids[counted], first_tokens[counted], valid_tokens[counted])
            out[counted, part.column] = strong_add(out[counted, part.column], sums)
        return out

    def _strong_parts(self) -> list[StrongPart]:
        """The parts as the strong lane's CPU path reads them, built on first use: their
        per-head weights are modular powers, not to be recomputed on every call."""
        if self.strong_parts is None:
            from .kernels.numpy_cpu import as_numpy
            from .strong import StrongPart

            self.strong_parts = [StrongPart.of(part, as_numpy(part.pieces)) for part in self.parts]
        return self.strong_parts


def _parts(view: LayerView, layer_sums: bool) -> tuple[PieceView, ...]:
    """A view's parts, whole cells of K then V split into their K and V rows (views, no
    copy) where layer sums are kept."""
    if not layer_sums:
        return view.parts
    parts: list[PieceView] = []
    for part in view.parts:
        k = part.k_pieces
        if k and part.pieces.shape[-1] == part.cell_pieces:
            parts.append(PieceView(part.pieces[..., :k], part.piece_offset, part.cell_pieces))
            parts.append(PieceView(part.pieces[..., k:], part.piece_offset + k, part.cell_pieces))
        else:
            parts.append(part)
    return tuple(parts)


def plane_of(part: PieceView) -> str:
    """A part's plane: ``KV`` where it holds whole cells, else ``K`` (the cell's first
    pieces) or ``V``."""
    if part.pieces.shape[-1] == part.cell_pieces:
        return "KV"
    return "K" if part.piece_offset == 0 else "V"


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


def on_cuda(device: str) -> bool:
    """Whether a plan's device is a CUDA device."""
    return device.startswith("cuda")


def fuses_lanes(plan: GroupPlan) -> bool:
    """Whether one kernel pass computes both lanes of the plan (the Triton backend's,
    without layer sums: their wider columns are the seed launches' alone)."""
    return plan.backend == "triton" and plan.columns is None


def _device_rows(plan: GroupPlan, rows: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Rows ``[3, n]`` (block ids, first tokens, valid tokens) on the plan's device: on a
    GPU sent from pinned memory, not waited for."""
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    if on_cuda(plan.device):
        tensor = tensor.pin_memory()
    return tuple(tensor.to(plan.device, non_blocking=True))


def _to_host(plan: GroupPlan, values: torch.Tensor) -> torch.Tensor:
    """A plan's int64 results: on a GPU copied into pinned host memory, not waited for;
    elsewhere as they are."""
    if not on_cuda(plan.device):
        return values
    import torch

    host = torch.empty(values.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def launch_fused(plan: GroupPlan, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A Triton plan's seed values and strong residues of rows ``[3, n]`` from one pass of
    the strong kernel over the KV: like :func:`launch_torch`, nothing is waited for."""
    import torch

    from .kernels import triton_strong

    ids, first_tokens, valid_tokens = _device_rows(plan, rows)
    shape = (len(ids), len(plan.replica_keys))
    seed = torch.zeros(shape, dtype=torch.int64, device=plan.device)
    strong = triton_strong.strong_sums(plan, ids, first_tokens, valid_tokens, seed_out=seed)
    return _to_host(plan, seed), strong


def launch_torch(plan: GroupPlan, rows: np.ndarray) -> torch.Tensor:
    """A torch plan's checksums of rows ``[3, n]`` (block ids, first tokens, valid tokens):
    on a GPU the rows go from pinned memory and the values come back into pinned memory,
    neither waited for."""
    return _to_host(plan, plan.checksum(*_device_rows(plan, rows)))
