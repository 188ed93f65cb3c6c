"""One checksum line of an output folder checked as strictly as a record's keys, and
merged into its worker's record."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...core.validation import (
    MAX_TOKENS,
    MAX_WORKERS,
    POSITION_NUMBERINGS,
    check_positions,
    join,
)
from ...records import (
    PLANES,
    GroupChecksums,
    LayerPart,
    LayerSums,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
)
from ...records.reading import RecordReader, group_span, group_strong, group_values, item_path
from .layout import LINE_FORMATS

_LINE_KEYS = (
    "format",
    "request",
    "role",
    "num_tokens",
    "positions",
    "worker",
    "fingerprints",
    "not_covered",
    "groups",
)
_LINE_ROLES = ("producer", "consumer")
_WORKER_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "engine")
_GROUP_KEYS = ("block_size", "start", "replica_keys", "values")
_OPTIONAL_GROUP_KEYS = ("strong", "layer_sums")
"""The strong lane's rows: lines of the seed engine or an older kvaudit have none."""


def check_line(
    reader: RecordReader, data: Any, ranks: tuple[int, int], record: WorkerRecord | None
) -> dict[str, Any]:
    """A checksum line, every key checked as a record's are: the format, the role, the
    position numbering, the worker (its folder's ranks; its sizes those of the file's
    other lines), counts and ranges, and each group's positions against the tokens.

    Args:
        reader: The reader naming the file and line in its errors.
        data: The line's parsed JSON.
        ranks: ``(pp_rank, tp_rank)`` of the worker folder the line is in.
        record: The worker's record from its earlier lines (None: the first line).

    Returns:
        The line, with ``groups`` and ``fingerprints`` parsed.

    Raises:
        KvauditError: A key missing, unknown, of the wrong type or out of range.

    """
    line = reader.keys(data, "", _LINE_KEYS, ("prompt",))
    if line["format"] not in LINE_FORMATS:
        reader.fail("format", f"expected {LINE_FORMATS[0]!r}, {reader.got(line['format'])}")
    request = reader.string(line["request"], "request")
    role = line["role"]
    if role not in _LINE_ROLES:
        reader.fail("role", f"expected producer or consumer, {reader.got(role)}")
    num_tokens = reader.integer(line["num_tokens"], "num_tokens", 0, MAX_TOKENS)
    if line["positions"] not in POSITION_NUMBERINGS:
        reader.fail(
            "positions",
            f"expected one of {', '.join(POSITION_NUMBERINGS)}, {reader.got(line['positions'])}",
        )
    worker = _check_worker(reader, line["worker"], ranks, record, line["positions"])
    fp_path = "fingerprints"
    fingerprints = {
        reader.group_id(key, fp_path): reader.hex64(value, item_path(fp_path, key))
        for key, value in reader.obj(line[fp_path], fp_path).items()
    }
    nc_path = "not_covered"
    not_covered = {
        reader.group_id(key, nc_path): reader.string(value, item_path(nc_path, key))
        for key, value in reader.obj(line[nc_path], nc_path).items()
    }
    groups: dict[int, GroupChecksums] = {}
    for key, value in reader.obj(line["groups"], "groups").items():
        gid = reader.group_id(key, "groups")
        path = item_path("groups", key)
        group = reader.keys(value, path, _GROUP_KEYS, _OPTIONAL_GROUP_KEYS)
        block_size, start = group_span(reader, group, path)
        keys, values = group_values(reader, group, path)
        strong = group_strong(reader, group, path, values.shape)
        checks = GroupChecksums(
            block_size, start, keys, values, fingerprints.get(gid, 0), strong=strong
        )
        if "layer_sums" in group:
            checks.layer_sums = _layer_sums(
                reader, group["layer_sums"], join(path, "layer_sums"), checks.count
            )
        check_positions(reader.source, path, num_tokens, block_size, start, checks.count)
        groups[gid] = checks
    result = {
        "request": request,
        "role": role,
        "num_tokens": num_tokens,
        "positions": line["positions"],
        "worker": worker,
        "fingerprints": fingerprints,
        "not_covered": not_covered,
        "groups": groups,
    }
    if "prompt" in line:
        result["prompt"] = _prompt(reader, line["prompt"])
    return result


def _layer_sums(reader: RecordReader, value: object, path: str, count: int) -> LayerSums:
    """A group's ``layer_sums``: distinct ``[layer, plane]`` labels and base64 of
    ``count`` rows of one little-endian uint64 per label."""
    data = reader.keys(value, path, ("parts", "sums"))
    parts_path = join(path, "parts")
    parts: list[LayerPart] = []
    for i, item in enumerate(reader.array(data["parts"], parts_path)):
        item_at = item_path(parts_path, i)
        pair = reader.array(item, item_at)
        if len(pair) != 2 or pair[1] not in PLANES:
            planes = ", ".join(PLANES)
            reader.fail(item_at, f"expected [layer, one of {planes}], {reader.got(item)}")
        parts.append((reader.integer(pair[0], item_path(item_at, 0)), pair[1]))
    if len(set(parts)) != len(parts):
        reader.fail(parts_path, "a [layer, plane] is listed twice")
    sums_path = join(path, "sums")
    try:
        raw = base64.b64decode(reader.string(data["sums"], sums_path), validate=True)
    except binascii.Error as error:
        reader.fail(sums_path, f"not base64 ({error})")
    expected = count * len(parts) * 8
    if len(raw) != expected:
        reader.fail(
            sums_path,
            f"{len(raw)} bytes, expected {expected} ({count} positions x {len(parts)} parts x 8)",
        )
    values = np.frombuffer(raw, dtype="<u8").astype(np.uint64).reshape(count, len(parts))
    return LayerSums(parts, values)


def _prompt(reader: RecordReader, value: object) -> str:
    """A prompt digest: 16 lowercase hex digits."""
    reader.hex64(value, "prompt")
    return str(value)


def _check_worker(
    reader: RecordReader,
    value: object,
    ranks: tuple[int, int],
    record: WorkerRecord | None,
    line_positions: str,
) -> dict[str, Any]:
    """A line's ``worker``: sizes from 1 to ``MAX_WORKERS`` (their product too), ranks
    below them and those of the folder it is in; the sizes and position numbering of the
    worker's earlier lines."""
    data = reader.keys(value, "worker", _WORKER_KEYS)
    worker = {
        "tp_size": reader.integer(data["tp_size"], "worker.tp_size", 1, MAX_WORKERS),
        "pp_size": reader.integer(data["pp_size"], "worker.pp_size", 1, MAX_WORKERS),
        "tp_rank": reader.integer(data["tp_rank"], "worker.tp_rank", 0, MAX_WORKERS),
        "pp_rank": reader.integer(data["pp_rank"], "worker.pp_rank", 0, MAX_WORKERS),
        "engine": reader.string(data["engine"], "worker.engine"),
    }
    if worker["tp_size"] * worker["pp_size"] > MAX_WORKERS:
        reader.fail(
            "worker",
            f"tp_size {worker['tp_size']} x pp_size {worker['pp_size']} is more than the "
            f"{MAX_WORKERS} workers kvaudit reads",
        )
    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
        reader.rank(worker[rank], worker[size], join("worker", rank))
    if (worker["pp_rank"], worker["tp_rank"]) != ranks:
        reader.fail(
            "worker",
            f"pp_rank {worker['pp_rank']}, tp_rank {worker['tp_rank']}, but the line is in "
            f"the folder of pp{ranks[0]}-tp{ranks[1]}",
        )
    if record is not None:
        if line_positions != record.positions:
            reader.fail(
                "positions",
                f"{line_positions}, but the worker's earlier lines number positions by "
                f"{record.positions}",
            )
        for size in ("tp_size", "pp_size"):
            if worker[size] != getattr(record.worker, size):
                reader.fail(
                    join("worker", size),
                    f"{worker[size]}, but the worker's earlier lines give "
                    f"{getattr(record.worker, size)}",
                )
    return worker


def merge_line(record: WorkerRecord | None, line: Mapping[str, Any], source: str) -> WorkerRecord:
    """``record`` with the line's request (a later line replaces an earlier one).

    Args:
        record: The worker's record so far (None: a new one is made).
        line: A line as ``check_line`` returns it.
        source: What the record names as its source (the worker's checksum file).

    Returns:
        The record, the line's request in it.

    """
    w = line["worker"]
    role = line["role"]
    info = WorkerInfo(
        w["tp_rank"], w["tp_size"], w["pp_rank"], w["pp_size"], role, w["engine"], source
    )
    if record is None:
        record = WorkerRecord(info, line["positions"], {}, {}, {})
    elif record.worker.role != role:
        # A kv_both engine: its worker holds both roles; every replica counts as a consumer's.
        record.worker = WorkerInfo(**{**record.worker.__dict__, "role": "consumer"})
    record.positions = line["positions"]
    record.fingerprints.update(line["fingerprints"])
    record.not_covered.update(line["not_covered"])
    groups = {
        gid: GroupChecksums(
            group.block_size,
            group.start,
            group.replica_keys,
            group.values,
            record.fingerprints.get(gid, 0),
            layer_sums=group.layer_sums,
            strong=group.strong,
        )
        for gid, group in line["groups"].items()
    }
    record.requests[line["request"]] = RequestChecksums(line["num_tokens"], groups)
    return record
