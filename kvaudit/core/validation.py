"""Checks shared by every reader of user input: one-line errors, roles, ranks and layouts.

The description loader, the dump reader and writer, records and the checksummer all
report bad input the same way: a ``KvauditError`` naming the source, the key path and
the problem. This module holds the pieces they share and the names of roles and
position numberings, so that nothing below it needs a bare string.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NoReturn, Protocol, cast, get_args

from .errors import KvauditError

Role = Literal["producer", "consumer", "offload"]
"""Which side of a transfer a worker's checksums come from."""

ROLES: tuple[Role, ...] = get_args(Role)

Positions = Literal["request", "block"]
"""How checksums number their positions: by request position or by block."""

POSITION_NUMBERINGS: tuple[Positions, ...] = get_args(Positions)

# Limits on input (docs/cli.md, "Limits on input"): what a file may claim, checked before
# anything is allocated or computed from it.
MAX_HEADER_BYTES = 100_000_000
"""The longest safetensors JSON header read (safetensors' own limit)."""
MAX_DEPTH = 64
"""The deepest nesting of JSON or YAML values (a description needs 5 levels)."""
MAX_WORKERS = 1 << 16
"""The most workers (``tp_size * pp_size``) one engine may have."""
MAX_BLOCK_SIZE = 1 << 24
"""The largest block size in tokens (a block of 16,777,216 tokens)."""
MAX_TOKENS = 1 << 40
"""The most tokens of one request; with the block size's limit no position's tokens
overflow 64-bit integers."""
MAX_POSITION_TOKEN = 1 << 62
"""The furthest first token of a position past which nothing is computed."""
MAX_COUNT = 1 << 48
"""The largest other count or size (blocks, heads, head size, ...)."""
MAX_YAML_BYTES = 10_000_000
"""The largest description YAML file read."""
MAX_YAML_NODES = 100_000
"""The most YAML nodes a description may expand to, aliases counted at each use."""


def is_int(value: object) -> bool:
    """True for a Python or numpy integer, but not a bool."""
    if isinstance(value, int):
        return not isinstance(value, bool)
    # No numpy integer exists before numpy is imported: the commands that compute nothing
    # (``--help``) never import it for this check.
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.integer)


def short(value: object, limit: int = 60) -> str:
    """A value for a one-line message: its JSON (else its repr), cut to ``limit``."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)
        except (RecursionError, ValueError):
            text = f"a {type(value).__name__}"
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


class DuplicateKeyError(ValueError):
    """A JSON object that names one key twice (``json`` would keep the last silently)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's ``object_pairs_hook`` that refuses a key named twice.

    Raises:
        DuplicateKeyError: The first key named twice.

    """
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return data


def load_json(text: str | bytes, source: str | None, what: str) -> Any:
    """Parse JSON ``text`` (``what`` in ``source``) and check it with ``check_plain``.

    Raises:
        KvauditError: Not JSON, nested too deeply, or a string that is not Unicode text.

    """
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
    except RecursionError:
        fail(source, f"{what}: nested more than {MAX_DEPTH} levels deep")
    except DuplicateKeyError as error:
        fail(source, f"{what}: key {short(error.key)} appears twice")
    except json.JSONDecodeError as error:
        fail(source, f"{what}: not valid JSON ({error})")
    except ValueError as error:
        fail(source, f"{what}: not valid JSON ({short_text(str(error))})")
    check_plain(data, source, what)
    return data


def check_plain(
    data: object,
    source: str | None,
    what: str = "",
    error: type[KvauditError] = KvauditError,
) -> None:
    """Check parsed JSON-like data (dicts, lists, scalars) before anything reads it: at
    most ``MAX_DEPTH`` levels deep, and every string (keys too) encodable as UTF-8, so
    that no lone surrogate reaches a message, a table or a file.

    Raises:
        KvauditError: The first problem, with the key path where it is.

    """
    pending: list[tuple[object, int, tuple[Any, ...]]] = [(data, 0, ())]
    while pending:
        value, depth, path = pending.pop()
        if depth > MAX_DEPTH:
            raise error(
                f"{_path_text(what, path)}: nested more than {MAX_DEPTH} levels deep", source
            )
        items: Iterable[tuple[object, object]]
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            if isinstance(value, str):
                _check_text(value, source, what, path, error)
            continue
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, source, what, (*path, key), error)
            if isinstance(item, (dict, list, str)):
                pending.append((item, depth + 1, (*path, key)))


def _check_text(
    text: str, source: str | None, what: str, path: tuple[Any, ...], error: type[KvauditError]
) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        raise error(
            f"{_path_text(what, path)}: not Unicode text (a lone surrogate "
            f"U+{ord(text[bad.start]):04X} at character {bad.start})",
            source,
        ) from None


def _path_text(what: str, path: tuple[Any, ...]) -> str:
    text = what
    for key in path:
        if isinstance(key, int):
            text += f"[{key}]"
        else:
            safe = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
            text = join(text, short_text(safe, 40))
    return text or "value"


def check_int(
    value: object, source: str | None, path: str, minimum: int = 0, maximum: int = MAX_COUNT
) -> int:
    """An integer (not a bool) from ``minimum`` to ``maximum``, as a Python int.

    Raises:
        KvauditError: Anything else; the message names ``path`` and the bounds.

    """
    if not is_int(value) or not minimum <= value <= maximum:
        fail(source, f"{path}: expected an integer from {minimum} to {maximum}, got {short(value)}")
    return int(value)  # type: ignore[call-overload]


def check_positions(
    source: str | None,
    where: str,
    num_tokens: int,
    block_size: int,
    start: int,
    count: int,
    error: type[KvauditError] = KvauditError,
) -> None:
    """A group's positions ``start .. start + count - 1`` against its request's tokens.

    The first listed position must hold a token (``start * block_size < num_tokens``)
    and the last must stay within the limits, so that no position's first token
    overflows a 64-bit integer.

    Raises:
        KvauditError: A start at or beyond the request's tokens, or positions past the
            limits; the message names ``where``.

    """
    if num_tokens > MAX_TOKENS:
        raise error(
            f"{where}: {num_tokens} tokens, more than the {MAX_TOKENS} kvaudit reads", source
        )
    if block_size > MAX_BLOCK_SIZE:
        raise error(
            f"{where}: block size {block_size}, more than the {MAX_BLOCK_SIZE} kvaudit reads",
            source,
        )
    if count and start * block_size >= num_tokens:
        raise error(
            f"{where}: start position {start} (token {start * block_size}) is beyond the "
            f"request's {num_tokens} tokens",
            source,
        )
    if (start + count) * block_size > MAX_POSITION_TOKEN:
        raise error(
            f"{where}: {count} positions from {start} reach past token {MAX_POSITION_TOKEN}",
            source,
        )


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
        """A worker's TP and PP ranks, each below its size, and at most ``MAX_WORKERS``
        workers in its engine."""
        for size in ("tp_size", "pp_size"):
            value = getattr(worker, size)
            if not is_int(value) or not 1 <= value <= MAX_WORKERS:
                self.fail(
                    join(path, size),
                    f"expected an integer from 1 to {MAX_WORKERS}, {self.got(value)}",
                )
        for rank in ("tp_rank", "pp_rank"):
            if not is_int(getattr(worker, rank)):
                self.fail(
                    join(path, rank), f"expected an integer, {self.got(getattr(worker, rank))}"
                )
        if worker.tp_size * worker.pp_size > MAX_WORKERS:
            self.fail(
                path,
                f"tp_size {worker.tp_size} x pp_size {worker.pp_size} is more than the "
                f"{MAX_WORKERS} workers kvaudit reads",
            )
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
    def role(self) -> str: ...
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
        KvauditError: Workers that disagree on the role (producer, consumer, offload) or
            on the TP or PP size, ranks out of range, more than ``MAX_WORKERS`` workers,
            or two workers with the same ranks; the message names them.

    """
    first = workers[0]
    seen: dict[tuple[int, int], WorkerRanks] = {}
    for worker in workers:
        name = describe_worker(worker)
        if worker.role != first.role:
            fail(
                name,
                f"role {short(worker.role)}, but {describe_worker(first)} is a "
                f"{short(first.role)}: the workers of one set have one role",
            )
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
