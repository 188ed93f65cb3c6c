"""The table of a comparison by value: per request and group, the (layer, head) slices
worst first, and a verdict line."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from ..numeric.model import NumericReport

NUMERIC_ROWS = 20
"""At most this many (layer, head) rows per group; the JSON carries them all."""


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "inf"
    return f"{value:.4g}"


def numeric_verdict(report: NumericReport) -> str:
    """One line: OK, or what failed."""
    if report.ok:
        return f"OK: every element within atol {report.atol:g} + rtol {report.rtol:g} x |producer|"
    parts = []
    if report.failed_slices:
        parts.append(f"{report.failed_slices} (layer, head) slices over the tolerance")
    if report.only_producer or report.only_consumer:
        parts.append(
            f"{len(report.only_producer) + len(report.only_consumer)} requests on one side only"
        )
    if report.not_compared:
        parts.append(f"{len(report.not_compared)} parts not compared")
    if report.missing and not report.allow_missing:
        parts.append(f"{len(report.missing)} parts missing on the consumer")
    if report.copies_differing:
        parts.append(f"consumer copies differ in {len(report.copies_differing)} groups")
    parts.extend(report.incomplete)
    if report.empty_reason:
        parts.append(f"nothing was compared ({report.empty_reason})")
    return "FAILED: " + "; ".join(parts)


def print_numeric(console: Console, report: NumericReport, title: str) -> None:
    """Print each request's group as a table of its worst slices, then the verdict.

    Args:
        console: Where the tables are printed.
        report: The report drawn.
        title: The line printed first.

    """
    console.print(title)
    for request in report.requests.values():
        for gid, group in sorted(request.groups.items()):
            table = Table(
                title=f"request {request.request_id}, group {gid}: {request.num_tokens} tokens"
            )
            for name in (
                "layer",
                "head",
                "max abs",
                "max rel",
                "RMS",
                "over tol",
                "NaN/Inf",
                "worst tokens",
            ):
                table.add_column(
                    name, justify="left" if name in ("layer", "worst tokens") else "right"
                )
            worst = sorted(
                group.slices,
                key=lambda s: (not s.failed, -s.max_rel_error, -s.max_abs_error, s.number, s.head),
            )
            for item in worst[:NUMERIC_ROWS]:
                table.add_row(
                    item.layer,
                    str(item.head),
                    _fmt(item.max_abs_error),
                    _fmt(item.max_rel_error),
                    _fmt(item.rms_error),
                    str(item.over_tolerance),
                    str(item.nonfinite_mismatches),
                    ", ".join(str(position) for position, _ in item.worst),
                )
            if len(worst) > NUMERIC_ROWS:
                table.caption = f"{len(worst) - NUMERIC_ROWS} more slices in --format json"
            console.print(table)
    for rid in report.only_producer:
        console.print(f"request {rid}: only on the producer")
    for rid in report.only_consumer:
        console.print(f"request {rid}: only on the consumer")
    for rid, gid, reason in report.not_compared:
        console.print(f"request {rid} group {gid}: not compared: {reason}")
    allowed = " (allowed)" if report.allow_missing else ""
    for rid, group, what in report.missing:
        where = f"request {rid}" + ("" if group is None else f" group {group}")
        console.print(f"{where}: missing on the consumer{allowed}: {what}")
    for rid, gid, copies in report.copies_differing:
        listed = ", ".join(f"position {p} copy {r} of {n}" for p, n, r in copies[:8])
        more = f" and {len(copies) - 8} more" if len(copies) > 8 else ""
        console.print(
            f"request {rid} group {gid}: consumer copies differ from the copy compared: "
            f"{listed}{more}"
        )
    console.print(numeric_verdict(report))
