"""The raw-KV protocol: one worker's KV cache rows, however it is held, read the same way
for checksumming and for locating differences.

A ``RawWorker`` is a dump (``kvaudit.dumps.Dump``: memory-mapped rows of a file) or a
``TensorWorker`` (a whole cache in memory, on the CPU or a GPU). A source that holds raw KV
derives from ``RawKVSource``: its inventory, token counts and ``raw_kv`` come from its
workers, and it says only how to checksum them (dumps in bounded batches, live tensors in
place).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..checksum.checksummer import Checksummer
from ..core.errors import KvauditError
from ..core.scheme import valid_tokens
from ..core.validation import worker_layout
from ..description import CacheDescription
from ..records import Record, WorkerInfo, WorkerRecord, combine_workers
from ..views import GroupViews, build_group_views
from ..views.inputs import RequestBlocks
from .base import Listing, Runtime, Source, request_ids_of, token_counts_of, trim

if TYPE_CHECKING:
    from ..views import LayerTensor
    from .inventory import Inventory


class RawWorker(Protocol):
    """One worker's raw KV: ``num_rows`` block rows of every layer tensor of its
    description, the requests it lists (engine block ids) and where each block's row is.

    Implementations are dataclasses with a ``requests`` field (a source trims requests by
    replacing it).
    """

    @property
    def name(self) -> str:
        """The worker in messages: a dump's path, a live handle."""

    @property
    def worker(self) -> WorkerInfo:
        """Its ranks and role."""

    @property
    def description(self) -> CacheDescription:
        """The cache its tensors hold."""

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
class FetchingWorker(Protocol):
    """A worker whose raw KV lives elsewhere (an engine's agent): it lists its requests
    and fetches the blocks of given request positions on demand, as ``RawWorker``s."""

    @property
    def name(self) -> str:
        """The worker in messages."""

    @property
    def worker(self) -> WorkerInfo:
        """Its ranks and role."""

    @property
    def description(self) -> CacheDescription:
        """The cache it holds."""

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


@dataclass
class TensorWorker:
    """One worker's whole cache in memory (``num_rows`` blocks, or per group id; engine
    block ids; any strides, any device), with who it is and its requests' blocks: a
    ``RawWorker``."""

    name: str
    worker: WorkerInfo
    description: CacheDescription
    tensors: Mapping[str, LayerTensor]
    num_rows: int | dict[int, int]
    requests: dict[str, RequestBlocks]

    def row_of(self, block_id: int, group_id: int | None = None) -> int:
        """Row ``i`` is engine block ``i`` of every group's space (the checksummer checks
        the range)."""
        return block_id

    def drop_pages(self) -> None:
        """Nothing: live tensors are not file pages."""

    @property
    def layer_arrays(self) -> Mapping[str, LayerTensor]:
        """The live tensors themselves."""
        return self.tensors

    @property
    def array_views(self) -> dict[int, GroupViews]:
        """The views of the live tensors."""
        return self.group_views

    @functools.cached_property
    def group_views(self) -> dict[int, GroupViews]:
        """Every group's views of the cache, as its checksummer sees them."""
        worker = self.worker
        with one_line_errors(self.name):
            return build_group_views(
                self.description,
                self.tensors,
                tp_rank=worker.tp_rank,
                tp_size=worker.tp_size,
                num_blocks=self.num_rows,
            )

    def checksummer(self, runtime: Runtime | None = None) -> Checksummer:
        """A checksummer of the tensors: moved to ``runtime``'s device first, or where
        they are (the backend that suits their device) when ``runtime`` is None."""
        tensors = self.tensors
        if runtime is not None:
            tensors = {name: _to_device(tensor, runtime.device) for name, tensor in tensors.items()}
        with one_line_errors(self.name):
            return Checksummer.of_worker(
                self.description,
                tensors,
                self.worker,
                backend="auto" if runtime is None else runtime.backend,
                num_blocks=self.num_rows,
                source=self.name,
            )


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


def checksum_each(
    workers: Iterable[tuple[Checksummer, Mapping[str, RequestBlocks]]],
    request_ids: Sequence[str] | None,
    positions: str | None,
) -> Record:
    """Each worker's checksums of those of its requests asked for (all when
    ``request_ids`` is None), summed into one record."""
    records: list[WorkerRecord] = []
    for summer, requests in workers:
        if request_ids is not None:
            requests = {rid: requests[rid] for rid in request_ids if rid in requests}
        records.append(summer.checksum(requests, positions or "request"))
    return combine_workers(records)


class RawKVSource(Source):
    """A source of one engine's raw KV: workers read through the ``RawWorker`` protocol.

    Subclasses give the workers, say how to checksum them and which workers the layout
    misses; inventory, token counts, trimming and ``raw_kv`` are shared.
    """

    def __init__(self, names: Sequence[str], workers: Sequence[RawWorker]) -> None:
        super().__init__(names)
        self.workers = list(workers)

    @property
    def request_ids(self) -> list[str]:
        return request_ids_of(worker.requests for worker in self.workers)

    def layout(self) -> tuple[bool, list[tuple[int, int]]]:
        """Whether the workers are the whole engine, and the ``(pp_rank, tp_rank)`` missing.

        Raises:
            KvauditError: Workers whose ranks clash or disagree on the TP and PP sizes.

        """
        missing = worker_layout([worker.worker for worker in self.workers])
        return not missing, missing

    def inventory(self) -> Inventory:
        # Imported here: only inspect lists a source, a checksum never does.
        from .inventory import Inventory, raw_inventory, request_inventory

        workers = [raw_inventory(worker) for worker in self.workers]
        complete, missing = self.layout()
        return Inventory(
            self.kind,
            self.names,
            workers,
            complete,
            missing,
            request_inventory(worker.requests for worker in self.workers),
        )

    def token_counts(self) -> dict[str, int]:
        return token_counts_of(worker.requests for worker in self.workers)

    def trimmed_workers(self, num_tokens: Mapping[str, int]) -> list[RawWorker]:
        """The workers with the given requests cut to at most ``num_tokens[id]`` tokens."""
        return [
            dataclasses.replace(worker, requests=trim(worker.requests, num_tokens))
            for worker in self.workers
        ]

    def raw_kv(self) -> list[RawWorker | FetchingWorker]:
        return list(self.value_kv(None))

    def value_kv(self, request_ids: Sequence[str] | None) -> list[RawWorker]:
        self.layout()
        return sorted(self.workers, key=lambda raw: (raw.worker.pp_rank, raw.worker.tp_rank))


@contextmanager
def one_line_errors(name: str) -> Iterator[None]:
    """Report what a worker's tensors or ranks handed over in Python make the library
    raise as one line naming the worker."""
    try:
        yield
    except KvauditError:
        raise
    except (ValueError, TypeError, RuntimeError) as error:
        raise KvauditError(one_line(error), name) from None


def one_line(error: BaseException) -> str:
    """An exception as ``Type: message`` on one line."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _to_device(tensor: LayerTensor, device: str) -> LayerTensor:
    """A layer's tensor (or K and V tensors) on ``device``."""
    if isinstance(tensor, tuple):
        return tuple(part.to(device) for part in tensor)
    return tensor.to(device)
