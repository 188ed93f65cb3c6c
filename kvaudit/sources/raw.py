"""Sources of raw KV: workers read through the raw-KV protocol (``kvaudit.workers``), the
same way for checksumming and for locating differences.

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
from typing import TYPE_CHECKING

from ..checksum.checksummer import Checksummer
from ..core.errors import KvauditError
from ..core.validation import worker_layout
from ..description import CacheDescription
from ..records import Record, WorkerInfo, WorkerRecord, combine_workers
from ..views import GroupViews, build_group_views
from ..views.inputs import RequestBlocks
from ..workers.protocol import FetchingWorker, RawWorker
from .base import RecordQuery, Runtime, Source, request_ids_of, token_counts_of, trim

if TYPE_CHECKING:
    from ..views import LayerTensor
    from ..workers.inventory import Inventory


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


def checksum_each(
    workers: Iterable[tuple[Checksummer, Mapping[str, RequestBlocks]]],
    query: RecordQuery,
) -> Record:
    """Each worker's checksums of those of its requests ``query`` asks for, summed into
    one record."""
    records: list[WorkerRecord] = []
    for summer, requests in workers:
        if query.request_ids is not None:
            requests = {rid: requests[rid] for rid in query.request_ids if rid in requests}
        records.append(summer.checksum(requests, query.numbering()))
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
        from ..workers.inventory import Inventory, raw_inventory, request_inventory

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
