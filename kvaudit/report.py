"""What the command line shows: rich tables of an inventory, a record or a diff report,
their machine forms (JSON, CSV), what ``corrupt`` planted, and the progress bar of long
work."""

from __future__ import annotations

import csv
import io
import json
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from .compare import DiffReport, GroupComparison
from .records import Record, WorkerInfo
from .scheme import to_hex
from .sources import Inventory

INVENTORY_FORMAT = "kvaudit.inventory/1"
PLAIN_WIDTH = 160
"""Columns of table output written to a file or a pipe (rich's default there is 80)."""
JSON_INLINE_WIDTH = 72
"""The longest list JSON output keeps on one line."""
# Names print as they are: no rich markup ("[b]"), emoji codes (":x:") or highlighting.
_LITERAL = {"markup": False, "emoji": False, "highlight": False}
PROGRESS_DELAY_S = 0.5
"""Work shorter than this shows no progress bar."""
LOCATED_ROWS = 40
"""Located differences a table shows per request and group; JSON holds them all."""


def make_console() -> Console:
    """A console on stdout: plain and wide when stdout is not a terminal."""
    console = Console(**_LITERAL)
    if not console.is_terminal:
        console = Console(width=PLAIN_WIDTH, color_system=None, **_LITERAL)
    return console


def render_text(render: Callable[..., None], *args: object) -> str:
    """What ``render(console, *args)`` prints, as plain text."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=PLAIN_WIDTH, color_system=None, **_LITERAL)
    render(console, *args)
    return buffer.getvalue()


def json_text(value: object, level: int = 0) -> str:
    """Strict JSON (a NaN or infinity raises ``ValueError``) indented by two spaces, with
    each short list of plain values or lists on one line (``"replica_keys": [[1, 0]]``)
    and longer ones an item a line."""
    inner = "  " * (level + 1)
    close = "  " * level
    if isinstance(value, dict) and value:
        items = [
            f"{inner}{json.dumps(key)}: {json_text(item, level + 1)}" for key, item in value.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{close}}}"
    flat = json.dumps(value, separators=(", ", ": "), allow_nan=False)
    if isinstance(value, list) and (
        len(flat) > JSON_INLINE_WIDTH or any(isinstance(item, dict) for item in value)
    ):
        items = [inner + json_text(item, level + 1) for item in value]
        return "[\n" + ",\n".join(items) + f"\n{close}]"
    return flat


def human_bytes(count: int) -> str:
    """A byte count in B, KiB, MiB or GiB."""
    if count < 1024:
        return f"{count} B"
    value = count / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def ranges(positions: Iterable[int]) -> str:
    """Positions as sorted compact ranges: ``0-2, 5, 7-9``."""
    items = sorted(positions)
    parts = []
    first = 0
    for i in range(len(items)):
        if i + 1 == len(items) or items[i + 1] != items[i] + 1:
            parts.append(f"{items[first]}" if first == i else f"{items[first]}-{items[i]}")
            first = i + 1
    return ", ".join(parts)


def _worker_name(worker: WorkerInfo) -> str:
    """A worker in a table: its source, else its ranks."""
    return worker.source or f"pp{worker.pp_rank} tp{worker.tp_rank}"


def _layout_line(workers: list[WorkerInfo]) -> str:
    """``2 workers of TP 2 x PP 1``."""
    first = workers[0]
    return f"{_plural(len(workers), 'worker')} of TP {first.tp_size} x PP {first.pp_size}"


def _completeness(complete: bool) -> tuple[str, str]:
    """A set's ``complete`` or ``INCOMPLETE``, with its style."""
    return ("complete", "bold green") if complete else ("INCOMPLETE", "bold red")


def missing_workers_text(missing: list[tuple[int, int]]) -> str:
    """Missing workers as ``pp_rank 0 tp_rank 2, ...``."""
    return ", ".join(f"pp_rank {pp} tp_rank {tp}" for pp, tp in missing)


def _print_missing(console: Console, missing: list[tuple[int, int]], consequence: str) -> None:
    """The red line that names an incomplete set's missing workers."""
    console.print(
        Text(f"missing workers: {missing_workers_text(missing)}; {consequence}", style="red")
    )


def _table(title: str, columns: Sequence[str], rows: list[list[str | Text]]) -> Table:
    """A table of ``rows``, leaving out the columns no row fills (a record keeps less
    than a dump); a column name starting with ``>`` is right-justified."""
    filled = [k for k in range(len(columns)) if any(str(row[k]) for row in rows)]
    table = Table(title=title, title_justify="left")
    for k in filled:
        name = columns[k]
        table.add_column(name.lstrip(">"), justify="right" if name.startswith(">") else "left")
    for row in rows:
        table.add_row(*(row[k] for k in filled))
    return table


def print_inventory(console: Console, inventory: Inventory) -> None:
    """The ``inspect`` tables: workers, groups per worker, requests."""
    workers = [item.worker for item in inventory.workers]
    console.print(
        Text.assemble(
            (f"{inventory.kind}: ", "bold"),
            " ".join(inventory.sources),
            f" ({_layout_line(workers)}, ",
            _completeness(inventory.complete),
            ")",
        )
    )
    if not inventory.complete:
        _print_missing(console, inventory.missing_workers, "checksums of this set are partial")

    rows: list[list[str | Text]] = []
    for item in inventory.workers:
        worker = item.worker
        rows.append(
            [
                _worker_name(worker),
                f"{worker.tp_rank}/{worker.tp_size}",
                f"{worker.pp_rank}/{worker.pp_size}",
                worker.role,
                worker.engine,
                "" if item.rows is None else str(item.rows),
            ]
        )
    console.print(_table("Workers", ("source", "tp", "pp", "role", "engine", ">rows"), rows))

    rows = []
    for item in inventory.workers:
        for group in item.groups:
            block = ""
            if group.block_size is not None:
                block = str(group.block_size)
                if group.kernel_block_size not in (None, group.block_size):
                    block += f" ({group.kernel_block_size})"
            rows.append(
                [
                    _worker_name(item.worker),
                    str(group.id),
                    group.type or "",
                    block,
                    group.layout or "",
                    "" if group.layers is None else str(group.layers),
                    "" if group.bytes is None else human_bytes(group.bytes),
                    to_hex(group.fingerprint),
                    Text("yes", style="green")
                    if group.covered
                    else Text(f"no: {group.reason}", style="yellow"),
                ]
            )
    columns = ("worker", ">group", "type", "block", "layout", ">layers", ">bytes")
    console.print(_table("Groups", (*columns, "fingerprint", "covered"), rows))

    group_ids = sorted({gid for req in inventory.requests.values() for gid in req.positions})
    table = Table(title="Requests", title_justify="left")
    table.add_column("request")
    table.add_column("tokens", justify="right")
    for gid in group_ids:
        table.add_column(f"group {gid} blocks")
    for request_id, request in inventory.requests.items():
        cells = []
        for gid in group_ids:
            held = request.positions.get(gid)
            cells.append(f"{len(held)} ({ranges(held)})" if held else "-")
        table.add_row(request_id, str(request.num_tokens), *cells)
    console.print(table)


def inventory_to_json(inventory: Inventory) -> dict:
    """The ``inspect --format json`` form of an inventory."""
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


def print_record(console: Console, record: Record) -> None:
    """The ``checksum`` tables: one per request and group, a row per block position with
    its value under each replica key and the total; uncovered groups with their reason."""
    workers = [summary.worker for summary in record.workers]
    console.print(
        Text.assemble(
            ("checksums", "bold"),
            f" of {_layout_line(workers)}, positions numbered by {record.positions}, ",
            _completeness(record.complete),
        )
    )
    if not record.complete:
        _print_missing(console, record.missing_workers, "the values below are partial sums")
    reasons: dict[tuple[int, str], list[str]] = {}
    for summary in record.workers:
        for gid, reason in sorted(summary.not_covered.items()):
            reasons.setdefault((gid, reason), []).append(_worker_name(summary.worker))
    for (gid, reason), names in sorted(reasons.items()):
        console.print(
            Text(f"group {gid} not covered on {', '.join(names)}: {reason}", style="yellow")
        )
    if not record.requests:
        console.print("no requests")
    for request_id, request in record.requests.items():
        if not request.groups:
            console.print(
                Text.assemble(
                    (request_id, "bold"), f" ({request.num_tokens} tokens): no covered group"
                )
            )
        for gid in sorted(request.groups):
            group = request.groups[gid]
            console.print(
                Text.assemble(
                    (request_id, "bold"),
                    f" ({request.num_tokens} tokens), group {gid}: block size "
                    f"{group.block_size}, fingerprint {to_hex(group.fingerprint)}",
                )
            )
            table = Table()
            table.add_column("position", justify="right")
            table.add_column("tokens", justify="right")
            for replicas, index in group.replica_keys:
                table.add_column(f"key {replicas}:{index}")
            table.add_column("total")
            totals = group.totals().tolist()
            for i, row in enumerate(group.values.tolist()):
                position = group.start + i
                first = position * group.block_size
                valid = min(group.block_size, max(0, request.num_tokens - first))
                table.add_row(
                    str(position),
                    str(valid),
                    *(to_hex(value) for value in row),
                    Text(to_hex(totals[i]), style="bold"),
                )
            console.print(table)


def record_csv(record: Record) -> str:
    """The ``checksum --format csv`` text of a record."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows(record.to_csv_rows())
    return buffer.getvalue()


@contextmanager
def progress_bar(total: int, description: str, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A callback ``advance(n_bytes)`` (bytes done since the last call) that drives a
    transient progress bar on stderr.

    The bar appears only when ``enabled``, stderr is a terminal and the work is still
    running after ``PROGRESS_DELAY_S``: short work prints nothing.
    """
    console = Console(stderr=True)
    if not enabled or not console.is_terminal or total <= 0:
        yield lambda done: None
        return
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = progress.add_task(description, total=total)
    lock = threading.Lock()
    shown = closed = False

    def show() -> None:
        nonlocal shown
        with lock:
            if not closed:
                progress.start()
                shown = True

    # A timer, not the first callback, so the bar shows while a long first batch runs.
    timer = threading.Timer(PROGRESS_DELAY_S, show)
    timer.daemon = True
    timer.start()
    try:
        yield lambda n_bytes: progress.advance(task, n_bytes)
    finally:
        timer.cancel()
        with lock:
            closed = True
            if shown:
                progress.stop()


# Diff reports.


def diff_json_text(report: DiffReport) -> str:
    """The ``--format json`` text of a diff report (non-finite errors as null)."""
    return json_text(report.to_json()) + "\n"


@dataclass(frozen=True)
class Sides:
    """What a report's two sides are called: the side that plays the producer, the one
    that plays the consumer, and what a compared block is (``compared``, ``checked``)."""

    producer: str = "producer"
    consumer: str = "consumer"
    compared: str = "compared"


DIFF_SIDES = Sides()


def _plural(count: int, noun: str) -> str:
    """``1 block``, ``2 blocks``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def diff_verdict(report: DiffReport, sides: Sides = DIFF_SIDES) -> str:
    """One line: ``OK: ...`` when the report is ok, else ``MISMATCH: ...`` (blocks,
    replicas or requests differ or are missing) or ``UNVERIFIED: ...`` (only groups that
    could not be compared)."""
    groups = [group for _, _, group in report.groups()]
    requests = len(report.requests)
    blocks = sum(group.compared for group in groups)
    differing = sum(len(group.mismatched_positions) for group in groups)
    replicas = sum(len(group.replica_mismatches) for group in groups)
    unverified = sum(1 for group in groups if group.unverified is not None)
    requests_differing = sum(
        1
        for groups_of in report.requests.values()
        if any(
            group.mismatched_positions or group.replicas_differing for group in groups_of.values()
        )
    )
    scope = f"{_plural(requests, 'request')}, {_plural(blocks, 'block')} {sides.compared}"
    if report.ok:
        extra = ""
        if report.only_in_consumer:
            extra = (
                f" ({_plural(len(report.only_in_consumer), 'request')} on the "
                f"{sides.consumer} only, not compared)"
            )
        return f"OK: {scope}, all match{extra}"
    parts = []
    if differing:
        parts.append(
            f"{differing} of {_plural(blocks, 'block')} {sides.compared} differ, in "
            f"{requests_differing} of {_plural(requests, 'request')}"
        )
    if replicas:
        parts.append(f"{_plural(replicas, 'replica block')} differ from replica 0")
    if report.only_in_producer:
        parts.append(
            f"{_plural(len(report.only_in_producer), 'request')} missing on the {sides.consumer}"
        )
    if unverified:
        parts.append(f"{_plural(unverified, 'group')} could not be verified")
    if differing or replicas or report.only_in_producer:
        return "MISMATCH: " + "; ".join(parts)
    return f"UNVERIFIED: {scope}; " + "; ".join(parts)


def _result_cell(group: GroupComparison) -> Text:
    """A group's result in the diff table: unverified and why, MISMATCH or ok."""
    if group.unverified is not None:
        return Text(f"unverified: {group.unverified}", style="yellow")
    if group.mismatched_positions or group.replicas_differing:
        return Text("MISMATCH", style="bold red")
    return Text("ok", style="green")


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


def error_text(value: float) -> str:
    """A located error for a table: 4 significant digits, ``inf`` or ``nan``."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    return f"{value:.4g}"


def print_diff(
    console: Console, report: DiffReport, *, title: str | None = None, sides: Sides = DIFF_SIDES
) -> None:
    """The ``diff`` and ``verify`` tables: a row per request and group (blocks compared,
    blocks and replicas that differ, the result or why it could not be compared), the
    verdict line, the requests only one side holds, and the located differences."""
    if title:
        console.print(Text(title, style="bold"), soft_wrap=True)
    table = Table(title=None)
    for name, justify in (
        ("request", "left"),
        ("group", "right"),
        ("block", "right"),
        (sides.compared, "right"),
        ("differing positions", "left"),
        ("replicas differing", "left"),
        ("result", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for request_id, groups in report.requests.items():
        if not groups:
            table.add_row(request_id, "-", "", "0", "", "", Text("no group to compare", "yellow"))
        for gid in sorted(groups):
            group = groups[gid]
            mismatched = group.mismatched_positions
            table.add_row(
                request_id,
                str(gid),
                str(group.block_size) if group.block_size else "",
                str(group.compared),
                f"{len(mismatched)}: {ranges(mismatched)}" if mismatched else "-",
                _replica_text(group.replica_mismatches) if group.replica_mismatches else "-",
                _result_cell(group),
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
    _print_located(console, report)


def _print_located(console: Console, report: DiffReport) -> None:
    """The located differences table, at most ``LOCATED_ROWS`` per request and group."""
    rows: list[list[str]] = []
    for request_id, gid, group in report.groups():
        for item in group.located[:LOCATED_ROWS]:
            replica = item.get("replica")
            rows.append(
                [
                    request_id,
                    str(gid),
                    str(item["position"]),
                    str(item["layer"]),
                    str(item["head"]),
                    "" if replica is None else str(replica),
                    ranges(item["tokens"]),
                    str(item["first_byte"]),
                    error_text(item["max_abs_error"]),
                    error_text(item["max_rel_error"]),
                ]
            )
        hidden = len(group.located) - LOCATED_ROWS
        if hidden > 0:
            more = f"... {hidden} more (--format json lists all)"
            rows.append([request_id, str(gid), "", more, "", "", "", "", "", ""])
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
        ">max rel error",
    )
    console.print(Text("Located differences", style="bold"))
    console.print(_table("", columns, rows))


def print_corrupted(console: Console, result: dict) -> None:
    """What ``corrupt`` planted: where, which layers, heads and tokens, which bytes."""
    console.print(
        Text.assemble(
            ("planted ", "bold"),
            (result["mode"], "bold red"),
            f" in {result['out']} (a copy of {result['source']})",
        )
    )
    lines = [
        f"request {result['request']}, group {result['group']}, position {result['position']} "
        f"(engine block {result['block']}, dump row {result['row']}, "
        f"request of {result['num_tokens']} tokens)",
        "layers: " + ", ".join(result["layers"]),
        f"heads: {ranges(result['heads'])}",
        f"tokens: {ranges(result['tokens'])}",
    ]
    origin = result.get("from")
    if origin is not None:
        if origin.get("request") is not None:
            lines.append(
                f"from: request {origin['request']} position {origin['position']} "
                f"(engine block {origin['block']}, dump row {origin['row']})"
            )
        else:
            lines.append(f"from: engine block {origin['block']} (dump row {origin['row']})")
    flip = result.get("flip")
    if flip is not None:
        lines.append(
            f"flipped: bit {flip['bit']} of byte {flip['byte']} of the cell of "
            f"{flip['layer']} head {flip['head']} token {flip['token']}"
        )
    swap = result.get("swap")
    if swap is not None:
        noun = "tokens" if "tokens" in swap else "heads"
        first, second = swap[noun]
        lines.append(f"swapped: {noun} {first} and {second} of {swap['layer']}")
    changed = sum(end - start for start, end in result["byte_ranges"])
    lines.append(
        f"bytes changed: {changed} in {_plural(len(result['byte_ranges']), 'range')} of the file"
    )
    for line in lines:
        console.print("  " + line)
