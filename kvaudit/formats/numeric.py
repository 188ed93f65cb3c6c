"""The JSON form of a comparison by value (docs/numeric.md): every request, group, layer
and head with its errors, what one side lacks and what was not compared."""

from __future__ import annotations

import math
from typing import Any

from ..diagnosis import diagnose_numeric
from ..numeric.model import GroupNumeric, NumericReport, SliceErrors
from .json import finding_to_json

NUMERIC_FORMAT = "kvaudit.numeric"
NUMERIC_VERSION = 1


def number(value: float) -> float | str | None:
    """A value for strict JSON: infinity as ``"inf"``, NaN (nothing compared) as None."""
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def slice_to_json(item: SliceErrors) -> dict[str, Any]:
    """One (layer, head)'s errors."""
    return {
        "layer": item.layer,
        "head": item.head,
        "tokens": item.tokens,
        "elements": item.elements,
        "max_abs_error": number(item.max_abs_error),
        "max_rel_error": number(item.max_rel_error),
        "max_abs_producer": number(item.max_producer),
        "scaled_error": number(item.scaled_error),
        "rms_error": number(item.rms_error),
        "over_tolerance": item.over_tolerance,
        "nonfinite_mismatches": item.nonfinite_mismatches,
        "tolerance_ratio": number(item.max_tolerance_ratio),
        "failed": item.failed,
        "worst_tokens": [
            {"position": position, "abs_error": number(error)} for position, error in item.worst
        ],
    }


def group_to_json(group: GroupNumeric) -> dict[str, Any]:
    """One request's group: its slices and the layers x token bins relative errors."""
    return {
        "group": group.group,
        "failed": group.failed,
        "layers": list(group.layers),
        "heads": group.heads,
        "token_bin": group.token_bin,
        "layer_token_scaled_error": [
            [number(float(value)) for value in row] for row in group.layer_tokens
        ],
        "slices": [slice_to_json(item) for item in group.slices],
    }


def numeric_to_json(
    report: NumericReport, producer: str | None = None, consumer: str | None = None
) -> dict[str, Any]:
    """The whole report as a JSON-able dict.

    Args:
        report: The report written.
        producer: The producer side's name, or None.
        consumer: The consumer side's name, or None.

    Returns:
        Plain data for ``json_text`` (an infinite error as ``"inf"``, NaN as None).

    """
    data: dict[str, Any] = {
        "format": NUMERIC_FORMAT,
        "version": NUMERIC_VERSION,
        "producer": producer,
        "consumer": consumer,
        "ok": report.ok,
        "diagnosis": [
            finding_to_json(rid, gid, finding)
            for (rid, gid), findings in diagnose_numeric(report).items()
            for finding in findings
        ],
        "atol": report.atol,
        "rtol": report.rtol,
        "failed_slices": report.failed_slices,
        "requests": [
            {
                "request": request.request_id,
                "tokens": request.num_tokens,
                "groups": [group_to_json(group) for _, group in sorted(request.groups.items())],
            }
            for request in report.requests.values()
        ],
        "only_producer": list(report.only_producer),
        "only_consumer": list(report.only_consumer),
        "not_compared": [
            {"request": rid, "group": gid, "reason": reason}
            for rid, gid, reason in report.not_compared
        ],
        "missing": [
            {"request": rid, "group": gid, "what": what} for rid, gid, what in report.missing
        ],
        "allow_missing": report.allow_missing,
        "copies_differing": [
            {
                "request": rid,
                "group": gid,
                "copies": [{"position": p, "replicas": n, "replica": r} for p, n, r in copies],
            }
            for rid, gid, copies in report.copies_differing
        ],
        "incomplete": list(report.incomplete),
        "empty": report.empty_reason,
        "warnings": list(report.warnings),
    }
    if report.scale_differences:  # only where a layer's scale differs, as diff's JSON
        data["scales_differ"] = list(report.scale_differences)
    return data
