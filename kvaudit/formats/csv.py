"""The CSV form of a record (``checksum --format csv``, docs/cli.md)."""

from __future__ import annotations

import csv
import io

from ..core.scheme import to_hex
from ..records import Record

CSV_HEADER = ("request", "group", "position", "replica_key", "value")


def record_csv_rows(record: Record) -> list[list[str]]:
    """The CSV rows of a record: a header, then the values of every position.

    Per request, group and position there is one row per replica key and a ``total``
    row; values are written in hex.

    Args:
        record: The record written.

    Returns:
        The rows, ``CSV_HEADER`` first.

    """
    rows = [list(CSV_HEADER)]
    for request_id, request in record.requests.items():
        for gid in sorted(request.groups):
            group = request.groups[gid]
            keys = [f"{replicas}:{index}" for replicas, index in group.replica_keys]
            values = group.values.tolist()
            totals = group.totals().tolist()
            for i, row in enumerate(values):
                position = str(group.start + i)
                for key, value in zip(keys, row, strict=True):
                    rows.append([request_id, str(gid), position, key, to_hex(value)])
                rows.append([request_id, str(gid), position, "total", to_hex(totals[i])])
    return rows


def record_csv(record: Record) -> str:
    """The ``checksum --format csv`` text of a record.

    Args:
        record: The record written.

    Returns:
        The rows of ``record_csv_rows``, one a line.

    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows(record_csv_rows(record))
    return buffer.getvalue()
