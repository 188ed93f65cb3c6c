"""What the command line shows: rich tables of an inventory or a record, their machine
forms (JSON, CSV), and the progress bar of long work."""

from __future__ import annotations

import csv
import io
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

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
    """JSON indented by two spaces, with each short list of plain values or lists on one
    line (``"replica_keys": [[1, 0]]``) and longer ones an item a line."""
    inner = "  " * (level + 1)
    close = "  " * level
    if isinstance(value, dict) and value:
        items = [
            f"{inner}{json.dumps(key)}: {json_text(item, level + 1)}" for key, item in value.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{close}}}"
    flat = json.dumps(value, separators=(", ", ": "))
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
    return worker.source or f"pp{worker.pp_rank} tp{worker.tp_rank}"


def _layout_line(workers: list[WorkerInfo]) -> str:
    first = workers[0]
    count = len(workers)
    noun = "worker" if count == 1 else "workers"
    return f"{count} {noun} of TP {first.tp_size} x PP {first.pp_size}"


def _missing_text(missing: list[tuple[int, int]]) -> str:
    return ", ".join(f"pp_rank {pp} tp_rank {tp}" for pp, tp in missing)


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
    state = "complete" if inventory.complete else "INCOMPLETE"
    console.print(
        Text.assemble(
            (f"{inventory.kind}: ", "bold"),
            " ".join(inventory.sources),
            f" ({_layout_line(workers)}, ",
            (state, "bold green" if inventory.complete else "bold red"),
            ")",
        )
    )
    if not inventory.complete:
        console.print(
            Text(
                f"missing workers: {_missing_text(inventory.missing_workers)}; "
                "checksums of this set are partial",
                style="red",
            )
        )

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
    state = "complete" if record.complete else "INCOMPLETE"
    console.print(
        Text.assemble(
            ("checksums", "bold"),
            f" of {_layout_line(workers)}, positions numbered by {record.positions}, ",
            (state, "bold green" if record.complete else "bold red"),
        )
    )
    if not record.complete:
        console.print(
            Text(
                f"missing workers: {_missing_text(record.missing_workers)}; "
                "the values below are partial sums",
                style="red",
            )
        )
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
                    (f"{request_id}", "bold"),
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
