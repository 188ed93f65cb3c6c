"""The ``diff`` and ``verify`` tables: per request and group what was compared and what
differs, the verdict line, and the located differences."""

from __future__ import annotations

from typing import Literal

from rich.console import Console
from rich.text import Text

from ..compare.model import DiffReport, GroupComparison, matches_text
from ..core.ranges import ranges
from ..diagnosis import Finding, diagnose
from .side_names import DIFF_SIDE_NAMES, SideNames
from .text import SafeTable, error_text, filled_table, plural

LOCATED_ROWS = 40
"""Located differences a table shows per request and group; JSON holds them all."""

LocatedRows = Literal["unexplained", "first", "all"]
"""Which located rows a table shows (``print_diff``)."""


def diff_verdict(report: DiffReport, sides: SideNames = DIFF_SIDE_NAMES) -> str:
    """The report's verdict, in one line.

    The line is ``OK: ...`` when the report is ok, else ``MISMATCH: ...`` (blocks,
    replicas, requests or layer scales differ or are missing) or ``UNVERIFIED: ...``
    (only groups that could not be compared).

    Args:
        report: The report judged.
        sides: What the report's sides and compared blocks are called.

    Returns:
        The verdict line.

    """
    groups = [group for _, _, group in report.groups()]
    requests = len(report.requests)
    blocks = sum(group.compared for group in groups)
    differing = sum(len(group.mismatched_positions) for group in groups)
    replicas = sum(len(group.replica_mismatches) for group in groups)
    missing = sum(len(group.missing_positions) for group in groups)
    unverified = sum(1 for group in groups if group.unverified is not None)
    requests_differing = sum(
        1
        for groups_of in report.requests.values()
        if any(
            group.mismatched_positions or group.replicas_differing for group in groups_of.values()
        )
    )
    scope = f"{plural(requests, 'request')}, {plural(blocks, 'block')} {sides.compared}"
    if report.ok:
        notes = []
        if report.only_in_consumer:
            notes.append(
                f"{plural(len(report.only_in_consumer), 'request')} on the "
                f"{sides.consumer} only, not compared"
            )
        if missing:
            notes.append(f"{plural(missing, 'position')} missing on the {sides.consumer}, allowed")
        extra = f" ({'; '.join(notes)})" if notes else ""
        return f"OK: {scope}, all match{extra}"
    parts = []
    if differing:
        parts.append(
            f"{differing} of {plural(blocks, 'block')} {sides.compared} differ, in "
            f"{requests_differing} of {plural(requests, 'request')}"
        )
    if replicas:
        verb = "differs" if replicas == 1 else "differ"
        parts.append(f"{plural(replicas, 'replica block')} {verb} from replica 0")
    if report.only_in_producer:
        parts.append(
            f"{plural(len(report.only_in_producer), 'request')} missing on the {sides.consumer}"
        )
    if missing and not report.allow_missing:
        parts.append(f"{plural(missing, 'position')} missing on the {sides.consumer}")
    if unverified:
        parts.append(f"{plural(unverified, 'group')} could not be verified")
    # Each differing scale in full: the layer and both values are the finding.
    parts.extend(report.scale_differences)
    failed = differing or replicas or report.only_in_producer or report.scale_differences
    if failed or (missing and not report.allow_missing):
        return "MISMATCH: " + "; ".join(parts)
    if report.empty_reason is not None and not parts:
        return f"UNVERIFIED: {scope}; nothing was verified: {report.empty_reason}"
    return f"UNVERIFIED: {scope}; " + "; ".join(parts)


def _result_cell(group: GroupComparison, allow_missing: bool) -> Text:
    """A group's result in the diff table: unverified and why, MISMATCH, MISSING or ok."""
    if group.unverified is not None:
        return Text(f"unverified: {group.unverified}", style="yellow")
    if group.mismatched_positions or group.replicas_differing:
        return Text("MISMATCH", style="bold red")
    if group.missing_positions and not allow_missing:
        return Text("MISSING", style="bold red")
    return Text("ok", style="green")


def _stale_text(group: GroupComparison) -> list[str]:
    """Each traced differing position as ``4 holds req-a position 1``; a trace at a finer
    block size as ``1 tokens 80-95 hold req-a position 2 at block size 16``; a list cut
    short (more places hold it) ends with ``(matches N places, first K shown)``."""
    lines = []
    for position, sources in sorted(group.stale_sources.items()):
        whole = [source for source in sources if source.block_size is None]
        if whole:
            held = ", ".join(f"{source.request} position {source.position}" for source in whole)
            lines.append(f"{position} holds {held}")
        units: dict[tuple[int, int], list[str]] = {}
        for source in sources:
            if source.block_size is not None and source.consumer_position is not None:
                unit = (source.consumer_position, source.block_size)
                units.setdefault(unit, []).append(f"{source.request} position {source.position}")
        for (unit, size), held_by in units.items():
            lines.append(
                f"{position} tokens {unit * size}-{unit * size + size - 1} hold "
                f"{', '.join(held_by)} at block size {size}"
            )
        if position in group.stale_matches and lines:
            lines[-1] += f" ({matches_text(group.stale_matches[position], len(sources))})"
    return lines


def _replica_text(mismatches: list[tuple[int, int, int]]) -> str:
    """``(position, R, r)`` triples as ``4 (2:1, 4:3), 5 (2:1)``: each position with the
    replica keys that differ there."""
    by_position: dict[int, list[tuple[int, int]]] = {}
    for position, replicas, index in mismatches:
        by_position.setdefault(position, []).append((replicas, index))
    return ", ".join(
        f"{position} ({', '.join(f'{r}:{i}' for r, i in sorted(keys))})"
        for position, keys in sorted(by_position.items())
    )


def print_diff(
    console: Console,
    report: DiffReport,
    *,
    title: str | None = None,
    sides: SideNames = DIFF_SIDE_NAMES,
    located_rows: LocatedRows = "unexplained",
) -> None:
    """Print the ``diff`` and ``verify`` tables of a report, then its verdict.

    The diagnosis comes first: each differing group's findings (``kvaudit.diagnosis``),
    a line each. The table has a row per request and group (blocks compared, blocks and
    replicas that differ, the result or why it could not be compared); the verdict line,
    the requests only one side holds and the located differences follow, as
    ``located_rows`` says.

    Args:
        console: Where the tables are printed.
        report: The report drawn.
        title: A line printed above the table; None for none.
        sides: What the report's sides and compared blocks are called.
        located_rows: ``unexplained`` (a group whose findings name every located entry's
            fault shows none, another at most ``LOCATED_ROWS``), ``first`` (at most
            ``LOCATED_ROWS`` of every group) or ``all``.

    """
    if title:
        console.print(Text(title, style="bold"), soft_wrap=True)
    for line in report.scale_differences:
        console.print(Text(line, style="red"), soft_wrap=True)
    findings = diagnose(report)
    for (request_id, gid), found in findings.items():
        for finding in found:
            console.print(
                Text(f"{request_id} group {gid}: {finding.line}", style="red"), soft_wrap=True
            )
    table = SafeTable(title=None)
    for name, justify in (
        ("request", "left"),
        ("group", "right"),
        ("block", "right"),
        (sides.compared, "right"),
        ("differing positions", "left"),
        ("missing positions", "left"),
        ("replicas differing", "left"),
        ("result", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for request_id, groups in report.requests.items():
        if not groups:
            table.add_row(
                request_id, "-", "", "0", "", "", "", Text("no group to compare", "yellow")
            )
        for gid in sorted(groups):
            group = groups[gid]
            mismatched = group.mismatched_positions
            missing = group.missing_positions
            differing = f"{len(mismatched)}: {ranges(mismatched)}" if mismatched else "-"
            stale = _stale_text(group)
            if stale:
                differing += " (" + "; ".join(stale) + ")"
            table.add_row(
                request_id,
                str(gid),
                str(group.block_size) if group.block_size else "",
                str(group.compared),
                differing,
                f"{len(missing)}: {ranges(missing)}" if missing else "-",
                _replica_text(group.replica_mismatches) if group.replica_mismatches else "-",
                _result_cell(group, report.allow_missing),
            )
    if report.requests:
        console.print(table)
    verdict = diff_verdict(report, sides)
    console.print(Text(verdict, style="bold green" if report.ok else "bold red"), soft_wrap=True)
    if report.only_in_producer:
        console.print(
            Text(
                f"missing on the {sides.consumer} (on the {sides.producer} only): "
                + ", ".join(report.only_in_producer),
                style="red",
            ),
            soft_wrap=True,
        )
    if report.only_in_consumer:
        console.print(
            f"on the {sides.consumer} only (not compared): " + ", ".join(report.only_in_consumer),
            soft_wrap=True,
        )
    if report.untraced is not None and any(g.mismatched_positions for _, _, g in report.groups()):
        console.print(f"stale sources: {report.untraced}", soft_wrap=True)
    _print_located(console, report, findings, located_rows)


def explained(findings: list[Finding], located: int) -> bool:
    """Whether a group's findings name the fault of each of its ``located`` entries (none
    of them is only ``differs``): its rows are detail."""
    named = sum(finding.located for finding in findings if finding.kind != "differs")
    return located > 0 and named == located


def _print_located(
    console: Console,
    report: DiffReport,
    findings: dict[tuple[str, int], list[Finding]],
    located_rows: LocatedRows,
) -> None:
    """The located differences table, its rows as ``located_rows`` says."""
    rows: list[list[str]] = []
    left_out = 0
    for request_id, gid, group in report.groups():
        shown = group.located if located_rows == "all" else group.located[:LOCATED_ROWS]
        named = explained(findings.get((request_id, gid), []), len(group.located))
        if located_rows == "unexplained" and named:
            left_out += len(group.located)
            continue
        for item in shown:
            rows.append(
                [
                    request_id,
                    str(gid),
                    str(item.position),
                    item.layer,
                    str(item.head),
                    str(item.replica) if item.replica else "",
                    ranges(item.tokens),
                    str(item.first_byte),
                    error_text(item.max_abs_error),
                    error_text(item.scaled_error),
                    _worker_text(item.consumer_worker),
                ]
            )
        hidden = len(group.located) - len(shown)
        if hidden > 0:
            more = f"... {hidden} more (--all or --format json lists all)"
            rows.append([request_id, str(gid), "", more, "", "", "", "", "", "", ""])
    if left_out:
        console.print(
            f"{plural(left_out, 'located difference')} named above (--all lists them)",
            soft_wrap=True,
        )
    if not rows:
        return
    columns = (
        "request",
        ">group",
        ">position",
        "layer",
        ">head",
        ">replica",
        "tokens",
        ">first byte",
        ">max abs error",
        ">scaled error",
        "consumer worker",
    )
    console.print(Text("Located differences", style="bold"))
    console.print(filled_table("", columns, rows))


def _worker_text(worker: tuple[int, int] | None) -> str:
    """A consumer worker as ``tp 1 pp 0`` (empty where unknown)."""
    return "" if worker is None else f"tp {worker[0]} pp {worker[1]}"
