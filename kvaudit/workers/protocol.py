"""The raw-KV protocols: one worker's KV cache rows, however they are held (a dump's
memory-mapped file, live tensors, an engine's agent fetching on demand), read the same way
for checksumming, locating differences and comparing values.

``Listing`` is a request as a worker lists it, ``RawWorker`` a worker whose rows are at
hand, ``FetchingWorker`` one whose rows are fetched on demand; ``request_rows`` turns a
worker's listing into rows for a ``Checksummer``, and ``Progress`` is what a long checksum
tells its caller. They sit below ``checksum`` and ``sources`` so that both, and every
package that reads raw KV, import them from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..core.errors import KvauditError
from ..core.scheme import valid_tokens
from ..views.inputs import RequestBlocks

if TYPE_CHECKING:
    from ..description import CacheDescription
    from ..records import WorkerInfo
    from ..views import GroupViews, LayerTensor

Progress = Callable[[int], None]
"""Called with the bytes checksummed since its last call."""


class Listing(Protocol):
    """A request as a worker lists it: its token count and, per group, the position of the
    first listed block and the engine block ids of consecutive positions."""

    num_tokens: int
    groups: Mapping[int, tuple[int, Sequence[int]]]


class KnownWorker(Protocol):
    """What every worker says of itself, whether its raw KV is at hand or fetched."""

    @property
    def name(self) -> str:
        """The worker in messages: a dump's path, a live handle, an agent's socket."""

    @property
    def worker(self) -> WorkerInfo:
        """Its ranks and role."""

    @property
    def description(self) -> CacheDescription:
        """The cache it holds."""


class RawWorker(KnownWorker, Protocol):
    """One worker's raw KV: ``num_rows`` block rows of every layer tensor of its
    description, the requests it lists (engine block ids) and where each block's row is.

    Implementations are dataclasses with a ``requests`` field (a source trims requests by
    replacing it).
    """

    @property
    def tensors(self) -> Mapping[str, LayerTensor]:
        """Layer name to its rows (``N`` axis: the rows' kernel blocks; states: first axis)."""

    @property
    def layer_arrays(self) -> Mapping[str, LayerTensor]:
        """The same rows as the worker holds them without importing torch where it can (a
        dump's numpy arrays; a live worker's tensors)."""

    @property
    def array_views(self) -> dict[int, GroupViews]:
        """Every group's views of ``layer_arrays``, built once (inventories, locating and
        planting read these)."""

    @property
    def num_rows(self) -> int | dict[int, int]:
        """The block rows each tensor holds: one count, or per group id where groups hold
        rows of their own block spaces."""

    @property
    def requests(self) -> Mapping[str, Listing]:
        """Request id to its listed blocks (engine block ids)."""

    @property
    def group_views(self) -> dict[int, GroupViews]:
        """Every group's views of the rows, built once."""

    def row_of(self, block_id: int, group_id: int | None = None) -> int:
        """The row of the group's layers that holds an engine block."""

    def drop_pages(self) -> None:
        """Release the memory its rows hold resident, if they are file pages."""


@runtime_checkable
class FetchingWorker(KnownWorker, Protocol):
    """A worker whose raw KV lives elsewhere (an engine's agent): it lists its requests
    and fetches the blocks of given request positions on demand, as ``RawWorker``s."""

    def fetch(
        self, request_id: str, group_id: int, spans: Sequence[tuple[int, int]]
    ) -> list[RawWorker]:
        """Workers holding the request's blocks of the group that cover the token spans
        ``(lo, hi)`` (none where it holds none)."""


def fetches(workers: Sequence[RawWorker | FetchingWorker]) -> bool:
    """Whether some worker fetches its blocks from elsewhere (locating reads only the
    differing positions of such a side; nothing reads all its blocks)."""
    return any(isinstance(worker, FetchingWorker) for worker in workers)


def fetched(
    workers: Sequence[RawWorker | FetchingWorker],
    request_id: str,
    group_id: int,
    positions: Iterable[int],
    block_size: int,
    num_tokens: int,
) -> list[RawWorker]:
    """The workers as locating reads them at ``positions`` (in blocks of ``block_size``):
    a ``FetchingWorker`` replaced by the blocks it fetches of those positions only."""
    spans = []
    for position in sorted(set(positions)):
        lo = position * block_size
        hi = lo + int(valid_tokens(num_tokens, block_size, position))
        if hi > lo:
            spans.append((lo, hi))
    result: list[RawWorker] = []
    for worker in workers:
        if isinstance(worker, FetchingWorker):
            result.extend(worker.fetch(request_id, group_id, spans) if spans else [])
        else:
            result.append(worker)
    return result


def request_rows(
    worker: RawWorker, request_ids: Iterable[str] | None = None
) -> dict[str, RequestBlocks]:
    """The requests' blocks as rows of the worker (all requests by default), for a
    ``Checksummer`` over its tensors.

    Raises:
        KvauditError: A request the worker does not list, or a block it does not hold.

    """
    ids = list(worker.requests) if request_ids is None else list(dict.fromkeys(request_ids))
    result = {}
    for request_id in ids:
        request = worker.requests.get(request_id)
        if request is None:
            raise KvauditError(f"no request {request_id!r} in this dump", source=worker.name)
        result[request_id] = RequestBlocks(
            request.num_tokens,
            {
                group_id: (start, [worker.row_of(block_id, group_id) for block_id in block_ids])
                for group_id, (start, block_ids) in request.groups.items()
            },
        )
    return result
