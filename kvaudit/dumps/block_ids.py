"""A dump's block lists read strictly: ``kvaudit.blocks`` (one list, a list per group, or
absent for the whole cache), the rows each group holds, and a request's group entry (its
start position and block ids), which the writer checks too."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.validation import fail, is_int, load_json, short
from ..description import CacheDescription
from ..records import WorkerInfo
from .dump import META_BLOCKS
from .hints import other_engine_hint

GroupBlocks = dict[int, list[int] | None]
"""``kvaudit.blocks`` per group: each group's listed block ids, None for its whole space."""


def parse_blocks(
    metadata: Mapping[str, str],
    description: CacheDescription,
    source: str,
    worker: WorkerInfo,
    given: bool,
) -> list[int] | GroupBlocks | None:
    """Read ``kvaudit.blocks``: absent (the whole cache), one list for every group, or (an
    object) a list per group; where some group has a block space of its own, an absent key
    reads as every group's whole space.

    Args:
        metadata: The dump's metadata.
        description: The cache description the dump is read under.
        source: The dump, in errors.
        worker: The dump's worker (its role names the likely other engine in errors).
        given: Whether the description was given rather than embedded.

    Returns:
        None for the whole cache, one list of block ids, or a list (None: whole) per group.

    """
    if META_BLOCKS not in metadata:
        if description.has_group_spaces:
            return {group.id: None for group in description.groups}
        return None
    data = load_json(metadata[META_BLOCKS], source, META_BLOCKS)
    if isinstance(data, dict):
        return _parse_group_blocks(data, description, source, worker, given)
    if not isinstance(data, list):
        fail(
            source,
            f"{META_BLOCKS}: expected a list of block ids or an object of lists by group id, "
            f"got {short(data)}",
        )
    if description.has_group_spaces:
        # One list for groups of different spaces: each id must be in every space.
        smallest = min(description.groups, key=lambda group: description.blocks_of(group.id))
        space = description.blocks_of(smallest.id)
        label = f" (group {smallest.id}'s block space)"
    else:
        space, label = description.num_blocks, ""
    return _block_list(data, META_BLOCKS, space, label, source, worker, given)


def _block_list(
    data: list[Any],
    where: str,
    space: int,
    label: str,
    source: str,
    worker: WorkerInfo,
    given: bool,
) -> list[int]:
    """One list of block ids in a space of ``space`` blocks: integers in it, none twice."""
    seen: set[int] = set()
    for index, block_id in enumerate(data):
        if given and is_int(block_id) and block_id >= space:
            fail(
                source,
                f"{where}[{index}]: block id {block_id} is past the last block "
                f"{space - 1}{label}; " + other_engine_hint(worker.role, space),
            )
        if not is_int(block_id) or not 0 <= block_id < space:
            fail(
                source,
                f"{where}[{index}]: expected a block id from 0 to {space - 1}{label}, got "
                f"{short(block_id)}",
            )
        if block_id in seen:
            fail(source, f"{where}[{index}]: block {block_id} is listed twice")
        seen.add(block_id)
    return [int(block_id) for block_id in data]


def _parse_group_blocks(
    data: dict[Any, Any],
    description: CacheDescription,
    source: str,
    worker: WorkerInfo,
    given: bool,
) -> GroupBlocks:
    """``kvaudit.blocks`` as an object: each named group's list, the others whole."""
    group_ids = {group.id for group in description.groups}
    result: GroupBlocks = {group.id: None for group in description.groups}
    for key, items in data.items():
        group_id = group_key(source, META_BLOCKS, key, group_ids)
        where = f"{META_BLOCKS}.{group_id}"
        if not isinstance(items, list):
            fail(source, f"{where}: expected a list of block ids, got {short(items)}")
        space = description.blocks_of(group_id)
        if len(items) > space:
            fail(
                source,
                f"{where}: {len(items)} block ids, more than the {space} blocks of group "
                f"{group_id}'s space",
            )
        result[group_id] = _block_list(items, where, space, "", source, worker, given)
    return result


def check_group_blocks(
    source: str,
    where: str,
    start: object,
    block_ids: object,
    holds: Callable[[int], bool],
    not_held: str,
) -> None:
    """Check a group entry's start position and block ids: integers, held, none listed twice.

    Args:
        source: The dump, in errors.
        where: The entry's place, in errors.
        start: The entry's start position.
        block_ids: The entry's block ids.
        holds: Whether the dump holds a block id.
        not_held: What an error says of a block not held.

    """
    if not is_int(start) or start < 0:
        fail(source, f"{where}: start position must be a non-negative integer, got {short(start)}")
    if not isinstance(block_ids, (list, tuple)):
        fail(source, f"{where}: expected a list of block ids, got {short(block_ids)}")
    # Python ints, each held, none twice, checked at C speed (``holds`` is a set's or a
    # range's ``__contains__`` when read); any doubt falls to the loop, which names the block.
    if (
        set(map(type, block_ids)) <= {int}
        and all(map(holds, block_ids))
        and len(set(block_ids)) == len(block_ids)
    ):
        return
    seen: set[int] = set()
    for block_id in block_ids:
        if not is_int(block_id):
            fail(source, f"{where}: block id {short(block_id)} is not an integer")
        if not holds(block_id):
            fail(source, f"{where}: block {block_id} {not_held}")
        if block_id in seen:
            fail(source, f"{where}: block {block_id} is listed at two positions")
        seen.add(block_id)


def group_key(source: str, where: str, key: object, group_ids: set[int]) -> int:
    """A JSON object's key read as a group id of the description.

    Args:
        source: The dump, in errors.
        where: The key's place in the metadata, in errors.
        key: The key (a decimal string).
        group_ids: The description's group ids.

    Returns:
        The group id.

    """
    if not isinstance(key, str) or not (key.isascii() and key.isdigit()) or str(int(key)) != key:
        fail(source, f"{where}: group key {short(key)} is not a decimal group id")
    group_id = int(key)
    if group_id not in group_ids:
        fail(source, f"{where}: group {group_id} is not a group of the cache description")
    return group_id


def row_spaces(
    description: CacheDescription, blocks: list[int] | GroupBlocks | None
) -> tuple[int | dict[int, int], list[int] | GroupBlocks | None, dict[int, Callable[[int], bool]]]:
    """A dump's rows (one count, or per group), its block ids as ``Dump`` keeps them, and
    per group what says whether it holds a block.

    Args:
        description: The dump's cache description.
        blocks: ``kvaudit.blocks`` as ``parse_blocks`` returns it.

    Returns:
        The rows, the block ids, and per group id a test of a block id.

    """
    if isinstance(blocks, dict):
        rows = {
            group_id: description.blocks_of(group_id) if ids is None else len(ids)
            for group_id, ids in blocks.items()
        }
        # Called once per listed block: a C method, not a Python function.
        holds = {
            group_id: (range(rows[group_id]) if ids is None else set(ids)).__contains__
            for group_id, ids in blocks.items()
        }
        return rows, blocks, holds
    num_rows = len(blocks) if blocks is not None else description.num_blocks
    shared = (set(blocks) if blocks is not None else range(num_rows)).__contains__
    return num_rows, blocks, {group.id: shared for group in description.groups}
