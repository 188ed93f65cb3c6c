"""Records: checksums per request, group and block position under each replica key.

A ``WorkerRecord`` is what one worker computed; ``Record`` sums the workers of one
engine (a dump set) and is what ``kvaudit checksum --format json`` writes (docs/cli.md;
``kvaudit.formats`` writes it, ``Record.from_json`` reads it back).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import KvauditError
from .scheme import MASK64, ReplicaKey, from_hex, to_hex
from .validation import (
    MAX_BLOCK_SIZE,
    MAX_COUNT,
    MAX_TOKENS,
    MAX_WORKERS,
    POSITION_NUMBERINGS,
    Checker,
    Positions,
    Role,
    check_plain,
    check_positions,
    describe_worker,
    join,
    short,
    worker_layout,
)
from .wire import WireChecksums, WireGroup

RECORD_FORMAT = "kvaudit.record/1"


@dataclass
class GroupChecksums:
    """One group's checksums of one request.

    ``values[i, k]`` is the checksum of position ``start + i`` under
    ``replica_keys[k]`` (uint64).
    """

    block_size: int
    start: int
    replica_keys: list[ReplicaKey]
    values: np.ndarray
    fingerprint: int

    @property
    def count(self) -> int:
        """The number of positions held."""
        return int(self.values.shape[0])

    @property
    def end(self) -> int:
        """One past the last position held."""
        return self.start + self.count

    def totals(self) -> np.ndarray:
        """Per position, the sum of the columns whose replica index is 0 (uint64)."""
        return replica_zero_totals(self.values, self.replica_keys)

    def to_wire(self, group_id: int) -> WireGroup:
        """The group's totals as a producer sends them."""
        return WireGroup(group_id, self.fingerprint, self.block_size, self.start, self.totals())


def replica_zero_totals(values: np.ndarray, replica_keys: Sequence[ReplicaKey]) -> np.ndarray:
    """Per row of ``values`` (one column per replica key), the sum mod 2**64 of the
    columns whose replica index is 0 (uint64)."""
    columns = [k for k, (_, index) in enumerate(replica_keys) if index == 0]
    if not columns:
        return np.zeros(values.shape[0], dtype=np.uint64)
    return values[:, columns].sum(axis=1, dtype=np.uint64)


@dataclass
class RequestChecksums:
    """One request's checksums: its token count and each checksummed group."""

    num_tokens: int
    groups: dict[int, GroupChecksums] = field(default_factory=dict)

    def to_wire(self, numbering: Positions) -> WireChecksums:
        """What a producer sends for the request (``encode_wire``): its token count, the
        record's position ``numbering`` and the totals per group, in group id order."""
        groups = [self.groups[gid].to_wire(gid) for gid in sorted(self.groups)]
        return WireChecksums(self.num_tokens, numbering, groups)


@dataclass(frozen=True)
class WorkerInfo:
    """Which worker a record comes from."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    role: Role = "producer"
    engine: str = ""
    source: str = ""


@dataclass
class WorkerRecord:
    """One worker's partial checksums, with its group fingerprints and uncovered groups."""

    worker: WorkerInfo
    positions: Positions
    fingerprints: dict[int, int]
    not_covered: dict[int, str]
    requests: dict[str, RequestChecksums]


@dataclass
class WorkerSummary:
    """One worker of a record: who it is, its group fingerprints and uncovered groups."""

    worker: WorkerInfo
    fingerprints: dict[int, int] = field(default_factory=dict)
    not_covered: dict[int, str] = field(default_factory=dict)


@dataclass
class Record:
    """One engine's checksums, summed over its workers.

    ``missing_workers`` lists the ``(pp_rank, tp_rank)`` of the engine's layout that the
    set lacks; ``complete`` is true when there are none.
    """

    positions: Positions
    workers: list[WorkerSummary]
    complete: bool
    requests: dict[str, RequestChecksums]
    missing_workers: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Mapping, source: str) -> Record:
        """A record read back from its JSON form, validated strictly.

        Raises:
            KvauditError: A wrong format tag, a missing or unknown key, a value of the
                wrong type, bad hex, rows of the wrong width, or totals that are not the
                sums of the replica-0 values; the message names the source and key path.

        """
        check_plain(data, source)
        reader = _Reader(source)
        reader.keys(
            data, "", ("format", "positions", "workers", "complete", "requests"), ("processes",)
        )
        if "processes" in data:  # how many processes computed it (kvaudit under torchrun)
            reader.integer(data["processes"], "processes", 1)
        if data["format"] != RECORD_FORMAT:
            reader.fail("format", f"expected {RECORD_FORMAT!r}, {reader.got(data['format'])}")
        positions = data["positions"]
        if positions not in POSITION_NUMBERINGS:
            reader.fail(
                "positions", f"expected one of {POSITION_NUMBERINGS}, {reader.got(positions)}"
            )
        workers_data = reader.array(data["workers"], "workers")
        if not workers_data:
            reader.fail("workers", "expected at least one worker")
        workers = [
            _worker_from_json(reader, item, f"workers[{index}]")
            for index, item in enumerate(workers_data)
        ]
        try:
            missing = worker_layout([summary.worker for summary in workers])
        except KvauditError as error:
            reader.fail("workers", str(error))
        complete = data["complete"]
        if not isinstance(complete, bool):
            reader.fail("complete", f"expected true or false, {reader.got(complete)}")
        if complete and missing:
            reader.fail("complete", f"is true but workers (pp_rank, tp_rank) {missing} are missing")
        if not complete and not missing:
            reader.fail("complete", "is false but no worker is missing")
        requests_data = reader.obj(data["requests"], "requests")
        requests = {
            request_id: _request_from_json(reader, item, _item("requests", request_id))
            for request_id, item in requests_data.items()
        }
        return cls(positions, workers, complete, requests, missing)


def combine_workers(records: Sequence[WorkerRecord]) -> Record:
    """Sums the partial checksums of one engine's workers.

    Each request and group covers the union of the workers' positions and replica keys;
    a worker's absent positions and keys count as 0. A group's fingerprint sums, over PP
    stages, the one reported by each stage's lowest TP rank present.

    Raises:
        KvauditError: No records, workers that disagree on the position numbering, TP or
            PP size, a request's token count or a group's block size, or two workers with
            the same ranks; the message names the sources.

    """
    if not records:
        raise KvauditError("no worker records to combine")
    first = records[0]
    for record in records:
        if record.positions not in POSITION_NUMBERINGS:
            raise KvauditError(
                f"{describe_worker(record.worker)}: unknown position numbering {record.positions!r}"
            )
        if record.positions != first.positions:
            raise KvauditError(
                f"workers disagree on positions: {describe_worker(first.worker)} numbers them by "
                f"{first.positions}, {describe_worker(record.worker)} by {record.positions}"
            )
    missing = worker_layout([record.worker for record in records])

    # Per PP stage, the worker of lowest TP rank present reports the stage's fingerprints.
    stage_reporters: dict[int, WorkerRecord] = {}
    for record in records:
        current = stage_reporters.get(record.worker.pp_rank)
        if current is None or record.worker.tp_rank < current.worker.tp_rank:
            stage_reporters[record.worker.pp_rank] = record

    requests: dict[str, RequestChecksums] = {}
    for request_id in dict.fromkeys(rid for record in records for rid in record.requests):
        holders = [record for record in records if request_id in record.requests]
        requests[request_id] = _combine_request(request_id, holders, stage_reporters)

    workers = [
        WorkerSummary(record.worker, dict(record.fingerprints), dict(record.not_covered))
        for record in records
    ]
    return Record(first.positions, workers, not missing, requests, missing)


def _combine_request(
    request_id: str, holders: Sequence[WorkerRecord], stage_reporters: Mapping[int, WorkerRecord]
) -> RequestChecksums:
    """One request summed over the workers that hold it."""
    first = holders[0]
    num_tokens = first.requests[request_id].num_tokens
    for record in holders:
        if record.requests[request_id].num_tokens != num_tokens:
            raise KvauditError(
                f"request {request_id}: {describe_worker(first.worker)} has {num_tokens} tokens, "
                f"{describe_worker(record.worker)} has {record.requests[request_id].num_tokens}"
            )
    group_ids = sorted({gid for record in holders for gid in record.requests[request_id].groups})
    groups: dict[int, GroupChecksums] = {}
    for gid in group_ids:
        parts = [
            (record, record.requests[request_id].groups[gid])
            for record in holders
            if gid in record.requests[request_id].groups
        ]
        groups[gid] = _combine_group(request_id, gid, parts, stage_reporters)
    return RequestChecksums(num_tokens, groups)


def _combine_group(
    request_id: str,
    gid: int,
    parts: Sequence[tuple[WorkerRecord, GroupChecksums]],
    stage_reporters: Mapping[int, WorkerRecord],
) -> GroupChecksums:
    """One request's group summed over the workers that hold it."""
    first_record, first_group = parts[0]
    for record, group in parts:
        if group.block_size != first_group.block_size:
            raise KvauditError(
                f"request {request_id} group {gid}: {describe_worker(first_record.worker)} has "
                f"block size {first_group.block_size}, {describe_worker(record.worker)} has "
                f"{group.block_size}"
            )
    keys = sorted({tuple(key) for _, group in parts for key in group.replica_keys})
    column = {key: k for k, key in enumerate(keys)}
    start = min(group.start for _, group in parts)
    end = max(group.end for _, group in parts)
    values = np.zeros((end - start, len(keys)), dtype=np.uint64)
    for _, group in parts:
        columns = [column[tuple(key)] for key in group.replica_keys]
        rows = slice(group.start - start, group.end - start)
        # uint64 addition wraps modulo 2**64, as the definition requires.
        values[rows, columns] += np.asarray(group.values, dtype=np.uint64)

    held = {id(record): group for record, group in parts}
    fingerprint = 0
    for reporter in stage_reporters.values():
        if gid in reporter.fingerprints:
            fingerprint += reporter.fingerprints[gid]
        elif id(reporter) in held:
            fingerprint += held[id(reporter)].fingerprint
    return GroupChecksums(
        block_size=first_group.block_size,
        start=start,
        replica_keys=[(int(r), int(i)) for r, i in keys],
        values=values,
        fingerprint=fingerprint & MASK64,
    )


_HEX = re.compile(r"[0-9a-f]{16}")
_WORKER_KEYS = (
    "source",
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "role",
    "fingerprints",
    "not_covered",
)
_GROUP_KEYS = ("block_size", "start", "fingerprint", "replica_keys", "values", "totals")


def _item(path: str, key: str | int) -> str:
    """The key path of a list item (``path[3]``) or an object member (``path["id"]``)."""
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}[{json.dumps(key)}]"


class _Reader(Checker):
    """Typed access to a record's JSON with errors that name the source and key path."""

    limit = 40

    def obj(self, value: object, path: str) -> Mapping:
        if not isinstance(value, Mapping):
            self.fail(path, f"expected an object, {self.got(value)}")
        return value

    def array(self, value: object, path: str) -> list:
        if not isinstance(value, list):
            self.fail(path, f"expected a list, {self.got(value)}")
        return value

    def keys(
        self, value: object, path: str, required: Sequence[str], optional: Sequence[str] = ()
    ) -> Mapping:
        """An object with every ``required`` key and no key outside ``optional``."""
        data = self.obj(value, path or "record")
        for key in required:
            if key not in data:
                self.fail(join(path, key), "missing")
        for key in data:
            if key not in required and key not in optional:
                self.fail(join(path, str(key)), "unknown key")
        return data

    def integer(self, value: object, path: str, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            self.fail(path, f"expected an integer from {minimum} to {maximum}, {self.got(value)}")
        return value

    def string(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            self.fail(path, f"expected a string, {self.got(value)}")
        return value

    def hex64(self, value: object, path: str) -> int:
        if not isinstance(value, str) or not _HEX.fullmatch(value):
            self.fail(path, f"expected 16 lowercase hex digits, {self.got(value)}")
        return from_hex(value)

    def group_id(self, key: object, path: str) -> int:
        """An object key that is a group id in canonical decimal (``"0"``, not ``"00"``)."""
        if not isinstance(key, str) or not key.isdigit() or str(int(key)) != key:
            self.fail(_item(path, str(key)), "expected a group id (a decimal integer)")
        return int(key)


def _worker_from_json(reader: _Reader, value: object, path: str) -> WorkerSummary:
    """One ``workers`` entry, validated."""
    data = reader.keys(value, path, _WORKER_KEYS, ("engine",))
    role = reader.role(reader.string(data["role"], join(path, "role")), join(path, "role"))
    info = WorkerInfo(
        tp_rank=reader.integer(data["tp_rank"], join(path, "tp_rank")),
        tp_size=reader.integer(data["tp_size"], join(path, "tp_size"), 1, MAX_WORKERS),
        pp_rank=reader.integer(data["pp_rank"], join(path, "pp_rank")),
        pp_size=reader.integer(data["pp_size"], join(path, "pp_size"), 1, MAX_WORKERS),
        role=role,
        engine=reader.string(data.get("engine", ""), join(path, "engine")),
        source=reader.string(data["source"], join(path, "source")),
    )
    fp_path = join(path, "fingerprints")
    fingerprints = {
        reader.group_id(key, fp_path): reader.hex64(fp, _item(fp_path, key))
        for key, fp in reader.obj(data["fingerprints"], fp_path).items()
    }
    nc_path = join(path, "not_covered")
    not_covered = {
        reader.group_id(key, nc_path): reader.string(reason, _item(nc_path, key))
        for key, reason in reader.obj(data["not_covered"], nc_path).items()
    }
    return WorkerSummary(info, fingerprints, not_covered)


def _request_from_json(reader: _Reader, value: object, path: str) -> RequestChecksums:
    """One ``requests`` entry, validated."""
    data = reader.keys(value, path, ("num_tokens", "groups"))
    num_tokens = reader.integer(data["num_tokens"], join(path, "num_tokens"), 0, MAX_TOKENS)
    groups_path = join(path, "groups")
    groups = {}
    for key, item in reader.obj(data["groups"], groups_path).items():
        group_id = reader.group_id(key, groups_path)
        group_path = _item(groups_path, key)
        group = _group_from_json(reader, item, group_path)
        check_positions(
            reader.source, group_path, num_tokens, group.block_size, group.start, group.count
        )
        groups[group_id] = group
    return RequestChecksums(num_tokens, groups)


def _group_from_json(reader: _Reader, value: object, path: str) -> GroupChecksums:
    """One group of a request, validated: unique replica keys, rows one value per key,
    totals that are the sums of the replica-0 values."""
    data = reader.keys(value, path, _GROUP_KEYS)
    block_size = reader.integer(data["block_size"], join(path, "block_size"), 1, MAX_BLOCK_SIZE)
    start = reader.integer(data["start"], join(path, "start"), 0, MAX_TOKENS)
    fingerprint = reader.hex64(data["fingerprint"], join(path, "fingerprint"))

    keys_path = join(path, "replica_keys")
    keys: list[ReplicaKey] = []
    for k, item in enumerate(reader.array(data["replica_keys"], keys_path)):
        key_path = _item(keys_path, k)
        pair = reader.array(item, key_path)
        if len(pair) != 2:
            reader.fail(key_path, f"expected [replicas, replica_index], {reader.got(pair)}")
        replicas = reader.integer(pair[0], _item(key_path, 0), 1, MAX_WORKERS)
        index = reader.integer(pair[1], _item(key_path, 1))
        if index >= replicas:
            reader.fail(key_path, f"replica index {index} is not below {replicas} replicas")
        if (replicas, index) in keys:
            reader.fail(key_path, f"replica key {short(pair, 40)} repeated")
        keys.append((replicas, index))
    if not keys:
        reader.fail(keys_path, "expected at least one replica key")

    values_path = join(path, "values")
    rows = reader.array(data["values"], values_path)
    values = np.zeros((len(rows), len(keys)), dtype=np.uint64)
    for i, row in enumerate(rows):
        row_path = _item(values_path, i)
        reader.array(row, row_path)
        if len(row) != len(keys):
            reader.fail(
                row_path, f"expected {len(keys)} values (one per replica key), got {len(row)}"
            )
        values[i] = [reader.hex64(item, _item(row_path, k)) for k, item in enumerate(row)]
    group = GroupChecksums(block_size, start, keys, values, fingerprint)

    totals_path = join(path, "totals")
    totals = reader.array(data["totals"], totals_path)
    if len(totals) != len(rows):
        reader.fail(
            totals_path, f"expected {len(rows)} totals (one per position), got {len(totals)}"
        )
    expected = group.totals().tolist()
    for i, item in enumerate(totals):
        total = reader.hex64(item, _item(totals_path, i))
        if total != expected[i]:
            reader.fail(
                _item(totals_path, i),
                f"{item} is not the sum of the replica-0 values, {to_hex(expected[i])}",
            )
    return group
