"""One self-contained HTML page of a comparison (``diff --html``): per request and group,
heatmaps (layers x heads, layers x token positions) as inline PNG images beside their
tables. No script, no style sheet or image from elsewhere: it opens offline, anywhere."""

from __future__ import annotations

import base64
import html
import math

import numpy as np

from ..compare import DiffReport
from ..core.errors import printable
from ..diagnosis import diagnose, diagnose_numeric
from ..numeric.model import NumericReport, SliceErrors
from .heatmaps import (
    MISMATCHES,
    RATIO,
    Heatmap,
    layer_head_errors,
    layer_token_errors,
    located_heatmaps,
    run_text,
    runs,
)
from .png import (
    INFINITE,
    NOT_COMPARED,
    colours,
    encode_png,
    ratio_colours,
    rel_error_position,
)


def _text(value: str) -> str:
    """Text for the page: control characters (ESC, C0, C1, DEL) and lone surrogates
    shown as ``\\xNN`` escapes, as the terminal report shows them, then HTML-escaped."""
    return html.escape(printable(value))


ROW_PX = 14
"""Screen pixels per heatmap row (one layer)."""
MAX_WIDTH_PX = 768
TABLE_ROWS = 40
"""At most this many (layer, head) rows per group's table, worst first."""

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
.ok { color: #1a7f37; } .failed { color: #b3261e; }
.group { display: flex; flex-wrap: wrap; gap: 2em; align-items: flex-start; margin-bottom: 2em; }
.map { display: grid; align-items: start; justify-content: start; }
.labels div { height: 14px; line-height: 14px; font-size: 11px; padding-right: 4px;
  text-align: right; white-space: nowrap; }
.labels div.marked, .marks .label { color: #b3261e; font-weight: bold; }
.map img { image-rendering: pixelated; image-rendering: crisp-edges; outline: 1px solid #888;
  display: block; }
.axis, .marks { position: relative; font-size: 11px; white-space: nowrap; }
.axis { height: 18px; border-top: 1px solid #888; margin-top: 1px; }
.axis .tick { position: absolute; top: 0; height: 4px; border-left: 1px solid #666; }
.axis .tick span { position: absolute; top: 4px; transform: translateX(-50%); color: #444;
  line-height: 12px; }
.marks { height: 22px; }
.marks .bar { position: absolute; top: 0; height: 5px; background: #b3261e; min-width: 2px; }
.marks .label { position: absolute; top: 7px; line-height: 12px; }
.axis-name { font-size: 11px; color: #555; text-align: center; }
p.where { font-size: 12px; margin: 2px 0 0 0; }
figcaption { font-size: 12px; color: #555; margin-bottom: 4px; }
table { border-collapse: collapse; font-size: 12px; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
td.name { text-align: left; }
.legend span { display: inline-block; width: 14px; height: 14px; vertical-align: middle;
  border: 1px solid #888; margin: 0 4px 0 12px; }
"""


def fmt(value: float) -> str:
    """A number as the page shows it: 6 significant digits, ``inf``, or a dash for NaN."""
    if math.isnan(value):
        return "-"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.6g}"


TOKEN_TICK_PX = 40
"""At least this many pixels between two tick labels of a token axis."""
MARK_LABELS = 8
"""At most this many marked runs labelled on an axis (every one is drawn)."""


def _tick_gap(extent: int, by_token: bool) -> float:
    """The pixels two tick labels need between them: the widest label's and a margin,
    at least ``TOKEN_TICK_PX`` on a token axis."""
    needed = 6.5 * len(str(max(extent - 1, 0))) + 12
    return max(needed, TOKEN_TICK_PX) if by_token else needed


def _ticks(extent: int, unit_px: float, by_token: bool) -> list[int]:
    """Evenly spaced ticks over heads or token positions ``0 .. extent - 1``: every
    ``step``, the smallest power of 2 (1, 2, 4, ... 16, 32, ...: block sizes are powers
    of 2) that leaves the labels room, and the last position where it does not crowd
    the tick before."""
    if extent <= 0:
        return []
    gap = _tick_gap(extent, by_token)
    step = 1
    while step * unit_px < gap and step < extent:
        step *= 2
    ticks = list(range(0, extent, step))
    if ticks[-1] != extent - 1 and (extent - 1 - ticks[-1]) * unit_px >= gap:
        ticks.append(extent - 1)
    return ticks


def _colour_cells(heatmap: Heatmap) -> np.ndarray:
    """The RGB cells of a heatmap: its tolerance ratios, relative errors or counts."""
    values = heatmap.values
    if heatmap.kind == RATIO:
        return ratio_colours(values)
    if heatmap.kind == MISMATCHES:
        top = float(values.max()) if values.size else 0.0
        return colours(values / top if top > 0 else np.zeros_like(values))
    return colours(rel_error_position(values))


def _image(heatmap: Heatmap) -> str:
    """The heatmap as an inline PNG (one pixel a cell), its row labels (layers) to the
    left, its axis below (heads or token positions, ticks evenly spaced) and under it
    the differing or failing heads or tokens marked in red, named below the picture."""
    values = heatmap.values
    data = base64.b64encode(encode_png(_colour_cells(heatmap))).decode("ascii")
    rows, cols = values.shape
    cell = max(2, min(24, MAX_WIDTH_PX // max(cols, 1)))
    width, extent, width_of = cols * cell, heatmap.extent, heatmap.token_bin
    unit_px = cell / width_of

    def left(unit: int) -> int:
        return (unit // width_of) * cell

    marked = set(heatmap.marked_rows)
    labels = "".join(
        f'<div class="marked" data-marked="1">{_text(name)}</div>'
        if index in marked
        else f"<div>{_text(name)}</div>"
        for index, name in enumerate(heatmap.rows)
    )
    ticks = "".join(
        f'<span class="tick" data-at="{at}" style="left: {left(at) + cell / 2:g}px">'
        f"<span>{at}</span></span>"
        for at in _ticks(extent, unit_px, heatmap.by_token)
    )
    bars = "".join(
        f'<span class="bar" data-first="{a}" data-last="{b}" style="left: {left(a)}px; '
        f'width: {left(b) + cell - left(a)}px"></span>'
        for a, b in heatmap.marks
    )
    bars += "".join(
        f'<span class="label" style="left: {left(a)}px">{run_text([(a, b)])}</span>'
        for a, b in heatmap.marks[:MARK_LABELS]
    )
    axis = "token position" if heatmap.by_token else "head"
    what = "tokens" if heatmap.by_token else "heads"
    detail = f"{axis}s 0 .. {extent - 1}" if extent else "none"
    if width_of > 1:
        detail += f", {width_of} a column"
    verb = "differing" if heatmap.kind == MISMATCHES else "over the tolerance"
    where = ""
    if heatmap.marks:
        named = heatmap.marks[:20]
        more = len(heatmap.marks) - len(named)
        layers = ", ".join(_text(heatmap.rows[r]) for r in heatmap.marked_rows)
        where = (
            f'<p class="where failed">{verb.capitalize()}: {what} '
            f'<span class="runs">{run_text(named)}</span>'
            f"{f' and {more} more runs' if more else ''}; layers {layers}</p>"
        )
    return (
        f'<figure data-title="{_text(heatmap.title)}"><figcaption>{_text(heatmap.title)}: '
        f"{_text(heatmap.kind)} ({detail})</figcaption>"
        f'<div class="map" style="grid-template-columns: auto {width}px">'
        f'<div class="labels">{labels}</div>'
        f'<img alt="{_text(heatmap.title)}" class="heatmap" data-kind="{_text(heatmap.kind)}" '
        f'data-rows="{rows}" data-columns="{cols}" data-span="{extent}" '
        f'data-token-bin="{width_of}" width="{width}" height="{rows * ROW_PX}" '
        f'src="data:image/png;base64,{data}">'
        f'<div></div><div class="axis">{ticks}</div>'
        f'<div></div><div class="marks">{bars}</div>'
        f'<div></div><div class="axis-name">{axis}</div></div>{where}</figure>'
    )


def _swatch(rgb: tuple[int, int, int] | np.ndarray) -> str:
    r, g, b = (int(c) for c in rgb)
    return f'<span style="background: rgb({r},{g},{b})"></span>'


def _legend(kind: str) -> str:
    if kind == MISMATCHES:
        steps = [(0.0, "none"), (0.5, "half the most"), (1.0, "the most differing")]
        items = "".join(_swatch(colours(np.array([[t]]))[0, 0]) + label for t, label in steps)
        return (
            f'<p class="legend">Colour: mismatch count. {items}. Red bars under an axis '
            "mark the differing heads and tokens.</p>"
        )
    if kind == RATIO:
        within = [(0.0, "0"), (1e-3, "0.001"), (1e-2, "0.01"), (0.1, "0.1"), (1.0, "1")]
        over = [(1.01, "just over 1"), (10.0, "10"), (100.0, "100 or more")]
        show = [
            "".join(_swatch(ratio_colours(np.array([[v]]))[0, 0]) + label for v, label in steps)
            for steps in (within, over)
        ]
        return (
            '<p class="legend" data-kind="tolerance ratio">Colour: error / (atol + rtol '
            "|producer|) of a cell, the largest over its elements (with atol 0: the relative "
            f"error / rtol). Within the tolerance (up to 1): {show[0]}; over it: {show[1]}"
            f"{_swatch(INFINITE)}infinite{_swatch(NOT_COMPARED)}not compared. Red bars under "
            "an axis mark the heads and tokens over the tolerance.</p>"
        )
    steps = [(0.0, "0"), (1e-6, "1e-6"), (1e-4, "1e-4"), (1e-2, "1e-2"), (1.0, "1 or more")]
    items = "".join(
        _swatch(colours(rel_error_position(np.array([[v]])))[0, 0]) + label for v, label in steps
    )
    items += _swatch(INFINITE) + "infinite" + _swatch(NOT_COMPARED) + "not compared"
    return (
        '<p class="legend">Colour: relative error of a cell, its largest |consumer - producer|'
        f" over its largest |producer|. {items}</p>"
    )


def _slice_row(request_id: str, group_id: int, item: SliceErrors) -> str:
    def cell(field: str, text: str) -> str:
        return (
            f'<td data-request="{_text(request_id)}" data-group="{group_id}" '
            f'data-layer="{_text(item.layer)}" data-head="{item.head}" '
            f'data-field="{field}">{text}</td>'
        )

    worst = ", ".join(f"{position} ({fmt(error)})" for position, error in item.worst)
    return (
        f'<tr class="{"failed" if item.failed else "ok"}"><td class="name">'
        f"{_text(item.layer)}</td><td>{item.head}</td>"
        + cell("max_tolerance_ratio", fmt(item.max_tolerance_ratio))
        + cell("max_abs_error", fmt(item.max_abs_error))
        + cell("max_rel_error", fmt(item.max_rel_error))
        + cell("scaled_error", fmt(item.scaled_error))
        + cell("rms_error", fmt(item.rms_error))
        + cell("over_tolerance", str(item.over_tolerance))
        + cell("nonfinite_mismatches", str(item.nonfinite_mismatches))
        + f'<td class="name">{_text(worst)}</td></tr>'
    )


def _page(title: str, summary: str, sections: list[str], empty: str) -> str:
    body = "\n".join(sections) or f"<p>{empty}</p>"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_text(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{_text(title)}</h1>{summary}\n{body}\n</body></html>\n"
    )


def _warnings(warnings: list[str]) -> str:
    """A report's warnings, a paragraph each."""
    return "".join(f"<p class=failed>Warning: {_text(text)}</p>" for text in warnings)


def _numeric_checks(report: NumericReport) -> list[str]:
    """The paragraphs of what the values cannot show: warnings, positions missing on the
    consumer, consumer copies that differ, incomplete sets, nothing compared."""
    lines = [_warnings(report.warnings)]
    if report.missing:
        state = "ok" if report.allow_missing else "failed"
        allowed = " (allowed)" if report.allow_missing else ""
        items = "".join(
            f"<li>{_text(rid)}{'' if gid is None else f' group {gid}'}: {_text(what)}</li>"
            for rid, gid, what in report.missing
        )
        lines.append(f"<p class={state}>Missing on the consumer{allowed}:</p><ul>{items}</ul>")
    if report.copies_differing:
        items = "".join(
            f"<li>{_text(rid)} group {gid}: positions "
            f"{', '.join(str(p) for p in sorted({p for p, _, _ in copies}))}</li>"
            for rid, gid, copies in report.copies_differing
        )
        lines.append(
            f"<p class=failed>Consumer copies differ from the copy compared:</p><ul>{items}</ul>"
        )
    lines.extend(f"<p class=failed>{_text(text)}</p>" for text in report.incomplete)
    lines.extend(f"<p class=failed>{_text(text)}</p>" for text in report.scale_differences)
    if report.empty_reason:
        lines.append(f"<p class=failed>Nothing was compared: {_text(report.empty_reason)}</p>")
    return lines


def numeric_html(report: NumericReport, title: str) -> str:
    """The HTML page of a comparison by value, its heatmaps inline.

    Per request and group the page shows both heatmaps of the scaled error and the
    worst (layer, head) rows (over the tolerance first, then by scaled error).

    Args:
        report: The report drawn.
        title: The page's title and heading.

    Returns:
        The page's HTML text.

    """
    verdict = "ok" if report.ok else "failed"
    lines = [
        f'<p id="verdict" class="{verdict}">Verdict: <b>{verdict.upper()}</b>; '
        f'<span id="failed-slices">{report.failed_slices}</span> (layer, head) slices over '
        f"the tolerance |consumer - producer| &gt; atol + rtol |producer| with atol "
        f'<span id="atol">{fmt(report.atol)}</span>, rtol <span id="rtol">'
        f"{fmt(report.rtol)}</span>.</p>",
        _diagnosis(report),
        _legend(RATIO),
    ]
    for label, ids in (
        ("only on the producer", report.only_producer),
        ("only on the consumer", report.only_consumer),
    ):
        if ids:
            lines.append(f"<p class=failed>Requests {label}: {_text(', '.join(ids))}</p>")
    if report.not_compared:
        items = "".join(
            f"<li>{_text(rid)} group {gid}: {_text(reason)}</li>"
            for rid, gid, reason in report.not_compared
        )
        lines.append(f"<p class=failed>Not compared:</p><ul>{items}</ul>")
    lines.extend(_numeric_checks(report))
    sections = []
    for request in report.requests.values():
        for gid, group in sorted(request.groups.items()):
            worst = sorted(
                group.slices,
                key=lambda s: (
                    not s.failed,
                    -s.max_tolerance_ratio,
                    -s.scaled_error,
                    s.number,
                    s.head,
                ),
            )[:TABLE_ROWS]
            rows = "".join(_slice_row(request.request_id, gid, item) for item in worst)
            table = (
                "<table><tr><th>layer</th><th>head</th><th>error / tol.</th><th>max abs</th>"
                "<th>max rel</th>"
                "<th>max abs / max |p|</th><th>RMS</th><th>over tol.</th><th>NaN/Inf one side</th>"
                f"<th>worst tokens (abs error)</th></tr>{rows}</table>"
            )
            maps = _image(layer_head_errors(group)) + _image(
                layer_token_errors(group, request.num_tokens)
            )
            state = "failed" if group.failed else "ok"
            sections.append(
                f'<section data-request="{_text(request.request_id)}" data-group="{gid}">'
                f'<h2 class="{state}">Request {_text(request.request_id)}, group {gid} '
                f"({request.num_tokens} tokens)</h2>"
                f'<div class="group"><div>{maps}</div><div>{table}</div></div></section>'
            )
    return _page(title, "\n".join(lines), sections, "No request was compared.")


def _diff_groups(report: DiffReport) -> str:
    """Every request's groups in one table (compared, differing, missing, why not
    verified), then what else fails the report."""
    rows = []
    for request_id, gid, group in report.groups():
        state = "ok" if report.group_ok(group) else "failed"
        replicas = ", ".join(f"{n}:{r}" for n, r in group.replicas_differing)
        rows.append(
            f'<tr class="{state}"><td class="name">{_text(request_id)}</td><td>{gid}</td>'
            f"<td>{group.compared}</td><td>{len(group.mismatched_positions)}</td>"
            f"<td>{_text(replicas)}</td><td>{len(group.missing_positions)}</td>"
            f'<td class="name">{_text(group.unverified or "")}</td></tr>'
        )
    lines = []
    if rows:
        lines.append(
            "<table><tr><th>request</th><th>group</th><th>compared</th><th>differing</th>"
            "<th>replicas differing</th><th>missing</th><th>not verified because</th></tr>"
            f"{''.join(rows)}</table>"
        )
    if report.only_in_producer:
        ids = ", ".join(report.only_in_producer)
        lines.append(f"<p class=failed>Requests only on the producer: {_text(ids)}</p>")
    lines.extend(f"<p class=failed>{_text(text)}</p>" for text in report.scale_differences)
    if report.empty_reason is not None:
        lines.append(f"<p class=failed>Nothing was verified: {_text(report.empty_reason)}</p>")
    return "".join(lines)


def _diagnosis(report: DiffReport | NumericReport) -> str:
    """The findings of every failing group, a list item each, kind first."""
    found = diagnose_numeric(report) if isinstance(report, NumericReport) else diagnose(report)
    items = "".join(
        f'<li class="finding" data-request="{_text(rid)}" data-group="{gid}" '
        f'data-kind="{finding.kind}"><b>{_text(rid)} group {gid}: {_text(finding.title)}</b>: '
        f"{_text(finding.text)}</li>"
        for (rid, gid), findings in found.items()
        for finding in findings
    )
    return f'<ul id="diagnosis" class="failed">{items}</ul>' if items else ""


def diff_html(report: DiffReport, title: str) -> str:
    """The HTML page of a bitwise diff, its heatmaps inline.

    Per request and group with located differences the page shows both heatmaps of
    mismatch counts and the located entries.

    Args:
        report: The diff's report.
        title: Its title, written as the page's heading.

    Returns:
        A self-contained page: no script, nothing fetched.

    """
    verdict = "ok" if report.ok else "failed"
    summary = (
        f'<p id="verdict" class="{verdict}">Verdict: <b>{verdict.upper()}</b></p>'
        + _diagnosis(report)
        + _warnings(report.warnings)
        + _diff_groups(report)
    )
    sections = []
    pictures = located_heatmaps(report)
    for request_id, gid, group in report.groups():
        if (request_id, gid) not in pictures:
            continue
        by_head, by_token = pictures[request_id, gid]
        rows = "".join(
            f'<tr><td>{entry.position}</td><td class="name">{_text(entry.layer)}</td>'
            f"<td>{entry.head}</td><td>{entry.replica}</td>"
            f'<td class="tokens" data-count="{len(entry.tokens)}">'
            f"{run_text(runs(entry.tokens))} ({len(entry.tokens)})</td>"
            f"<td>{entry.first_byte}</td><td>{fmt(entry.max_abs_error)}</td>"
            f"<td>{fmt(entry.scaled_error)}</td></tr>"
            for entry in group.located
        )
        table = (
            "<table><tr><th>position</th><th>layer</th><th>head</th><th>replica</th>"
            "<th>tokens</th><th>first byte</th><th>max abs</th><th>scaled</th></tr>"
            f"{rows}</table>"
        )
        sections.append(
            f'<section data-request="{_text(request_id)}" data-group="{gid}">'
            f"<h2>Request {_text(request_id)}, group {gid}</h2>"
            f'<div class="group"><div>{_image(by_head)}{_image(by_token)}</div>'
            f"<div>{table}</div></div></section>"
        )
    return _page(title, summary + _legend("mismatches"), sections, "No located difference.")
