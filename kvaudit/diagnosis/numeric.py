"""``diagnose_numeric``: what a comparison by value found, named per group: elements NaN or
infinite on one side only, and slices over the tolerance, few (a fault in a place) or
nearly all (a gap wider than the tolerance allows)."""

from __future__ import annotations

import math

import numpy as np

from ..core.ranges import ranges
from ..numeric.model import GroupNumeric, NumericReport, SliceErrors
from .model import Finding
from .words import heads_text, layer_text

BROAD_SHARE = 0.5
"""Over the tolerance in at least this share of a group's slices, and of its tokens,
reads as a gap everywhere rather than a fault in a place."""


def diagnose_numeric(report: NumericReport) -> dict[tuple[str, int], list[Finding]]:
    """The findings of every group of a comparison by value that fails.

    Args:
        report: The comparison by value.

    Returns:
        Per ``(request, group)`` with a slice over the tolerance or NaN/Inf on one side,
        its findings: ``nonfinite`` first, then ``over_tolerance``.

    """
    result = {}
    for request in report.requests.values():
        for gid, group in sorted(request.groups.items()):
            found = diagnose_numeric_group(group)
            if found:
                result[request.request_id, gid] = found
    return result


def _heads(items: list[SliceErrors]) -> str:
    return heads_text(item.head for item in items)


def _place(item: SliceErrors) -> str:
    """``model.layers.3.self_attn.attn head 2 at token 42``."""
    token = f" at token {item.worst[0][0]}" if item.worst else ""
    return f"{item.layer} head {item.head}{token}"


def _finding(kind: str, text: str, items: list[SliceErrors]) -> Finding:
    tokens = tuple(sorted({position for item in items for position, _ in item.worst}))
    slices = tuple(sorted((item.layer, item.head) for item in items))
    return Finding(kind, text, (), tokens, slices, 0)  # type: ignore[arg-type]


def _times(item: SliceErrors) -> str:
    ratio = item.max_tolerance_ratio
    if not ratio or math.isinf(ratio) or math.isnan(ratio):
        return ""
    return f", {ratio:.3g}x the tolerance"


def _spread(group: GroupNumeric, over: list[SliceErrors]) -> bool:
    """Whether the gap over the tolerance covers most of the request's tokens: most token
    bins compared hold a token over it (without the per-bin ratios: most elements of the
    slices over it are), not a fault of a few tokens that reaches many slices."""
    ratios = group.layer_token_ratios
    if ratios is not None and ratios.size:
        with np.errstate(invalid="ignore"):
            compared = ~np.isnan(ratios).all(axis=0)
            hit = (np.nan_to_num(ratios, nan=0.0) > 1).any(axis=0)
        bins = int(compared.sum())
        return bins > 0 and int((hit & compared).sum()) >= BROAD_SHARE * bins
    elements = sum(item.elements for item in over)
    return elements > 0 and sum(item.over_tolerance for item in over) >= BROAD_SHARE * elements


def diagnose_numeric_group(group: GroupNumeric) -> list[Finding]:
    """The findings of one group compared by value (none where it passes).

    Args:
        group: The group's errors.

    Returns:
        Its findings.

    """
    findings = []
    every = list(group.layers)
    nonfinite = [item for item in group.slices if item.nonfinite_mismatches]
    if nonfinite:
        count = sum(item.nonfinite_mismatches for item in nonfinite)
        noun = "element is" if count == 1 else "elements are"
        worst = max(nonfinite, key=lambda item: item.nonfinite_mismatches)
        text = (
            f"{count} {noun} NaN or infinite on one side only, in {_heads(nonfinite)} of "
            f"{layer_text([i.layer for i in nonfinite], every)}; the most in {_place(worst)}"
        )
        findings.append(_finding("nonfinite", text, nonfinite))
    over = [item for item in group.slices if item.over_tolerance and not item.nonfinite_mismatches]
    if over:
        worst = max(over, key=lambda item: (item.max_tolerance_ratio, item.scaled_error))
        elements = sum(item.over_tolerance for item in over)
        share = len(over) / max(1, len(group.slices))
        where = f"{_heads(over)} of {layer_text([i.layer for i in over], every)}"
        tokens = sorted({position for item in over for position, _ in item.worst})
        at = f", the worst at tokens {ranges(tokens)}" if len(tokens) > 1 else ""
        at = f", the worst at token {tokens[0]}" if len(tokens) == 1 else at
        noun = "element" if elements == 1 else "elements"
        text = (
            f"{len(over)} of {len(group.slices)} slices ({where}), {elements} {noun}{at}; "
            f"the largest, {_place(worst)}: error {worst.max_abs_error:.3g}{_times(worst)}"
        )
        if share >= BROAD_SHARE and len(over) > 1 and _spread(group, over):
            text += ": a gap everywhere, wider than the tolerance (another dtype or kernel?)"
        findings.append(_finding("over_tolerance", text, over))
    return findings
