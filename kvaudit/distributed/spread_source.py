"""One engine's dump set spread over the processes of a torchrun job, as one ``Source``.

Every process runs the command (SPMD): it opens the dumps ``placement`` gives it, and
every process learns what each dump holds (its worker, requests and inventory; JSON), so
all take the same decisions. ``checksum`` computes each process's dumps where it runs
(its GPU or the CPU) and gathers one record per worker to every process, where they are
summed as in one process. Locating a difference asks for single blocks
(``kvaudit.distributed.locating``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..checksum.dump_set import checksum_dump_set
from ..core.errors import KvauditError
from ..core.validation import worker_layout
from ..description import CacheDescription, description_to_dict, parse_description
from ..dumps import Dump, DumpSet, open_dump
from ..formats import record_to_json
from ..records import Record, WorkerInfo, WorkerRecord, combine_workers
from ..sources import Source, open_source
from ..sources.base import RecordQuery, request_ids_of, token_counts_of, trim
from ..sources.registry import source_kind
from ..sources.sniffing import with_hint
from ..views.inputs import RequestBlocks
from ..workers.inventory import (
    GroupInfo,
    Inventory,
    WorkerInventory,
    raw_inventory,
    request_inventory,
)
from .comm import Comm
from .placement import Unit, assign, fill, units


@dataclass
class Held:
    """A dump of the spread set as every process knows it: the rank that opened it, its
    path there, its worker, its requests' blocks and block sizes, and its inventory."""

    rank: int
    name: str
    worker: WorkerInfo
    requests: dict[str, RequestBlocks]
    block_sizes: dict[int, int]
    inventory: WorkerInventory
    description: CacheDescription
    received: dict[str, bytes] = dataclasses.field(default_factory=dict)


def _held_json(dump: Dump) -> dict[str, Any]:
    """What every process learns of one of this process's dumps."""
    inventory = raw_inventory(dump)
    return {
        "name": dump.path,
        "worker": dataclasses.asdict(dump.worker),
        "requests": {
            rid: [
                request.num_tokens,
                {str(gid): [s, ids] for gid, (s, ids) in request.groups.items()},
            ]
            for rid, request in dump.requests.items()
        },
        "block_sizes": {str(group.id): group.block_size for group in dump.description.groups},
        "rows": inventory.rows,
        "groups": [dataclasses.asdict(group) for group in inventory.groups],
        "description": description_to_dict(dump.description),
        "received": {
            rid: request.received.hex()
            for rid, request in dump.requests.items()
            if request.received is not None
        },
    }


def _held(rank: int, data: Mapping[str, Any]) -> Held:
    """A dump as another process described it (``_held_json``)."""
    worker = WorkerInfo(**data["worker"])
    requests = {
        rid: RequestBlocks(count, {int(gid): (s, list(ids)) for gid, (s, ids) in groups.items()})
        for rid, (count, groups) in data["requests"].items()
    }
    groups = [GroupInfo(**group) for group in data["groups"]]
    return Held(
        rank,
        data["name"],
        worker,
        requests,
        {int(gid): size for gid, size in data["block_sizes"].items()},
        WorkerInventory(worker, data["rows"], groups),
        parse_description(data["description"], data["name"]),
        {rid: bytes.fromhex(text) for rid, text in data["received"].items()},
    )


def _open_unit(unit: Unit, config: CacheDescription | None) -> Dump:
    (path,) = unit.paths  # a dump file (placement.units)
    try:
        return open_dump(path, config)
    except KvauditError as error:
        raise with_hint(error) from None  # a record or a description is named as one


class SpreadSource(Source):
    """Dump files and directories of dumps read by several processes: one engine's dump
    set, each dump opened by one process only."""

    kind = "dumps"

    def __init__(
        self,
        names: Sequence[str],
        comm: Comm,
        local: Sequence[Dump],
        held: Sequence[Held],
        whole: Sequence[Dump] | None = None,
    ) -> None:
        super().__init__(names)
        self.comm = comm
        self.local = {dump.path: dump for dump in local}
        self.held = sorted(held, key=lambda item: (item.worker.pp_rank, item.worker.tp_rank))
        # The dumps before trimming: blocks sent for locating list the request as dumped.
        self.whole = {dump.path: dump for dump in (whole if whole is not None else local)}

    @property
    def processes(self) -> int:
        """How many processes share the work."""
        return self.comm.place.world

    @property
    def request_ids(self) -> list[str]:
        return sorted(request_ids_of(item.requests for item in self.held))

    def layout(self) -> tuple[bool, list[tuple[int, int]]]:
        """Whether the dumps are the whole engine, and the ``(pp_rank, tp_rank)`` missing."""
        missing = worker_layout([item.worker for item in self.held])
        return not missing, missing

    def inventory(self) -> Inventory:
        complete, missing = self.layout()
        return Inventory(
            self.kind,
            self.names,
            [item.inventory for item in self.held],
            complete,
            missing,
            request_inventory(item.requests for item in self.held),
        )

    def token_counts(self) -> dict[str, int]:
        return token_counts_of(item.requests for item in self.held)

    def work(self, request_ids: Sequence[str] | None) -> int:
        """The bytes this process checksums (its own dumps)."""
        total = 0
        for dump in self.local.values():
            rows = dump.row_bytes()
            for rid, request in dump.requests.items():
                if request_ids is None or rid in request_ids:
                    total += sum(len(ids) * rows[gid] for gid, (_, ids) in request.groups.items())
        return total

    def trimmed(self, num_tokens: Mapping[str, int]) -> SpreadSource:
        local = [
            dataclasses.replace(dump, requests=trim(dump.requests, num_tokens))
            for dump in self.local.values()
        ]
        held = [
            dataclasses.replace(item, requests=trim(item.requests, num_tokens))
            for item in self.held
        ]
        return SpreadSource(self.names, self.comm, local, held, list(self.whole.values()))

    def descriptions(self) -> list[CacheDescription]:
        return [item.description for item in self.held]

    def _stated_worker(self) -> WorkerInfo | None:
        return self.held[0].worker if self.held else None

    def _selected(self, request_ids: Sequence[str] | None) -> list[str]:
        if request_ids is None:
            return self.request_ids
        ids = list(dict.fromkeys(request_ids))
        known = set(self.request_ids)
        for request_id in ids:
            if request_id not in known:
                paths = [item.name for item in self.held]
                where = os.path.commonpath(paths) if len(paths) > 1 else paths[0]
                raise KvauditError(f"no dump of the set holds request {request_id!r}", where)
        return ids

    def checksum(self, query: RecordQuery) -> Record:
        """Each process checksums its own dumps; the workers' records, gathered to every
        process, are summed as one process sums them."""
        ids, runtime = self._selected(query.request_ids), query.runtime

        def own() -> dict[str, Any]:
            result = {}
            for dump in self.local.values():
                record = checksum_dump_set(
                    DumpSet([dump], True),
                    request_ids=[rid for rid in ids if rid in dump.requests],
                    positions=query.numbering(),
                    backend=runtime.backend,
                    device=runtime.device,
                    progress=query.progress,
                )
                result[dump.path] = record_to_json(record)
            return result

        computed: dict[str, Any] = {}
        for part in self.comm.outcomes(own):
            computed.update(part)
        return combine_workers([_worker_record(item, computed[item.name]) for item in self.held])


def _worker_record(item: Held, data: Mapping[str, Any]) -> WorkerRecord:
    """A worker's record, from the one-worker record JSON its process computed."""
    record = Record.from_json(data, item.name)
    summary = record.workers[0]
    return WorkerRecord(
        item.worker,
        record.positions,
        summary.fingerprints,
        summary.not_covered,
        record.requests,
        summary.layers,
    )


def open_spread(
    names: Sequence[str], config: CacheDescription | None, comm: Comm, *, device_given: bool
) -> Source:
    """SOURCE arguments opened by every process: dumps spread over the processes (each
    opens those ``placement`` gives it); a record or another kind opened whole by each.

    Raises:
        KvauditError: On every process, when one cannot read its paths or dumps (naming
            its rank and the path), or when the dumps do not form one engine's set.

    """
    place = comm.place
    filled = [fill(name, place) for name in names]
    kinds = comm.outcomes(lambda: source_kind(filled)[0].name)
    for rank, kind in enumerate(kinds):
        if kind != kinds[0]:
            raise KvauditError(
                f"rank {rank} reads {', '.join(names)} as {kind}, rank 0 as {kinds[0]}"
            )
    if kinds[0] != "dumps":
        opened: list[Source] = []
        comm.outcomes(lambda: opened.append(open_source(filled, config, device_given=device_given)))
        return opened[0]
    seen = comm.outcomes(lambda: [dataclasses.asdict(unit) for unit in units(names, place)])
    shares = assign([[Unit(u["key"], tuple(u["paths"]), u["size"]) for u in part] for part in seen])
    local: list[Dump] = []

    def open_own() -> list[dict[str, Any]]:
        local.extend(_open_unit(unit, config) for unit in shares[place.rank])
        return [_held_json(dump) for dump in local]

    described = comm.outcomes(open_own)
    held = [_held(rank, data) for rank, part in enumerate(described) for data in part]
    worker_layout([item.worker for item in held])
    return SpreadSource(names, comm, local, held)
