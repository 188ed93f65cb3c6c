"""Checksums of a dump set, computed in batches of rows with bounded memory.

On the CPU (the numpy backend) a ``Checksummer`` reads each dump's file mapping in place,
batch after batch of consecutive rows, and the mapping's pages are dropped after each
batch. Elsewhere (a GPU, or the torch backend) each batch is copied into fixed buffers on
the device first: on CUDA through two pinned host buffers, so that filling one overlaps
the copy to the device and the checksums of the other. Either way memory stays bounded
whatever the dumps' size, and each file is read once, in order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.errors import KvauditError
from ..core.validation import POSITION_NUMBERINGS, Positions
from ..dumps import DumpSet
from ..records import Record, combine_workers
from ..sources.base import Progress
from .dump_batches import DumpBatches, MappedBatches
from .kernels import resolve_backend

if TYPE_CHECKING:
    import torch

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
    """The dumped bytes ``checksum_dump_set`` goes through for the requests.

    They are each listed block row of each group, on every worker: the total of its
    ``progress`` calls.

    Args:
        dump_set: One engine's dumps.
        request_ids: The requests counted; None for every request some dump lists.

    Returns:
        The number of bytes.

    Raises:
        KvauditError: A request no dump holds.

    """
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

    Each dump is read in batches of consecutive rows, about ``batch_bytes`` of them: in
    place on the CPU path, copied into fixed buffers on ``device`` otherwise; the
    mapping's pages are dropped after each batch, then every requested block position
    whose row the batch holds is checksummed. Memory stays bounded whatever the dump's
    size, and the file is read once, in order. ``progress(n)`` is called with the bytes
    each step covered (an increment; ``total_bytes`` gives their sum). An incomplete set
    gives a record with ``complete`` False and its missing workers.

    Args:
        dump_set: One engine's dumps.
        request_ids: The requests checksummed; None for every request some dump lists.
        positions: ``"request"`` or ``"block"``: how pieces are numbered.
        backend: As ``Checksummer`` takes it.
        device: Where the checksums are computed (``"cpu"``, a CUDA device).
        progress: Called with the bytes each step covered.
        batch_bytes: About how many bytes of rows one batch reads.

    Returns:
        The engine's record, summed over its workers.

    Raises:
        KvauditError: A request no dump holds, an unknown position numbering, or workers
            whose records cannot be summed.

    """
    if positions not in POSITION_NUMBERINGS:
        raise KvauditError(f"unknown position numbering {positions!r}, expected request or block")
    ids = _selected(dump_set, request_ids)
    device_name = str(device)
    in_place = device_name == "cpu" and not resolve_backend(backend, "cpu").uses_torch
    records = []
    for dump in dump_set.dumps:
        held = [request_id for request_id in ids if request_id in dump.requests]
        batches: DumpBatches
        if in_place:
            batches = MappedBatches(dump, backend, batch_bytes)
        else:
            # Imported here: reading in place (the CPU path) never stages batches.
            from .dump_staging import StagedBatches

            batches = StagedBatches(dump, device_name, backend, batch_bytes)
        records.append(batches.checksum(held, positions, progress))
    return combine_workers(records)
