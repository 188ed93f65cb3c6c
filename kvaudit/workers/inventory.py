"""What a source holds, for ``kvaudit inspect``: its workers, their groups and the
requests' positions, and the builders every kind of source shares.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..records import WorkerInfo

if TYPE_CHECKING:
    from ..views import GroupViews, LayerTensor
    from .protocol import Listing, RawWorker


@dataclass(frozen=True)
class GroupInfo:
    """One group on one worker: its spec, size, coverage and fingerprint.

    Fields a record does not keep (type, layout, layers, bytes) are None for a record;
    ``bytes`` is None for checksummers handed over in Python too. ``scales`` holds
    ``(layer, k_scale, v_scale)`` of each layer whose description gives a scale (a
    quantized cache), in layer order; empty where none does or it is not known.
    """

    id: int
    fingerprint: int
    covered: bool
    reason: str | None = None
    type: str | None = None
    block_size: int | None = None
    kernel_block_size: int | None = None
    layout: str | None = None
    layers: int | None = None
    bytes: int | None = None
    scales: tuple[tuple[str, float | None, float | None], ...] = ()


@dataclass(frozen=True)
class WorkerInventory:
    """One worker of a source: who it is, how many block rows it holds, its groups."""

    worker: WorkerInfo
    rows: int | None
    groups: list[GroupInfo]


@dataclass
class RequestInventory:
    """One request across a source's workers: its token count and, per group, the block
    positions some worker holds."""

    num_tokens: int
    positions: dict[int, set[int]] = field(default_factory=dict)


@dataclass
class Inventory:
    """What a source holds, for ``kvaudit inspect``."""

    kind: str
    sources: list[str]
    workers: list[WorkerInventory]
    complete: bool
    missing_workers: list[tuple[int, int]]
    requests: dict[str, RequestInventory]


def raw_inventory(worker: RawWorker) -> WorkerInventory:
    """One raw worker's ranks, rows and groups (from its views, built once per worker)."""
    groups = [group_info(views, worker.layer_arrays) for views in worker.array_views.values()]
    return WorkerInventory(worker.worker, uniform_rows(worker.num_rows), groups)


def uniform_rows(num_rows: int | Mapping[int, int]) -> int | None:
    """A worker's rows when every group holds as many; None where groups' block spaces
    differ (each group's rows are its own)."""
    if isinstance(num_rows, int):
        return num_rows
    counts = set(num_rows.values())
    return counts.pop() if len(counts) == 1 else None


def group_info(views: GroupViews, tensors: Mapping[str, LayerTensor] | None) -> GroupInfo:
    """A group's spec, coverage and fingerprint on one worker, and the bytes of the layer
    tensors it owns in ``tensors`` (None without tensors)."""
    group = views.group
    spec = group.spec
    size = None
    if tensors is not None:
        owned = [layer.name for layer in group.layers if layer.shares is None]
        size = sum(_tensor_bytes(tensors.get(name)) for name in owned)
    return GroupInfo(
        id=group.id,
        fingerprint=views.fingerprint,
        covered=views.covered,
        reason=views.reason,
        type=spec.type,
        block_size=spec.block_size,
        kernel_block_size=spec.kernel_block_size,
        layout="state" if spec.is_state else spec.layout,
        layers=len(group.layers),
        bytes=size,
        scales=tuple(
            (layer.name, layer.spec.k_scale, layer.spec.v_scale)
            for layer in group.layers
            if layer.spec.k_scale is not None or layer.spec.v_scale is not None
        ),
    )


def _tensor_bytes(tensor: LayerTensor | None) -> int:
    """The bytes of a layer's tensor (or K and V tensors); 0 for none."""
    if tensor is None:
        return 0
    if isinstance(tensor, tuple):
        return sum(int(part.nbytes) for part in tensor)
    return int(tensor.nbytes)


def request_inventory(mappings: Iterable[Mapping[str, Listing]]) -> dict[str, RequestInventory]:
    """Each request the workers' mappings list, with the positions some worker holds."""
    requests: dict[str, RequestInventory] = {}
    for mapping in mappings:
        for request_id, request in mapping.items():
            add_request(requests, request_id, request.num_tokens, request.groups)
    return requests


def add_request(
    requests: dict[str, RequestInventory],
    request_id: str,
    num_tokens: int,
    groups: Mapping[int, tuple[int, Sequence[int]]],
) -> None:
    """Add one worker's listing of a request: per group, its first position and blocks."""
    entry = requests.setdefault(request_id, RequestInventory(num_tokens))
    for gid, (start, block_ids) in groups.items():
        entry.positions.setdefault(int(gid), set()).update(range(start, start + len(block_ids)))
