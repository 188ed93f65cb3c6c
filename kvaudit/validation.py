"""Checks shared by every reader of user input: one-line errors, roles, ranks and layouts.

The description loader, the dump reader and writer, records and the checksummer all
report bad input the same way: a ``KvauditError`` naming the source, the key path and
the problem. This module holds the pieces they share and the names of roles and
position numberings, so that nothing below it needs a bare string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Literal, NoReturn, Protocol, cast, get_args

import numpy as np

from .errors import KvauditError

Role = Literal["producer", "consumer", "offload"]
"""Which side of a transfer a worker's checksums come from."""

ROLES: tuple[Role, ...] = get_args(Role)

Positions = Literal["request", "block"]
"""How checksums number their positions: by request position or by block."""

POSITION_NUMBERINGS: tuple[Positions, ...] = get_args(Positions)


def is_int(value: object) -> bool:
    """True for a Python or numpy integer, but not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def short(value: object, limit: int = 60) -> str:
    """A value for a one-line message: its JSON (else its repr), cut to ``limit``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return short_text(text, limit)


def short_text(text: str, limit: int = 60) -> str:
    """``text``, cut to ``limit`` characters with ``...`` when longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def join(path: str, key: object) -> str:
    """The key path of a named field: ``path.key``, or ``key`` at the top."""
    return f"{path}.{key}" if path else str(key)


def fail(source: str | None, message: str) -> NoReturn:
    """Raise the ``KvauditError`` naming ``source`` (a file, a handle) and the problem."""
    raise KvauditError(message, source=source)


class Checker:
    """Checks one source's input key by key; every failure is one ``KvauditError``
    (``error``) that names the source, the key path and the problem."""

    error: type[KvauditError] = KvauditError
    limit: int = 60  # the longest value shown in a message

    def __init__(self, source: str | None) -> None:
        self.source = source

    def fail(self, path: str, problem: str) -> NoReturn:
        """Raise ``path: problem`` (the problem alone at the top) for this source."""
        raise self.error(f"{path}: {problem}" if path else problem, source=self.source)

    def got(self, value: object) -> str:
        """``got <value>``, the end of a message about a wrong value."""
        return f"got {short(value, self.limit)}"

    def role(self, value: object, path: str) -> Role:
        """A worker role: producer, consumer or offload."""
        if value not in ROLES:
            self.fail(path, f"expected one of {', '.join(ROLES)}, {self.got(value)}")
        return cast(Role, value)

    def rank(self, rank: int, size: int, path: str) -> None:
        """A rank from 0 to one below its size."""
        if not 0 <= rank < size:
            self.fail(path, f"{rank} is not in 0..{size - 1}")

    def ranks(self, worker: WorkerRanks, path: str = "") -> None:
        """A worker's TP and PP ranks, each below its size."""
        self.rank(worker.tp_rank, worker.tp_size, join(path, "tp_rank"))
        self.rank(worker.pp_rank, worker.pp_size, join(path, "pp_rank"))


class WorkerRanks(Protocol):
    """What identifies a worker in its engine: its ranks and sizes, and its source."""

    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def pp_rank(self) -> int: ...
    @property
    def pp_size(self) -> int: ...
    @property
    def source(self) -> str: ...


def check_worker(worker: WorkerRanks, role: object, source: str | None, path: str = "") -> None:
    """A worker's role and ranks, as a caller of the library gives them.

    Raises:
        KvauditError: An unknown role, or a rank outside its size.

    """
    checker = Checker(source)
    checker.role(role, join(path, "role"))
    checker.ranks(worker, path)


def describe_worker(worker: WorkerRanks) -> str:
    """A worker's name in messages: its source, else its ranks."""
    return worker.source or f"worker pp_rank={worker.pp_rank} tp_rank={worker.tp_rank}"


def worker_layout(workers: Sequence[WorkerRanks]) -> list[tuple[int, int]]:
    """The ``(pp_rank, tp_rank)`` that one engine's workers lack, in order.

    Raises:
        KvauditError: Workers that disagree on the TP or PP size, ranks out of range, or
            two workers with the same ranks; the message names them.

    """
    first = workers[0]
    seen: dict[tuple[int, int], WorkerRanks] = {}
    for worker in workers:
        name = describe_worker(worker)
        for size in ("tp_size", "pp_size"):
            if getattr(worker, size) != getattr(first, size):
                fail(
                    name,
                    f"{size} {getattr(worker, size)}, but {describe_worker(first)} has {size} "
                    f"{getattr(first, size)}: the workers of one set come from one engine",
                )
        Checker(name).ranks(worker)
        ranks = (worker.pp_rank, worker.tp_rank)
        if ranks in seen:
            fail(
                name,
                f"same worker (pp_rank {ranks[0]}, tp_rank {ranks[1]}) as "
                f"{describe_worker(seen[ranks])}",
            )
        seen[ranks] = worker
    return [
        (pp, tp)
        for pp in range(first.pp_size)
        for tp in range(first.tp_size)
        if (pp, tp) not in seen
    ]
