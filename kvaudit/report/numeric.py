"""The table of a comparison by value: per request and group, the (layer, head) slices
worst first, and a verdict line."""

from __future__ import annotations

import math

from rich.console import Console
from rich.text import Text

from ..diagnosis import diagnose_numeric
from ..numeric.model import NumericReport
from .text import SafeTable

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
    parts = list(report.scale_differences)
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
    """Print the diagnosis, each request's group as a table of its failing slices, then
    the verdict.

    Slices within the tolerance are left out (a line says how many, and the worst of
    them by scaled error); ``--format json`` lists every slice. The tables rank slices by
    scaled error (the largest error over the slice's largest producer value), which
    means something on KV with exact zeros, where a relative error is infinite.

    Args:
        console: Where the tables are printed.
        report: The report drawn.
        title: The line printed first.

    """
    console.print(Text(title), soft_wrap=True)
    # First: a differing scale explains every value of its layer being off.
    for line in report.scale_differences:
        console.print(Text(line, style="red"), soft_wrap=True)
    for (rid, gid), findings in diagnose_numeric(report).items():
        for finding in findings:
            console.print(Text(f"{rid} group {gid}: {finding.line}", style="red"), soft_wrap=True)
    for request in report.requests.values():
        for gid, group in sorted(request.groups.items()):
            heading = f"request {request.request_id}, group {gid}: {request.num_tokens} tokens"
            ranked = sorted(
                group.slices,
                key=lambda s: (-s.scaled_error, -s.max_abs_error, s.number, s.head),
            )
            failed = [item for item in ranked if item.failed]
            passing = len(ranked) - len(failed)
            if not failed:
                worst = ranked[0] if ranked else None
                where = (
                    f"; the worst, {worst.layer} head {worst.head}, scaled error "
                    f"{_fmt(worst.scaled_error)}"
                    if worst is not None
                    else ""
                )
                console.print(f"{heading}: all {passing} slices within the tolerance{where}")
                continue
            table = SafeTable(title=heading)
            for name in (
                "layer",
                "head",
                "scaled error",
                "max abs",
                "RMS",
                "over tol",
                "NaN/Inf",
                "worst tokens",
            ):
                table.add_column(
                    name, justify="left" if name in ("layer", "worst tokens") else "right"
                )
            for item in failed[:NUMERIC_ROWS]:
                table.add_row(
                    item.layer,
                    str(item.head),
                    _fmt(item.scaled_error),
                    _fmt(item.max_abs_error),
                    _fmt(item.rms_error),
                    str(item.over_tolerance),
                    str(item.nonfinite_mismatches),
                    ", ".join(str(position) for position, _ in item.worst),
                )
            notes = []
            if len(failed) > NUMERIC_ROWS:
                notes.append(f"{len(failed) - NUMERIC_ROWS} more failing slices")
            if passing:
                notes.append(f"{passing} slices within the tolerance")
            if notes:
                table.caption = " and ".join(notes) + " in --format json"
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
