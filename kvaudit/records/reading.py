"""The one strict decoder of a record's data shape (``records.encoding`` writes it): typed
access whose errors name the source and key path, and each worker, request and group entry
checked (keys, types, hex values, row widths, totals), in a record's shape and in an
output folder's checksum line's (``request_line_from_json``; the folder's reader adds
only what the folder itself says: the worker folder a line is in, its earlier lines).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.scheme import STRONG_PRIME, ReplicaKey, from_hex, to_hex
from ..core.validation import (
    MAX_BLOCK_SIZE,
    MAX_COUNT,
    MAX_TOKENS,
    MAX_WORKERS,
    POSITION_NUMBERINGS,
    Checker,
    Positions,
    check_positions,
    join,
    short,
)
from .model import (
    PLANES,
    GroupChecksums,
    LayerPart,
    LayerSums,
    RequestChecksums,
    WorkerInfo,
    WorkerSummary,
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
_LINE_WORKER_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "engine")
_LINE_GROUP_KEYS = ("block_size", "start", "replica_keys", "values")
_LINE_OPTIONAL_GROUP_KEYS = ("strong", "layer_sums")
"""The strong lane's rows: lines of the seed engine or an older kvaudit have none."""


def item_path(path: str, key: str | int) -> str:
    """The key path of a list item (``path[3]``) or an object member (``path["id"]``)."""
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}[{json.dumps(key)}]"


class RecordReader(Checker):
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

    def residue(self, value: object, path: str) -> int:
        """A strong-lane residue: 16 lowercase hex digits below ``2**64 - 59``."""
        number = self.hex64(value, path)
        if number >= STRONG_PRIME:
            self.fail(path, f"{value} is not a residue modulo 2**64 - 59 (it must be below it)")
        return number

    def group_id(self, key: object, path: str) -> int:
        """An object key that is a group id in canonical decimal (``"0"``, not ``"00"``)."""
        if (
            not isinstance(key, str)
            or not (key.isascii() and key.isdigit())
            or str(int(key)) != key
        ):
            self.fail(item_path(path, str(key)), "expected a group id (a decimal integer)")
        return int(key)


def worker_from_json(reader: RecordReader, value: object, path: str) -> WorkerSummary:
    """One ``workers`` entry, validated."""
    data = reader.keys(value, path, _WORKER_KEYS, ("engine", "layers"))
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
    fingerprints = fingerprints_from_json(reader, data["fingerprints"], join(path, "fingerprints"))
    not_covered = not_covered_from_json(reader, data["not_covered"], join(path, "not_covered"))
    layers = {}
    if "layers" in data:  # optional: records written before layer facts were kept lack it
        from .layers import facts_from_json

        layers = facts_from_json(reader, data["layers"], join(path, "layers"))
    return WorkerSummary(info, fingerprints, not_covered, layers)


def fingerprints_from_json(reader: RecordReader, value: object, path: str) -> dict[int, int]:
    """A worker's (or a checksum line's) ``fingerprints``: group id to 16 hex digits."""
    return {
        reader.group_id(key, path): reader.hex64(fp, item_path(path, key))
        for key, fp in reader.obj(value, path).items()
    }


def not_covered_from_json(reader: RecordReader, value: object, path: str) -> dict[int, str]:
    """A worker's (or a checksum line's) ``not_covered``: group id to why."""
    return {
        reader.group_id(key, path): reader.string(reason, item_path(path, key))
        for key, reason in reader.obj(value, path).items()
    }


def request_from_json(reader: RecordReader, value: object, path: str) -> RequestChecksums:
    """One ``requests`` entry, validated."""
    data = reader.keys(value, path, ("num_tokens", "groups"))
    num_tokens = reader.integer(data["num_tokens"], join(path, "num_tokens"), 0, MAX_TOKENS)
    groups_path = join(path, "groups")
    groups = {}
    for key, item in reader.obj(data["groups"], groups_path).items():
        group_id = reader.group_id(key, groups_path)
        group_path = item_path(groups_path, key)
        group = _group_from_json(reader, item, group_path)
        check_positions(
            reader.source, group_path, num_tokens, group.block_size, group.start, group.count
        )
        groups[group_id] = group
    return RequestChecksums(num_tokens, groups)


def _group_from_json(reader: RecordReader, value: object, path: str) -> GroupChecksums:
    """One group of a request, validated: unique replica keys, rows one value per key,
    totals that are the sums of the replica-0 values."""
    data = reader.keys(value, path, _GROUP_KEYS, ("partial", "strong", "strong_totals"))
    block_size, start = _group_span(reader, data, path)
    fingerprint = reader.hex64(data["fingerprint"], join(path, "fingerprint"))
    keys, values = _group_values(reader, data, path)
    partial = None
    if "partial" in data:
        partial = reader.string(data["partial"], join(path, "partial"))
    strong = _group_strong(reader, data, path, values.shape)
    group = GroupChecksums(block_size, start, keys, values, fingerprint, partial, strong)
    if ("strong" in data) != ("strong_totals" in data):
        given, lacking = (
            ("strong", "strong_totals") if "strong" in data else ("strong_totals", "strong")
        )
        reader.fail(join(path, lacking), f"missing (the group gives {given})")
    if strong is not None:
        _check_totals(
            reader, data["strong_totals"], join(path, "strong_totals"), group.strong_totals()
        )

    _check_totals(reader, data["totals"], join(path, "totals"), group.totals())
    return group


def _check_totals(reader: RecordReader, value: object, path: str, sums: np.ndarray | None) -> None:
    """A group's ``totals`` (or ``strong_totals``): one per position, each the sum of the
    replica-0 values (of the lane) that the reader computed, ``sums``."""
    totals = reader.array(value, path)
    expected = [] if sums is None else sums.tolist()
    if len(totals) != len(expected):
        reader.fail(path, f"expected {len(expected)} totals (one per position), got {len(totals)}")
    for i, item in enumerate(totals):
        total = reader.hex64(item, item_path(path, i))
        if total != expected[i]:
            reader.fail(
                item_path(path, i),
                f"{item} is not the sum of the replica-0 values, {to_hex(expected[i])}",
            )


def _group_strong(
    reader: RecordReader, data: Mapping, path: str, shape: tuple[int, ...]
) -> np.ndarray | None:
    """A group's optional ``strong`` rows (docs/checksum.md, "The strong lane"), as a
    record and an output folder's checksum line hold them: as many rows as ``values``
    (``shape``), one residue below ``2**64 - 59`` per replica key; None where the group
    has none (a record of the seed engine, or of a kvaudit before the lane).

    Args:
        reader: The reader naming the source and key path in its errors.
        data: The group's JSON object.
        path: Its key path.
        shape: ``(positions, replica keys)`` of its ``values``.

    Returns:
        The residues (uint64), or None.

    Raises:
        KvauditError: A row count or width other than the values', a value that is not
            16 lowercase hex digits, or one not below the prime.

    """
    if "strong" not in data:
        return None
    strong_path = join(path, "strong")
    rows = reader.array(data["strong"], strong_path)
    count, width = shape
    if len(rows) != count:
        reader.fail(strong_path, f"expected {count} rows (one per position), got {len(rows)}")
    strong = np.zeros((count, width), dtype=np.uint64)
    for i, row in enumerate(rows):
        row_path = item_path(strong_path, i)
        reader.array(row, row_path)
        if len(row) != width:
            reader.fail(row_path, f"expected {width} values (one per replica key), got {len(row)}")
        strong[i] = [reader.residue(item, item_path(row_path, k)) for k, item in enumerate(row)]
    return strong


def _group_span(reader: RecordReader, data: Mapping, path: str) -> tuple[int, int]:
    """A group's ``block_size`` (from 1) and ``start`` (from 0), as a record and an output
    folder's checksum line hold them."""
    block_size = reader.integer(data["block_size"], join(path, "block_size"), 1, MAX_BLOCK_SIZE)
    start = reader.integer(data["start"], join(path, "start"), 0, MAX_TOKENS)
    return block_size, start


def _group_values(
    reader: RecordReader, data: Mapping, path: str
) -> tuple[list[ReplicaKey], np.ndarray]:
    """A group's ``replica_keys`` and ``values``, as a record and an output folder's
    checksum line hold them: unique keys ``[replicas, index]`` with the index below the
    replicas, at least one, and rows of one value (16 lowercase hex digits) per key."""
    keys_path = join(path, "replica_keys")
    keys: list[ReplicaKey] = []
    for k, item in enumerate(reader.array(data["replica_keys"], keys_path)):
        key_path = item_path(keys_path, k)
        pair = reader.array(item, key_path)
        if len(pair) != 2:
            reader.fail(key_path, f"expected [replicas, replica_index], {reader.got(pair)}")
        replicas = reader.integer(pair[0], item_path(key_path, 0), 1, MAX_WORKERS)
        index = reader.integer(pair[1], item_path(key_path, 1))
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
        row_path = item_path(values_path, i)
        reader.array(row, row_path)
        if len(row) != len(keys):
            reader.fail(
                row_path, f"expected {len(keys)} values (one per replica key), got {len(row)}"
            )
        values[i] = [reader.hex64(item, item_path(row_path, k)) for k, item in enumerate(row)]
    return keys, values


# An output folder's checksum lines: one request of one worker's record each.


@dataclass
class RequestLine:
    """One checksum line of an output folder, decoded: one request's checksums of one
    worker (its ranks, sizes and engine in ``worker``, whose ``source`` is empty), with
    the worker's fingerprints and uncovered groups, and the request's prompt digest where
    the line gives one."""

    format: str
    request: str
    role: str
    num_tokens: int
    positions: Positions
    worker: WorkerInfo
    fingerprints: dict[int, int]
    not_covered: dict[int, str]
    groups: dict[int, GroupChecksums]
    prompt: str | None = None


def request_line_from_json(
    reader: RecordReader, value: object, formats: Sequence[str]
) -> RequestLine:
    """A checksum line, every key checked as a record's are: the format, the role, the
    position numbering, the worker's ranks and sizes, counts and ranges, each group's
    keys, values, strong rows and layer sums, its fingerprint among the line's, and its
    positions against the tokens.

    Args:
        reader: The reader naming the file and line in its errors.
        value: The line's parsed JSON.
        formats: The format tags accepted (the first is named in errors).

    Returns:
        The decoded line.

    Raises:
        KvauditError: A key missing, unknown, of the wrong type or out of range, or a
            group whose fingerprint the line lacks.

    """
    line = reader.keys(value, "", _LINE_KEYS, ("prompt",))
    if line["format"] not in formats:
        reader.fail("format", f"expected {formats[0]!r}, {reader.got(line['format'])}")
    request = reader.string(line["request"], "request")
    role = line["role"]
    if role not in _LINE_ROLES:
        reader.fail("role", f"expected producer or consumer, {reader.got(role)}")
    num_tokens = reader.integer(line["num_tokens"], "num_tokens", 0, MAX_TOKENS)
    positions = line["positions"]
    if positions not in POSITION_NUMBERINGS:
        reader.fail(
            "positions",
            f"expected one of {', '.join(POSITION_NUMBERINGS)}, {reader.got(positions)}",
        )
    worker = _line_worker(reader, line["worker"], role)
    fingerprints = fingerprints_from_json(reader, line["fingerprints"], "fingerprints")
    not_covered = not_covered_from_json(reader, line["not_covered"], "not_covered")
    groups: dict[int, GroupChecksums] = {}
    for key, item in reader.obj(line["groups"], "groups").items():
        gid = reader.group_id(key, "groups")
        path = item_path("groups", key)
        if gid not in fingerprints:
            reader.fail(path, f"the line's fingerprints lack group {gid}")
        group = _line_group(reader, item, path, fingerprints[gid])
        check_positions(reader.source, path, num_tokens, group.block_size, group.start, group.count)
        groups[gid] = group
    prompt = None
    if "prompt" in line:
        reader.hex64(line["prompt"], "prompt")
        prompt = str(line["prompt"])
    return RequestLine(
        line["format"],
        request,
        role,
        num_tokens,
        positions,
        worker,
        fingerprints,
        not_covered,
        groups,
        prompt,
    )


def _line_worker(reader: RecordReader, value: object, role: str) -> WorkerInfo:
    """A line's ``worker``: sizes from 1 to ``MAX_WORKERS`` (their product too), ranks
    below them, and the engine."""
    data = reader.keys(value, "worker", _LINE_WORKER_KEYS)
    tp_size = reader.integer(data["tp_size"], "worker.tp_size", 1, MAX_WORKERS)
    pp_size = reader.integer(data["pp_size"], "worker.pp_size", 1, MAX_WORKERS)
    tp_rank = reader.integer(data["tp_rank"], "worker.tp_rank", 0, MAX_WORKERS)
    pp_rank = reader.integer(data["pp_rank"], "worker.pp_rank", 0, MAX_WORKERS)
    engine = reader.string(data["engine"], "worker.engine")
    if tp_size * pp_size > MAX_WORKERS:
        reader.fail(
            "worker",
            f"tp_size {tp_size} x pp_size {pp_size} is more than the {MAX_WORKERS} workers "
            "kvaudit reads",
        )
    reader.rank(tp_rank, tp_size, "worker.tp_rank")
    reader.rank(pp_rank, pp_size, "worker.pp_rank")
    return WorkerInfo(tp_rank, tp_size, pp_rank, pp_size, reader.role(role, "role"), engine)


def _line_group(reader: RecordReader, value: object, path: str, fingerprint: int) -> GroupChecksums:
    """One group of a checksum line: its span, values and strong rows checked as a
    record's, and its layer sums' labels and size."""
    data = reader.keys(value, path, _LINE_GROUP_KEYS, _LINE_OPTIONAL_GROUP_KEYS)
    block_size, start = _group_span(reader, data, path)
    keys, values = _group_values(reader, data, path)
    strong = _group_strong(reader, data, path, values.shape)
    group = GroupChecksums(block_size, start, keys, values, fingerprint, strong=strong)
    if "layer_sums" in data:
        sums_path = join(path, "layer_sums")
        group.layer_sums = layer_sums_from_json(reader, data["layer_sums"], sums_path, group.count)
    return group


def layer_sums_from_json(reader: RecordReader, value: object, path: str, count: int) -> LayerSums:
    """A group's ``layer_sums``: distinct ``[layer, plane]`` labels and base64 of
    ``count`` rows of one little-endian uint64 per label.

    Args:
        reader: The reader naming the source and key path in its errors.
        value: The parsed ``layer_sums`` object.
        path: Its key path.
        count: The group's positions.

    Returns:
        The layer sums.

    Raises:
        KvauditError: A key missing or unknown, a label that is not ``[layer, plane]`` or
            is listed twice, text that is not base64 or not ``count`` rows of sums.

    """
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
