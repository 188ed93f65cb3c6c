"""The JSON forms of kvaudit's results: records (``checksum --format json``), diff
reports (``diff``/``verify --format json``), inventories (``inspect --format json``) and
planted faults (``corrupt --format json``), and the indented text they are written as
(docs/cli.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.scheme import to_hex
from ..records.encoding import record_to_json as record_to_json

# The results are only read here: writing a record imports no comparison.
if TYPE_CHECKING:
    from ..compare.model import (
        DiffReport,
        GroupComparison,
        LocatedDifference,
        StaleSource,
        TokenRun,
    )
    from ..corrupt.result import PlantedFault
    from ..diagnosis import Finding
    from ..workers import Inventory

DIFF_FORMAT = "kvaudit.diff/1"
INVENTORY_FORMAT = "kvaudit.inventory/1"
JSON_INLINE_WIDTH = 72
"""The longest list JSON output keeps on one line."""

_FLAT = json.JSONEncoder(separators=(", ", ": "), allow_nan=False)
"""What ``json.dumps`` with these options builds anew on every call: a record's thousands
of checksums are written with one."""


def json_text(value: object, level: int = 0) -> str:
    """Strict JSON indented by two spaces: the text the commands print.

    Each short list of plain values or lists is written on one line
    (``"replica_keys": [[1, 0]]``), longer ones an item a line.

    Args:
        value: Plain data: dicts, lists, strings, numbers, booleans and None.
        level: The indentation level the text starts at (nested values).

    Returns:
        The JSON text, without a final newline.

    Raises:
        ValueError: A NaN or infinity in ``value``.
        TypeError: A value that JSON cannot hold.

    """
    inner = "  " * (level + 1)
    close = "  " * level
    if isinstance(value, dict) and value:
        items = [
            f"{inner}{json.dumps(key)}: {json_text(item, level + 1)}" for key, item in value.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{close}}}"
    flat = _FLAT.encode(value)
    if isinstance(value, list) and (
        len(flat) > JSON_INLINE_WIDTH or any(isinstance(item, dict) for item in value)
    ):
        items = [
            inner
            + (json_text(item, level + 1) if isinstance(item, (dict, list)) else _FLAT.encode(item))
            for item in value
        ]
        return "[\n" + ",\n".join(items) + f"\n{close}]"
    return flat


# Records: their one encoder is ``records.encoding`` (re-exported here as ``record_to_json``).


# Diff reports.


def located_items(item: LocatedDifference) -> list[tuple[str, object]]:
    """A located entry's fields in order (as JSON and JUnit list them): ``replica`` only
    for a replica compared with replica 0, ``consumer_worker`` as ``{"tp_rank",
    "pp_rank"}`` and ``file`` where known."""
    items: list[tuple[str, object]] = []
    for entry in dataclasses.fields(item):
        value = getattr(item, entry.name)
        if entry.name == "replica" and not value:
            continue
        if entry.name == "consumer_worker":
            if value is None:
                continue
            value = {"tp_rank": int(value[0]), "pp_rank": int(value[1])}
        if entry.name == "file" and not value:
            continue
        if entry.name == "holds":
            if value is None:
                continue
            value = {"layer": value[0], "head": int(value[1])}
        if entry.name in ("kv_exchanged", "element") and not value:
            continue  # said only where found: the entry reads as before elsewhere
        if entry.name == "element":
            # Strict JSON holds no NaN or infinity: such a value is written as its name.
            value = {
                key: str(x) if isinstance(x, float) and not math.isfinite(x) else x
                for key, x in dataclasses.asdict(value).items()
            }
        items.append((entry.name, value))
    return items


def _finite(value: object) -> object:
    """A located entry's value for strict JSON: an infinite or NaN error becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def located_to_json(item: LocatedDifference) -> dict[str, Any]:
    """A located entry of a diff report's JSON (non-finite errors as null)."""
    return {
        name: list(value) if isinstance(value, list) else _finite(value)
        for name, value in located_items(item)
    }


def _stale_to_json(source: StaleSource) -> dict[str, Any]:
    """A stale source: request, group and position; with the block size and consumer
    position of a trace at a finer block size than the compared one."""
    data: dict[str, Any] = {
        "request": source.request,
        "group": int(source.group),
        "position": int(source.position),
    }
    if source.block_size is not None:
        data["block_size"] = int(source.block_size)
        data["consumer_position"] = source.consumer_position
    return data


def group_to_json(group: GroupComparison) -> dict[str, Any]:
    """A group's entry of a diff report's JSON."""
    held = None
    if group.held is not None:
        held = {"producer": int(group.held[0]), "consumer": int(group.held[1])}
    data: dict[str, Any] = {
        "compared": int(group.compared),
        "mismatched_positions": [int(position) for position in group.mismatched_positions],
        "missing_positions": [int(position) for position in group.missing_positions],
        "replicas_differing": [
            [int(replicas), int(index)] for replicas, index in group.replicas_differing
        ],
        "unverified": group.unverified,
        "positions": held,
        "located": [located_to_json(item) for item in group.located],
        "stale_sources": {
            str(position): [_stale_to_json(source) for source in sources]
            for position, sources in sorted(group.stale_sources.items())
        },
        "token_runs": [_token_run_to_json(run) for run in group.token_runs],
    }
    if group.token_shifts:  # only where found: a report reads as before elsewhere
        data["token_shifts"] = [
            {
                "first": int(shift.first),
                "last": int(shift.last),
                "shift": int(shift.shift),
                "slices": [[layer, int(head)] for layer, head in shift.slices],
                "residue": [int(t) for t in shift.residue],
            }
            for shift in group.token_shifts
        ]
    if group.stale_matches:  # only where a list was cut short: the sources' count
        data["stale_matches"] = {
            str(position): int(count) for position, count in sorted(group.stale_matches.items())
        }
    if group.compared and group.seed_lane_only is not None:
        # Only where the verdict rests on the seed lane alone: why (docs/checksum.md).
        data["seed_lane_only"] = group.seed_lane_only
    return data


def _request_to_json(report: DiffReport, request_id: str) -> dict[str, Any]:
    """A request's entry of a diff report's JSON: each side's token count, its groups."""
    producer, consumer = report.num_tokens.get(request_id, (None, None))
    groups = report.requests[request_id]
    return {
        "num_tokens": {"producer": producer, "consumer": consumer},
        "groups": {str(gid): group_to_json(groups[gid]) for gid in sorted(groups)},
    }


def finding_to_json(request_id: str, group_id: int, finding: Finding) -> dict[str, Any]:
    """A finding of the diagnosis: where, its kind, its line and what it covers."""
    return {
        "request": request_id,
        "group": int(group_id),
        "kind": finding.kind,
        "text": finding.line,
        "positions": [int(p) for p in finding.positions],
        "tokens": [int(t) for t in finding.tokens],
        "slices": [[layer, int(head)] for layer, head in finding.slices],
        "located": int(finding.located),
    }


def _token_run_to_json(run: TokenRun) -> dict[str, Any]:
    """A run of differing tokens traced token by token, with the producer places found."""
    data: dict[str, Any] = {
        "position": int(run.position),
        "first": int(run.first),
        "count": int(run.count),
        "traced": run.traced,
        "sources": [{"request": rid, "first": int(first)} for rid, first in run.sources],
    }
    if run.matches is not None:  # only where the sources were cut short
        data["matches"] = int(run.matches)
    return data


def diff_to_json(report: DiffReport) -> dict[str, Any]:
    """The report as ``diff --format json`` writes it (docs/cli.md).

    Args:
        report: The diff or verify report.

    Returns:
        Its JSON object (``json_text`` writes it).

    """
    from ..diagnosis import diagnose

    data: dict[str, Any] = {
        "format": DIFF_FORMAT,
        "ok": report.ok,
        "diagnosis": [
            finding_to_json(rid, gid, finding)
            for (rid, gid), findings in diagnose(report).items()
            for finding in findings
        ],
        "positions": report.positions,
        "unverified": report.empty_reason,
        "warnings": list(report.warnings),
        "requests": {
            request_id: _request_to_json(report, request_id) for request_id in report.requests
        },
        "only_in_producer": list(report.only_in_producer),
        "only_in_consumer": list(report.only_in_consumer),
        "untraced": report.untraced,
    }
    if report.scale_differences:  # only where a layer's scale differs (a quantized cache)
        data["scales_differ"] = list(report.scale_differences)
    return data


def diff_json_text(report: DiffReport) -> str:
    """The ``--format json`` text of a diff report.

    Args:
        report: The report written.

    Returns:
        The text of ``diff_to_json(report)``, ending with a newline.

    """
    return json_text(diff_to_json(report)) + "\n"


# Inventories.


def inventory_to_json(inventory: Inventory) -> dict[str, Any]:
    """The ``inspect --format json`` form of an inventory.

    Args:
        inventory: The inventory written.

    Returns:
        Plain data for ``json_text``.

    """
    return {
        "format": INVENTORY_FORMAT,
        "kind": inventory.kind,
        "sources": list(inventory.sources),
        "complete": inventory.complete,
        "missing_workers": [{"pp_rank": pp, "tp_rank": tp} for pp, tp in inventory.missing_workers],
        "workers": [
            {
                "source": item.worker.source,
                "tp_rank": item.worker.tp_rank,
                "tp_size": item.worker.tp_size,
                "pp_rank": item.worker.pp_rank,
                "pp_size": item.worker.pp_size,
                "role": item.worker.role,
                "engine": item.worker.engine,
                "rows": item.rows,
                "groups": {
                    str(group.id): {
                        "type": group.type,
                        "block_size": group.block_size,
                        "kernel_block_size": group.kernel_block_size,
                        "layout": group.layout,
                        "layers": group.layers,
                        "bytes": group.bytes,
                        "fingerprint": to_hex(group.fingerprint),
                        "covered": group.covered,
                        "reason": group.reason,
                        **_scales_json(group.scales),
                    }
                    for group in item.groups
                },
            }
            for item in inventory.workers
        ],
        "requests": {
            request_id: {
                "num_tokens": request.num_tokens,
                "groups": {
                    str(gid): sorted(held) for gid, held in sorted(request.positions.items())
                },
            }
            for request_id, request in inventory.requests.items()
        },
    }


# Planted faults.


def planted_to_json(fault: PlantedFault) -> dict[str, Any]:
    """What ``corrupt --format json`` writes of a planted fault.

    The fault's fields come first, then the mode's own details under ``flip``, ``swap``
    or ``from``.

    Args:
        fault: The fault ``corrupt_dump`` planted.

    Returns:
        Plain data for ``json_text``.

    """
    data: dict[str, Any] = {
        "source": fault.source,
        "out": fault.out,
        "mode": fault.mode,
        "seed": fault.seed,
        "request": fault.request,
        "group": fault.group,
        "position": fault.position,
        "block": fault.block,
        "row": fault.row,
        "num_tokens": fault.num_tokens,
        "layers": list(fault.layers),
        "heads": list(fault.heads),
        "tokens": list(fault.tokens),
        "changes": [dataclasses.asdict(change) for change in fault.changes],
        "byte_ranges": [list(byte_range) for byte_range in fault.byte_ranges],
    }
    if fault.flip is not None:
        data["flip"] = dataclasses.asdict(fault.flip)
    if fault.swap is not None:
        data["swap"] = dataclasses.asdict(fault.swap)
    if fault.origin is not None:
        data["from"] = dataclasses.asdict(fault.origin)
    return data


def _scales_json(
    scales: Sequence[tuple[str, float | None, float | None]],
) -> dict[str, dict[str, dict[str, float | None]]]:
    """An inventory group's ``scales`` entry, only where a layer has one (a quantized
    cache): each such layer's K and V scales."""
    if not scales:
        return {}
    return {"scales": {name: {"k_scale": k, "v_scale": v} for name, k, v in scales}}
