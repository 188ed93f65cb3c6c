"""One checksum line of an output folder decoded by the record's strict decoder
(``records.reading.request_line_from_json``), checked against what the folder says (the
worker folder it is in, the worker's earlier lines) and merged into its worker's
record."""

from __future__ import annotations

from ..records import GroupChecksums, RequestChecksums, WorkerInfo, WorkerRecord
from ..records.reading import RecordReader, RequestLine, request_line_from_json
from .layout import LINE_FORMATS


def check_line(
    reader: RecordReader, data: object, ranks: tuple[int, int], record: WorkerRecord | None
) -> RequestLine:
    """A checksum line, decoded as strictly as a record (every key, type, range and each
    group's positions against the tokens), in the folder of its worker's ranks, with the
    sizes and position numbering of the worker's earlier lines.

    Args:
        reader: The reader naming the file and line in its errors.
        data: The line's parsed JSON.
        ranks: ``(pp_rank, tp_rank)`` of the worker folder the line is in.
        record: The worker's record from its earlier lines (None: the first line).

    Returns:
        The decoded line.

    Raises:
        KvauditError: A key missing, unknown, of the wrong type or out of range, or a
            worker other than the folder's or its earlier lines'.

    """
    line = request_line_from_json(reader, data, LINE_FORMATS)
    worker = line.worker
    if (worker.pp_rank, worker.tp_rank) != ranks:
        reader.fail(
            "worker",
            f"pp_rank {worker.pp_rank}, tp_rank {worker.tp_rank}, but the line is in "
            f"the folder of pp{ranks[0]}-tp{ranks[1]}",
        )
    if record is not None:
        if line.positions != record.positions:
            reader.fail(
                "positions",
                f"{line.positions}, but the worker's earlier lines number positions by "
                f"{record.positions}",
            )
        for size in ("tp_size", "pp_size"):
            if getattr(worker, size) != getattr(record.worker, size):
                reader.fail(
                    f"worker.{size}",
                    f"{getattr(worker, size)}, but the worker's earlier lines give "
                    f"{getattr(record.worker, size)}",
                )
    return line


def merge_line(record: WorkerRecord | None, line: RequestLine, source: str) -> WorkerRecord:
    """``record`` with the line's request (a later line replaces an earlier one).

    Args:
        record: The worker's record so far (None: a new one is made).
        line: A line as ``check_line`` returns it.
        source: What the record names as its source (the worker's checksum file).

    Returns:
        The record, the line's request in it.

    """
    w = line.worker
    info = WorkerInfo(w.tp_rank, w.tp_size, w.pp_rank, w.pp_size, w.role, w.engine, source)
    if record is None:
        record = WorkerRecord(info, line.positions, {}, {}, {})
    elif record.worker.role != line.role:
        # A kv_both engine: its worker holds both roles; every replica counts as a consumer's.
        record.worker = WorkerInfo(**{**record.worker.__dict__, "role": "consumer"})
    record.positions = line.positions
    record.fingerprints.update(line.fingerprints)
    record.not_covered.update(line.not_covered)
    groups = {
        gid: GroupChecksums(
            group.block_size,
            group.start,
            group.replica_keys,
            group.values,
            record.fingerprints[gid],
            layer_sums=group.layer_sums,
            strong=group.strong,
        )
        for gid, group in line.groups.items()
    }
    record.requests[line.request] = RequestChecksums(line.num_tokens, groups)
    return record
