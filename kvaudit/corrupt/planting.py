"""Planting faults in dumps: a copy of one worker's dump with one fault in one block.

``corrupt_dump`` writes a copy of a dump whose block at one position of one request
differs from the original in one of the ways KV goes wrong in practice (``modes.py``): a
flipped bit, a zeroed block, swapped tokens or heads, a stale block (the slot reused by
another request), or tokens shifted by one slot. The copy is written next to the output,
changed in place through the same cell layout ``kvaudit.locate`` reads, synced and
renamed over the output.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from ..core.arrays import data_ptr
from ..core.errors import KvauditError
from ..core.files import atomic_path
from ..description import CacheDescription
from ..dumps import Dump, open_dump
from ..locate import cell_addresses
from ..sources.sniffing import with_hint
from ..views import LayerView
from .modes import MODE_FAULTS, WHOLE_BLOCK_MODES, Block, Fault, open_block
from .result import MODES, ChangedSlice, CorruptMode, PlantedFault


def corrupt_dump(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    request_id: str,
    group_id: int,
    position: int,
    layer: str | None = None,
    head: int | None = None,
    token: int | None = None,
    mode: CorruptMode = "flip",
    seed: int = 0,
    config: CacheDescription | None = None,
) -> PlantedFault:
    """Write a copy of a dump with one fault in one block of a request, and say what changed.

    The block is the request's block at ``position``, in the dump's block size of the
    group. Modes: ``flip`` one bit of one valid token's cell; ``zero`` the block of ``layer``
    (default every layer of the group); ``swap-tokens`` ``token`` and the next valid token
    of one layer and head; ``swap-heads`` two local heads of one layer; ``stale`` the
    block's content replaced by another block of the dump (another request's, where there
    is one; with ``token``, only its slots up to that position: a slot reused mid-write);
    ``shift`` each valid token gets the previous token's KV (the first keeps its
    own). ``layer`` and ``head`` (global) restrict every mode; what is left open is chosen
    from ``seed``. The result lists the changed layers, global heads and request positions
    (``changes``; ``tokens_past_end`` are changed slots at or past ``num_tokens``), the
    changed bytes of the output file (``byte_ranges``, ``[start, end)``) and the mode's
    own details. ``config`` stands in for (or overrides) the description the dump embeds.

    Args:
        source: The dump file copied (not changed).
        out: The output path; the copy is written next to it, synced and renamed over it.
        request_id: The request whose block is changed.
        group_id: The group of the block.
        position: The block's position in the request, in the dump's block size.
        layer: The only layer changed; None to leave it open.
        head: The only global head changed; None to leave it open.
        token: For ``flip`` and ``swap-tokens``, the request position changed; for
            ``stale``, the last position replaced; None to leave it open (``stale``: the
            whole block).
        mode: One of ``MODES``.
        seed: Chooses what is left open.
        config: A description that stands in for (or overrides) the dump's.

    Returns:
        What was planted: where, the changed slices and bytes, and the mode's details.

    Raises:
        KvauditError: One line naming the file: an unknown mode, a directory or a dump
            that cannot be read, an unknown request, group, layer or position, a token
            that is not valid, a head not on this worker, a mode that does not apply to
            the block, or a file that cannot be written.

    """
    path = os.fspath(source)
    target = os.fspath(out)
    if mode not in MODES:
        raise KvauditError(f"unknown mode {mode!r}, expected one of {', '.join(MODES)}", path)
    if os.path.isdir(path):
        raise KvauditError("is a directory; corrupt writes a copy of one dump file", path)
    try:
        dump = open_dump(path, config)
    except KvauditError as error:
        raise with_hint(error) from None  # a record or a description is named as one
    block = open_block(dump, request_id, group_id, position)
    if token is not None and mode in WHOLE_BLOCK_MODES:
        raise block.fail(f"{mode} {WHOLE_BLOCK_MODES[mode]}; it takes no token")
    rng = np.random.default_rng(seed)
    fault = MODE_FAULTS[mode](block, layer, head, token, rng)

    offsets, values, changes = _changed_bytes(block, fault)
    if not any(change.tokens for change in changes):
        raise block.fail(f"{mode} would change no valid token of the block")
    _write_copy(path, target, offsets, values)
    return PlantedFault(
        source=path,
        out=target,
        mode=mode,
        seed=seed,
        request=request_id,
        group=group_id,
        position=position,
        block=block.block_id,
        row=block.row,
        num_tokens=dump.requests[request_id].num_tokens,
        layers=sorted({change.layer for change in changes}),
        heads=sorted({change.head for change in changes}),
        tokens=sorted({t for change in changes for t in change.tokens}),
        changes=changes,
        byte_ranges=_ranges(offsets),
        flip=fault.flip,
        swap=fault.swap,
        origin=fault.origin,
    )


# Writing.


def _file_base(dump: Dump, view: LayerView) -> int:
    """The address the dump file's first byte has where the view's tensors map it."""
    pieces = view.parts[0].pieces
    return data_ptr(pieces) - dump.file_offset(pieces)


def _changed_bytes(block: Block, fault: Fault) -> tuple[np.ndarray, np.ndarray, list[ChangedSlice]]:
    """The file offsets and new values of the bytes the fault changes, and per changed
    (layer, global head) its changed request positions."""
    length = os.path.getsize(block.dump.path)
    offsets, values, changes = [], [], []
    for change in sorted(fault.changes, key=lambda change: change.index):
        view = block.views[change.index]
        original = block.cells(change.index)
        differ = change.cells != original
        if not differ.any():
            continue
        addresses = cell_addresses(view, block.row) - _file_base(block.dump, view)
        if addresses.min() < 0 or addresses.max() >= length:
            raise block.fail(f"layer {view.name}: its cells lie outside the file's mapping")
        offsets.append(addresses[differ])
        values.append(change.cells[differ])
        cell_changed = differ.any(axis=2)
        for h in range(view.heads):
            slots = np.flatnonzero(cell_changed[h])
            if not len(slots):
                continue
            positions = [block.first + int(u) for u in slots]
            end = block.first + block.valid
            changes.append(
                ChangedSlice(
                    view.name,
                    view.first_head + h,
                    [t for t in positions if t < end],
                    [t for t in positions if t >= end],
                )
            )
    if not offsets:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8), []
    all_offsets = np.concatenate(offsets)
    all_values = np.concatenate(values)
    order = np.argsort(all_offsets, kind="stable")
    return all_offsets[order], all_values[order], changes


def _ranges(offsets: np.ndarray) -> list[list[int]]:
    """Sorted byte offsets as ``[start, end)`` runs."""
    if not len(offsets):
        return []
    breaks = np.flatnonzero(np.diff(offsets) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(offsets)]])
    return [[int(offsets[s]), int(offsets[e - 1]) + 1] for s, e in zip(starts, ends)]


def _write_copy(source: str, target: str, offsets: np.ndarray, values: np.ndarray) -> None:
    """A copy of ``source`` with the bytes at ``offsets`` set, written whole over ``target``."""
    with atomic_path(target) as temporary:
        shutil.copyfile(source, temporary)
        data = np.memmap(temporary, dtype=np.uint8, mode="r+")
        data[offsets] = values
        data.flush()
        del data
