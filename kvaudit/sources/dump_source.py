"""Dump sets as sources: dump files, directories of dumps and ExampleConnector folders,
one engine's workers, memory-mapped and checksummed in bounded batches.

Dumps are the kind a SOURCE argument is when no other kind claims it, so a path that does
not exist is reported as a missing dump.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..checksum.dump_set import checksum_dump_set, total_bytes
from ..description import CacheDescription
from ..dumps import DumpSet, open_dump_set
from ..records import Record, WorkerInfo
from .base import Progress, Runtime
from .raw import RawKVSource
from .registry import OpenOptions


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

    def checksum(
        self,
        request_ids: Sequence[str] | None,
        positions: str | None,
        runtime: Runtime,
        progress: Progress | None = None,
    ) -> Record:
        return checksum_dump_set(
            self.dump_set,
            request_ids=None if request_ids is None else list(request_ids),
            positions=positions or "request",
            backend=runtime.backend,
            device=runtime.device,
            progress=progress,
        )


def open_dumps(names: Sequence[str], claimed: Sequence[str], options: OpenOptions) -> DumpSource:
    """The dumps kind's opener (the fallback kind): every argument a dump or a folder."""
    return DumpSource(names, open_dump_set(names, options.config))


def dump_set_as_source(
    dump_set: DumpSet, config: CacheDescription | None, label: str
) -> DumpSource:
    """A ``DumpSet`` object as a source."""
    return DumpSource([dump.path for dump in dump_set.dumps], dump_set)
