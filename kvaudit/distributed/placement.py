"""Which process reads which dump file: SOURCE rank fields filled in per process, and
the files every process sees shared out among them by size.

A SOURCE without rank fields names the same files on every process (a shared file
system): they are shared out among all processes. A path with ``{rank}``,
``{local_rank}`` or ``{node_rank}`` names each process's own files, on its node's disk:
a file is then shared only among the processes of one node that name the same path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.errors import KvauditError
from ..core.files import check_input
from ..dumps.dump_sets import expand_dump_paths
from . import RANK_FIELDS
from .comm import Place


def fill(name: str, place: Place) -> str:
    """A SOURCE argument with ``{rank}``, ``{local_rank}`` and ``{node_rank}`` filled in
    (other braces are left as they are)."""
    return (
        name.replace("{rank}", str(place.rank))
        .replace("{local_rank}", str(place.local_rank))
        .replace("{node_rank}", str(place.node_rank))
    )


def is_local(name: str) -> bool:
    """Whether a SOURCE argument names each process's (or node's) own files."""
    return any(marker in name for marker in RANK_FIELDS)


@dataclass(frozen=True)
class Unit:
    """Dump paths one process opens together (one dump file; vLLM ExampleConnector
    folders are a source kind of their own, opened whole by every process), the key under
    which processes that see the same files find them, and their size in bytes."""

    key: str
    paths: tuple[str, ...]
    size: int


def units(names: Sequence[str], place: Place) -> list[Unit]:
    """The dump units this process sees for its SOURCE arguments.

    Raises:
        KvauditError: A path that does not exist, or a directory without dumps.

    """
    found: list[Unit] = []
    for name in names:
        path = fill(name, place)
        check_input(path, directory=True)  # a FIFO or a device would block
        scope = f"node {place.node_rank}:" if is_local(name) else "shared:"
        for item in expand_dump_paths([path]):
            found.append(Unit(scope + os.path.abspath(item), (item,), os.stat(item).st_size))
    return found


def assign(seen: Sequence[Sequence[Unit]]) -> list[list[Unit]]:
    """The units each process opens, from the units every process sees (by rank): each
    distinct unit goes to the process, among those that see it, with the fewest bytes so
    far (the lowest rank on a tie). Every process computes the same answer.

    Raises:
        KvauditError: No process sees any dump.

    """
    holders: dict[str, list[int]] = {}
    by_key: dict[str, Unit] = {}
    for rank, listed in enumerate(seen):
        for unit in listed:
            holders.setdefault(unit.key, []).append(rank)
            by_key.setdefault(unit.key, unit)
    if not by_key:
        raise KvauditError("no dumps given")
    load = [0] * len(seen)
    result: list[list[Unit]] = [[] for _ in seen]
    for key in sorted(by_key, key=lambda k: (-by_key[k].size, k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        load[rank] += by_key[key].size
        result[rank].append(by_key[key])
    for own in result:
        own.sort(key=lambda unit: unit.key)
    return result
