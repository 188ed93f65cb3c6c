"""The ``checksum`` tables: a record's checksums per request, group and position."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ..core.scheme import to_hex, valid_tokens
from ..records import Record
from .text import SafeTable, completeness, layout_line, print_missing, print_table, worker_name


def print_record(console: Console, record: Record) -> None:
    """Print the ``checksum`` tables of a record, one per request and group.

    Each table has a row per block position with its value under each replica key and
    the total; uncovered groups are listed with their reason.

    Args:
        console: Where the tables are printed.
        record: The record drawn.

    """
    workers = [summary.worker for summary in record.workers]
    console.print(
        Text.assemble(
            ("checksums", "bold"),
            f" of {layout_line(workers)}, positions numbered by {record.positions}, ",
            completeness(record.complete),
        )
    )
    if not record.complete:
        print_missing(console, record.missing_workers, "the values below are partial sums")
    reasons: dict[tuple[int, str], list[str]] = {}
    for summary in record.workers:
        for gid, reason in sorted(summary.not_covered.items()):
            reasons.setdefault((gid, reason), []).append(worker_name(summary.worker))
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
            table = SafeTable()
            table.add_column("position", justify="right")
            table.add_column("tokens", justify="right")
            for replicas, index in group.replica_keys:
                table.add_column(f"key {replicas}:{index}")
            table.add_column("total")
            totals = group.totals().tolist()
            positions = range(group.start, group.end)
            valid = valid_tokens(request.num_tokens, group.block_size, list(positions)).tolist()
            for i, row in enumerate(group.values.tolist()):
                table.add_row(
                    str(positions[i]),
                    str(valid[i]),
                    *(to_hex(value) for value in row),
                    Text(to_hex(totals[i]), style="bold"),
                )
            print_table(console, table)
