"""Checksums of a dump set, computed in batches of rows with bounded memory.

On the CPU (the numpy backend) a ``Checksummer`` reads each dump's file mapping in place,
batch after batch of consecutive rows, and the mapping's pages are dropped after each
batch. Elsewhere (a GPU, or the torch backend) each batch is copied into fixed buffers on
the device first: on CUDA through two pinned host buffers, so that filling one overlaps
the copy to the device and the checksums of the other. Either way memory stays bounded
whatever the dumps' size, and each file is read once, in order.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.errors import KvauditError
from ..core.validation import POSITION_NUMBERINGS, Positions
from ..dumps import Dump, DumpSet
from ..records import Record, WorkerRecord, combine_workers
from ..workers.protocol import Progress
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
    records = [
        _dump_record(dump, ids, positions, backend, device, progress, batch_bytes)
        for dump in dump_set.dumps
    ]
    return combine_workers(records)


def checksum_dump_sets(
    dump_sets: Sequence[DumpSet],
    *,
    request_ids: Sequence[str] | None = None,
    positions: Positions = "request",
    backend: str = "auto",
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
    batch_bytes: int = BATCH_BYTES,
) -> Record:
    """Dump sets of one engine that hold other requests each (an output folder's dumps, a
    set per request) checksummed as one set: each worker's checksums of every set are its
    one record, and a worker that covers a group but has no dump of a request makes that
    group partial, as ``combine_workers`` says.

    Args:
        dump_sets: The sets, each request in one of them.
        request_ids: The requests checksummed; None for every request some dump lists.
        positions: As for ``checksum_dump_set``.
        backend: As for ``checksum_dump_set``.
        device: As for ``checksum_dump_set``.
        progress: As for ``checksum_dump_set``.
        batch_bytes: As for ``checksum_dump_set``.

    Returns:
        The engine's record of the requests, summed over its workers.

    Raises:
        KvauditError: A request no set holds, an unknown position numbering, dumps of one
            worker whose cache fingerprints differ, or records that cannot be summed.

    """
    if positions not in POSITION_NUMBERINGS:
        raise KvauditError(f"unknown position numbering {positions!r}, expected request or block")
    held = {rid for dump_set in dump_sets for rid in dump_set.request_ids}
    wanted = None if request_ids is None else list(dict.fromkeys(request_ids))
    for request_id in wanted or []:
        if request_id not in held:
            name = os.path.commonpath([d.path for s in dump_sets for d in s.dumps] or ["."])
            raise KvauditError(f"no dump of the sets holds request {request_id!r}", name)
    workers: dict[tuple[int, int], WorkerRecord] = {}
    paths: dict[tuple[int, int], list[str]] = {}
    for dump_set in dump_sets:
        listed = dump_set.request_ids
        known = set(listed)
        ids = listed if wanted is None else [rid for rid in wanted if rid in known]
        for dump in dump_set.dumps:
            record = _dump_record(dump, ids, positions, backend, device, progress, batch_bytes)
            ranks = (dump.worker.pp_rank, dump.worker.tp_rank)
            paths.setdefault(ranks, []).append(dump.path)
            first = workers.setdefault(ranks, record)
            if first is record:
                continue
            if first.fingerprints != record.fingerprints:
                raise KvauditError(
                    f"the cache fingerprints differ from those of {first.worker.source}: the "
                    "dumps of one worker come from one cache",
                    dump.path,
                )
            first.requests.update(record.requests)
    for ranks, record in workers.items():
        if len(dump_sets) > 1:
            source = _files_name(paths[ranks])
            record.worker = dataclasses.replace(record.worker, source=source)
    return combine_workers([workers[ranks] for ranks in sorted(workers)])


def _files_name(paths: Sequence[str]) -> str:
    """One worker's dump files of several request folders in a message:
    ``DIR/*/pp0-tp1.safetensors`` (``DIR/*/*`` where their names differ)."""
    names = {os.path.basename(path) for path in paths}
    folders = [os.path.dirname(os.path.dirname(os.path.abspath(path))) for path in paths]
    try:
        parent = os.path.commonpath(folders)
    except ValueError:
        parent = "?"
    return os.path.join(parent, "*", names.pop() if len(names) == 1 else "*")


def _dump_record(
    dump: Dump,
    ids: Sequence[str],
    positions: Positions,
    backend: str,
    device: str | torch.device,
    progress: Progress | None,
    batch_bytes: int,
) -> WorkerRecord:
    """One dump's checksums of those of the requests it lists, read batch by batch."""
    device_name = str(device)
    in_place = device_name == "cpu" and not resolve_backend(backend, "cpu").uses_torch
    held = [request_id for request_id in ids if request_id in dump.requests]
    batches: DumpBatches
    if in_place:
        batches = MappedBatches(dump, backend, batch_bytes)
    else:
        # Imported here: reading in place (the CPU path) never stages batches.
        from .dump_staging import StagedBatches

        batches = StagedBatches(dump, device_name, backend, batch_bytes)
    return batches.checksum(held, positions, progress)
