"""The one encoder of a record's data shape: a record, a worker's record, their workers,
requests and groups as the JSON data that ``checksum --format json`` writes
(``kvaudit.formats``), that the live agent sends (``kvaudit.live``) and that an output
folder's checksum lines hold (``kvaudit.output_folders``). ``records.reading`` decodes
each of them strictly.

Two shapes of a group: a record's (its fingerprint, values and their totals, the strong
lane's rows and totals where carried, why it is partial where it is) and a checksum
line's (its values, the strong lane's rows, the layer sums; the line gives the
fingerprints once for all its groups, and a reader computes the totals).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.scheme import to_hex
from ..core.validation import worker_layout
from .layers import facts_to_json
from .model import (
    RECORD_FORMAT,
    GroupChecksums,
    LayerSums,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    WorkerSummary,
)
from .record import Record


def hex_rows(values: np.ndarray) -> list[list[str]]:
    """Each row of a 2-D array of uint64 as 16 lowercase hex digits per value, as
    ``to_hex`` writes one (all at once: a request's values, without a call per value).

    Args:
        values: The values, one row per position.

    Returns:
        The rows of hex strings.

    """
    rows, width = values.shape
    if not width:
        return [[] for _ in range(rows)]
    digits = np.ascontiguousarray(values, dtype=">u8").tobytes().hex()
    words = [digits[i : i + 16] for i in range(0, len(digits), 16)]
    return [words[i : i + width] for i in range(0, len(words), width)]


def hex_list(values: np.ndarray) -> list[str]:
    """Each value of a 1-D array of uint64 as 16 lowercase hex digits (``hex_rows``)."""
    return [row[0] for row in hex_rows(np.asarray(values)[:, None])]


def fingerprints_to_json(fingerprints: Mapping[int, int]) -> dict[str, str]:
    """Group id (decimal text) to fingerprint (hex), in group id order."""
    return {str(gid): to_hex(fp) for gid, fp in sorted(fingerprints.items())}


def not_covered_to_json(not_covered: Mapping[int, str]) -> dict[str, str]:
    """Group id (decimal text) to why the group is not checksummed, in group id order."""
    return {str(gid): reason for gid, reason in sorted(not_covered.items())}


def _group_entry(group: GroupChecksums, line: bool) -> dict[str, Any]:
    """A group in a record's shape (``line`` false) or a checksum line's."""
    entry: dict[str, Any] = {"block_size": int(group.block_size), "start": int(group.start)}
    if not line:
        entry["fingerprint"] = to_hex(group.fingerprint)
    entry["replica_keys"] = [[int(replicas), int(index)] for replicas, index in group.replica_keys]
    entry["values"] = hex_rows(group.values)
    if not line:
        entry["totals"] = hex_list(group.totals())
    if group.strong is not None:
        entry["strong"] = hex_rows(group.strong)
        strong_totals = None if line else group.strong_totals()  # a line holds no totals
        if strong_totals is not None:
            entry["strong_totals"] = hex_list(strong_totals)
    if line and group.layer_sums is not None:
        entry["layer_sums"] = layer_sums_to_json(group.layer_sums)
    if not line and group.partial is not None:
        entry["partial"] = group.partial
    return entry


def group_to_json(group: GroupChecksums) -> dict[str, Any]:
    """A group of a record's request: its values and their totals as hex, the strong
    lane's (``strong``, ``strong_totals``) where it carries it, and why they are partial
    sums where they are.

    Args:
        group: The group's checksums.

    Returns:
        ``{"block_size", "start", "fingerprint", "replica_keys", "values", "totals"}``
        and the optional keys, in that order.

    """
    return _group_entry(group, line=False)


def request_to_json(request: RequestChecksums) -> dict[str, Any]:
    """A request of a record: its token count and each group's checksums, by group id.

    Args:
        request: The request's checksums.

    Returns:
        ``{"num_tokens": n, "groups": {"gid": group, ...}}``.

    """
    return {
        "num_tokens": int(request.num_tokens),
        "groups": {str(gid): group_to_json(group) for gid, group in sorted(request.groups.items())},
    }


def worker_to_json(summary: WorkerSummary) -> dict[str, Any]:
    """A worker's entry of a record's ``workers``: who it is, its fingerprints, its
    uncovered groups and, where its description is known, its layers' facts.

    Args:
        summary: The worker.

    Returns:
        The entry.

    """
    worker = summary.worker
    data: dict[str, Any] = {
        "source": worker.source,
        "tp_rank": worker.tp_rank,
        "tp_size": worker.tp_size,
        "pp_rank": worker.pp_rank,
        "pp_size": worker.pp_size,
        "role": worker.role,
        "fingerprints": fingerprints_to_json(summary.fingerprints),
        "not_covered": not_covered_to_json(summary.not_covered),
    }
    if summary.layers:  # where the worker's description is known
        data["layers"] = facts_to_json(summary.layers)
    return data


def record_to_json(record: Record) -> dict[str, Any]:
    """A record as ``checksum --format json`` writes it (``Record.from_json`` reads it).

    Args:
        record: The record.

    Returns:
        Plain data (``kvaudit.formats.json_text`` writes it as text).

    """
    return {
        "format": RECORD_FORMAT,
        "positions": record.positions,
        "workers": [worker_to_json(summary) for summary in record.workers],
        "complete": record.complete,
        "requests": {rid: request_to_json(request) for rid, request in record.requests.items()},
    }


def worker_record_head(record: WorkerRecord) -> dict[str, Any]:
    """A worker's record as a record of that worker alone, without its ``requests``
    (which come last: the live agent sends them piece by piece).

    The worker's layers' facts are left out, as the agent has always sent it.

    Args:
        record: The worker's record.

    Returns:
        ``{"format", "positions", "workers", "complete"}``.

    """
    summary = WorkerSummary(record.worker, record.fingerprints, record.not_covered)
    return {
        "format": RECORD_FORMAT,
        "positions": record.positions,
        "workers": [worker_to_json(summary)],
        "complete": not worker_layout([record.worker]),
    }


def worker_record_to_json(record: WorkerRecord) -> dict[str, Any]:
    """A worker's record as a record of that worker alone (``Record.from_json`` reads it).

    Args:
        record: The worker's record.

    Returns:
        ``worker_record_head`` with the requests.

    """
    return {
        **worker_record_head(record),
        "requests": {rid: request_to_json(request) for rid, request in record.requests.items()},
    }


def layer_sums_to_json(sums: LayerSums) -> dict[str, Any]:
    """A group's layer sums as a checksum line holds them: the labels, and the values as
    base64 of little-endian uint64, row by row (a third of hex strings' bytes, and no
    Python loop over the values in the engine's thread).

    Args:
        sums: The layer sums (``[positions, parts]``).

    Returns:
        ``{"parts": [[layer, plane], ...], "sums": base64}``.

    """
    data = np.ascontiguousarray(sums.values, dtype="<u8").tobytes()
    return {
        "parts": [[number, plane] for number, plane in sums.parts],
        "sums": base64.b64encode(data).decode("ascii"),
    }


_LINE_WORKER = ("tp_rank", "tp_size", "pp_rank", "pp_size", "engine")
"""What a checksum line's ``worker`` holds of the worker, in order."""


def _line_worker(worker: WorkerInfo) -> dict[str, Any]:
    """A checksum line's ``worker``: its ranks, sizes and engine."""
    return {key: getattr(worker, key) for key in _LINE_WORKER}


def request_line_to_json(
    line_format: str,
    record: WorkerRecord,
    checksums: RequestChecksums,
    request: str,
    role: str,
    prompt: str | None = None,
) -> dict[str, Any]:
    """One request's checksums of a worker's record as an output folder's checksum line
    holds them (``records.reading.request_line_from_json`` reads it back).

    Args:
        line_format: The line's format tag (``output_folders.LINE_FORMAT``).
        record: The worker's record (its ranks, numbering, fingerprints).
        checksums: The request's checksums in that record.
        request: The name the line gives the request.
        role: ``producer`` or ``consumer``.
        prompt: The request's prompt digest, written as ``"prompt"`` when given.

    Returns:
        The line's data.

    """
    line: dict[str, Any] = {
        "format": line_format,
        "request": request,
        "role": role,
        "num_tokens": int(checksums.num_tokens),
        "positions": record.positions,
        "worker": _line_worker(record.worker),
        "fingerprints": fingerprints_to_json(record.fingerprints),
        "not_covered": not_covered_to_json(record.not_covered),
        "groups": {
            str(gid): _group_entry(group, line=True)
            for gid, group in sorted(checksums.groups.items())
        },
    }
    if prompt is not None:
        line["prompt"] = prompt
    return line
