"""Live ``Checksummer`` objects as a source: one engine's workers handed over in Python
(``kvaudit.testing.LiveSide``), with the requests' blocks of each and, optionally, the
tensors each checksummer was built over (with them, differences can be located).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..checksum.checksummer import Checksummer
from ..core.errors import KvauditError
from ..core.validation import worker_layout
from ..records import Record
from ..views.inputs import RequestBlocks, tensors_by_name
from ..workers import FetchingWorker, RawWorker
from ..workers.inventory import (
    Inventory,
    WorkerInventory,
    group_info,
    request_inventory,
    uniform_rows,
)
from .base import RecordQuery, Source, request_ids_of, token_counts_of, trim
from .raw import TensorWorker, checksum_each

if TYPE_CHECKING:
    from ..views.inputs import LayerTensors


class ChecksummerSource(Source):
    """One engine's workers as ``Checksummer`` objects, with each worker's requests' blocks
    and, optionally, the tensors each checksummer was built over."""

    kind = "live"

    def __init__(
        self,
        checksummers: Sequence[Checksummer],
        requests: Sequence[Mapping[str, RequestBlocks]],
        tensors: Sequence[LayerTensors] | None = None,
        name: str = "live",
    ) -> None:
        if not checksummers:
            raise KvauditError("no checksummers given", name)
        if len(requests) != len(checksummers):
            raise KvauditError(
                f"{len(checksummers)} checksummers but {len(requests)} request mappings", name
            )
        if tensors is not None and len(tensors) != len(checksummers):
            raise KvauditError(
                f"{len(checksummers)} checksummers but {len(tensors)} tensor mappings", name
            )
        super().__init__([name])
        self.checksummers = list(checksummers)
        self.requests = [dict(mapping) for mapping in requests]
        self.tensors = None if tensors is None else list(tensors)

    @property
    def request_ids(self) -> list[str]:
        return request_ids_of(self.requests)

    def inventory(self) -> Inventory:
        workers = [
            WorkerInventory(
                summer.worker,
                uniform_rows(summer.group_rows),
                [group_info(views, None) for _, views in sorted(summer.groups.items())],
            )
            for summer in self.checksummers
        ]
        missing = worker_layout([summer.worker for summer in self.checksummers])
        return Inventory(
            self.kind,
            self.names,
            workers,
            not missing,
            missing,
            request_inventory(self.requests),
        )

    def checksum(self, query: RecordQuery) -> Record:
        return checksum_each(zip(self.checksummers, self.requests, strict=True), query)

    def token_counts(self) -> dict[str, int]:
        return token_counts_of(self.requests)

    def trimmed(self, num_tokens: Mapping[str, int]) -> ChecksummerSource:
        requests = [trim(mapping, num_tokens) for mapping in self.requests]
        return ChecksummerSource(self.checksummers, requests, self.tensors, self.names[0])

    def raw_kv(self) -> list[RawWorker | FetchingWorker] | None:
        workers = self.value_kv(None)
        return None if workers is None else list(workers)

    def value_kv(self, request_ids: Sequence[str] | None) -> list[RawWorker] | None:
        if self.tensors is None:
            return None
        worker_layout([summer.worker for summer in self.checksummers])
        workers = []
        for summer, mapping, tensors in zip(
            self.checksummers, self.requests, self.tensors, strict=True
        ):
            name = summer.worker.source or (
                f"{self.names[0]} pp{summer.worker.pp_rank} tp{summer.worker.tp_rank}"
            )
            workers.append(
                TensorWorker(
                    name=name,
                    worker=dataclasses.replace(summer.worker, source=name),
                    description=summer.description,
                    tensors=tensors_by_name(summer.description, tensors, name),
                    num_rows=dict(summer.group_rows),
                    requests=dict(mapping),
                )
            )
        return sorted(workers, key=lambda raw: (raw.worker.pp_rank, raw.worker.tp_rank))
