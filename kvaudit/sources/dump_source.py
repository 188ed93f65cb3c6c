"""Dump sets as sources: dump files and directories of dumps, one engine's workers,
memory-mapped and checksummed in bounded batches; and folders of dump sets, one per
request (an output folder's ``dumps/``), read as one set. vLLM ExampleConnector folders
open as a dump source too (``kvaudit.sources.example_connector_source``).

Dumps are the kind a SOURCE argument is when no other kind claims it, so a path that does
not exist is reported as a missing dump.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from ..checksum.dump_set import checksum_dump_set, checksum_dump_sets, total_bytes
from ..core.errors import KvauditError
from ..description import CacheDescription
from ..dumps import DumpSet, open_dump_set
from ..dumps.dump_sets import is_dump_folders, open_dump_folders
from ..records import Record, WorkerInfo
from ..workers import FetchingWorker, RawWorker
from .base import RecordQuery, trim
from .raw import RawKVSource
from .registry import OpenOptions
from .sniffing import with_hint


class DumpSource(RawKVSource):
    """Dump files and directories of dumps: one engine's dump set."""

    kind = "dumps"

    def __init__(self, names: Sequence[str], dump_set: DumpSet) -> None:
        super().__init__(names, dump_set.dumps)
        self.dump_set = dump_set

    @property
    def request_ids(self) -> list[str]:
        return list(self.dump_set.request_ids)

    def layout(self) -> tuple[bool, list[tuple[int, int]]]:
        return self.dump_set.complete, list(self.dump_set.missing)

    def work(self, request_ids: Sequence[str] | None) -> int:
        ids = self.request_ids if request_ids is None else list(request_ids)
        return total_bytes(self.dump_set, ids)

    def trimmed(self, num_tokens: Mapping[str, int]) -> DumpSource:
        dumps = self.trimmed_workers(num_tokens)
        trimmed = DumpSet(dumps, self.dump_set.complete, list(self.dump_set.missing))
        return DumpSource(self.names, trimmed)

    def carried_checksums(self) -> DumpSet:
        return self.dump_set

    def _stated_worker(self) -> WorkerInfo | None:
        return self.dump_set.dumps[0].worker if self.dump_set.dumps else None

    def checksum(self, query: RecordQuery) -> Record:
        return _checksum_with(checksum_dump_set, self.dump_set, query)


class DumpFoldersSource(RawKVSource):
    """Folders of dump sets, one per request (an output folder's ``dumps/``): one
    engine's dumps of those requests, a worker's dumps of different requests in
    different files."""

    kind = "dumps"

    def __init__(self, names: Sequence[str], dump_sets: Sequence[DumpSet]) -> None:
        super().__init__(names, [dump for dump_set in dump_sets for dump in dump_set.dumps])
        self.dump_sets = list(dump_sets)

    @property
    def request_ids(self) -> list[str]:
        return [rid for dump_set in self.dump_sets for rid in dump_set.request_ids]

    def layout(self) -> tuple[bool, list[tuple[int, int]]]:
        # Each set's layout was checked when opened; a worker no set holds is missing.
        present = {(dump.worker.pp_rank, dump.worker.tp_rank) for dump in self.workers}
        missing = {ranks for dump_set in self.dump_sets for ranks in dump_set.missing}
        missing -= present
        return not missing, sorted(missing)

    def work(self, request_ids: Sequence[str] | None) -> int:
        total = 0
        for dump_set in self.dump_sets:
            listed = set(dump_set.request_ids)
            ids = None if request_ids is None else [r for r in request_ids if r in listed]
            if ids is None or ids:
                total += total_bytes(dump_set, ids)
        return total

    def trimmed(self, num_tokens: Mapping[str, int]) -> DumpFoldersSource:
        sets = [
            DumpSet(
                [
                    dataclasses.replace(dump, requests=trim(dump.requests, num_tokens))
                    for dump in dump_set.dumps
                ],
                dump_set.complete,
                list(dump_set.missing),
            )
            for dump_set in self.dump_sets
        ]
        return DumpFoldersSource(self.names, sets)

    def raw_kv(self) -> list[RawWorker | FetchingWorker]:
        return sorted(self.workers, key=lambda raw: (raw.worker.pp_rank, raw.worker.tp_rank))

    def value_kv(self, request_ids: Sequence[str] | None) -> list[RawWorker]:
        # The by-value comparison reads one dump per worker.
        raise KvauditError(
            f"{', '.join(self.names)} holds a dump set per request: compare values one "
            "request's folder at a time (FOLDER/REQUEST)"
        )

    def carried_checksums(self) -> DumpSet:
        complete, missing = self.layout()
        return DumpSet(list(self.workers), complete, missing)

    def _stated_worker(self) -> WorkerInfo | None:
        return self.workers[0].worker if self.workers else None

    def checksum(self, query: RecordQuery) -> Record:
        return _checksum_with(checksum_dump_sets, self.dump_sets, query)


def _checksum_with(function: Callable[..., Record], dumps: object, query: RecordQuery) -> Record:
    """``checksum_dump_set`` or ``checksum_dump_sets`` of ``dumps`` as ``query`` asks."""
    runtime = query.runtime
    return function(
        dumps,
        request_ids=query.ids(),
        positions=query.numbering(),
        backend=runtime.backend,
        device=runtime.device,
        progress=query.progress,
    )


def open_dumps(
    names: Sequence[str], claimed: Sequence[str], options: OpenOptions
) -> DumpSource | DumpFoldersSource:
    """The dumps kind's opener (the fallback kind): every argument a dump or a folder, or
    every argument a folder of dump sets, one per request. A file that does not read as a
    dump but looks like a description or a record is named as one."""
    try:
        if names and all(is_dump_folders(name) for name in names):
            sets, _ = open_dump_folders(names, options.config)
            return DumpFoldersSource(names, sets)
        return DumpSource(names, open_dump_set(names, options.config))
    except KvauditError as error:
        raise with_hint(error) from None


def dump_set_as_source(
    dump_set: DumpSet, config: CacheDescription | None, label: str
) -> DumpSource:
    """A ``DumpSet`` object as a source."""
    return DumpSource([dump.path for dump in dump_set.dumps], dump_set)
