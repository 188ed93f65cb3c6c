"""Reading an output folder back as one record: each line decoded by the record's strict
decoder (``records.reading``), as strictly as a record file; a torn line skipped and
counted."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import KvauditError
from ..core.files import check_input
from ..core.validation import (
    MAX_DEPTH,
    DuplicateKeyError,
    check_plain,
    load_json,
    short,
    short_text,
    unique_keys,
)
from ..records import Record, WorkerRecord, combine_workers
from ..records.reading import RecordReader
from .layout import (
    CHECKSUMS,
    DESCRIPTION,
    FORMAT,
    LEGACY_FORMAT,
    LEGACY_MARKER,
    MARKER,
    ROTATED,
)
from .lines import check_line, merge_line

# Reading the folder back, as strictly as a record file: the marker's content, every
# checksum line's keys, types and ranges (the record reader's checks), lines of bounded
# length, regular files only (a FIFO or a device would block or never end). A torn line,
# the start of a line whose write a crash or a full disk cut short, is skipped and
# counted, never a reason to lose the folder's other requests: the last line when it has
# no newline and does not parse, or any line that ends before its JSON does (the writer
# starts a new line after a torn one).

MAX_LINE_BYTES = 64 << 20
"""The longest checksum line read (64 MiB: a request of about 3 million block positions
under one replica key)."""
MAX_MARKER_BYTES = 64 << 10
"""The largest marker file read."""

_WORKER_DIR = re.compile(r"pp(0|[1-9][0-9]{0,8})-tp(0|[1-9][0-9]{0,8})")


# What may end a line cut short: the start of a number or of true, false or null.
_PARTIAL_TOKEN = re.compile(
    r"-?[0-9]*\.?[0-9]*(?:[eE][+-]?[0-9]*)?|t(?:r(?:ue?)?)?|f(?:a(?:l(?:se?)?)?)?|n(?:u(?:ll?)?)?"
)


@dataclass
class OutputFolder:
    """An output folder read back: the engine's record, each request's prompt digest
    (where its lines give one: ``output.prompt_digest``), in order of first appearance,
    and the torn lines skipped (``FILE: line N`` each)."""

    path: str
    engine: str
    record: Record
    prompts: dict[str, str] = field(default_factory=dict)
    torn: list[str] = field(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        """What a command warns about on reading the folder: the torn lines skipped."""
        if not self.torn:
            return []
        shown = ", ".join(self.torn[:3]) + (
            f" and {len(self.torn) - 3} more" if len(self.torn) > 3 else ""
        )
        lines = "line" if len(self.torn) == 1 else "lines"
        return [
            f"{self.path}: {len(self.torn)} torn {lines} skipped (a write cut short by a "
            f"crash or a full disk): {shown}"
        ]


def read_output(path: str | os.PathLike[str], role: str | None = None) -> OutputFolder:
    """The output folder: every worker's latest checksums of each audited request (of
    ``role`` only, when given), summed over workers.

    A worker's files are read oldest first (``checksums.N.jsonl`` from the highest N, then
    ``checksums.jsonl``): a later line of a request and role replaces an earlier one.

    Args:
        path: The folder.
        role: ``producer`` or ``consumer`` to read only those lines; None for all.

    Returns:
        The folder's record, prompts and torn lines.

    Raises:
        KvauditError: No marker or a marker that is not the format's, a file that is not
            a regular file (a FIFO, a device, a directory), no worker with checksums, or a
            line that is not what the writer writes (not UTF-8, not JSON, nested too
            deeply, longer than ``MAX_LINE_BYTES``, a key missing, unknown or out of
            range); the message names the file and line.

    """
    folder = Path(path)
    engine = _read_marker(folder)
    workers = _worker_folders(folder)
    prompts: dict[str, str] = {}
    where: dict[str, str] = {}
    torn: list[str] = []
    records = []
    for ranks, worker_path in workers:
        record = _read_worker(worker_path, ranks, role, prompts, where, torn)
        if record is not None:
            records.append(record)
    if not records:
        raise KvauditError("no audited request has been written yet", str(folder))
    try:
        combined = combine_workers(records)
    except KvauditError as error:
        raise KvauditError(error.message, error.source or str(folder)) from None
    kept = {rid: prompts[rid] for rid in combined.requests if rid in prompts}
    return OutputFolder(str(folder), engine, combined, kept, torn)


def _read_marker(folder: Path) -> str:
    """The engine the folder's marker names ("" where a legacy marker names none).

    Raises:
        KvauditError: No marker, or one that is not a small regular file holding the
            format's JSON object.

    """
    name = MARKER if os.path.lexists(folder / MARKER) else LEGACY_MARKER
    marker = folder / name
    if not os.path.lexists(marker):
        raise KvauditError(f"not a kvaudit output folder (no {MARKER})", str(folder))
    source = str(marker)
    check_input(marker)  # a FIFO or a device would block or never end
    try:
        with open(marker, "rb") as file:
            data = file.read(MAX_MARKER_BYTES + 1)
    except OSError as error:
        raise KvauditError(f"cannot read: {error.strerror or error}", source) from None
    if len(data) > MAX_MARKER_BYTES:
        raise KvauditError(f"larger than the {MAX_MARKER_BYTES} bytes of a marker", source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KvauditError("not UTF-8 text, expected the marker's JSON", source) from None
    content = load_json(text, source, "marker")
    reader = RecordReader(source)
    reader.keys(content, "", ("format",), ("engine",))
    expected = FORMAT if name == MARKER else LEGACY_FORMAT
    if content["format"] != expected:
        reader.fail("format", f"expected {expected!r}, {reader.got(content['format'])}")
    return reader.string(content.get("engine", ""), "engine")


def _listing(path: Path) -> list[os.DirEntry[str]]:
    """A folder's entries, sorted by name.

    Raises:
        KvauditError: It cannot be listed (not a folder, no permission).

    """
    try:
        with os.scandir(path) as entries:
            return sorted(entries, key=lambda entry: entry.name)
    except NotADirectoryError:
        raise KvauditError("is not a folder", str(path)) from None
    except OSError as error:
        raise KvauditError(f"cannot list: {error.strerror or error}", str(path)) from None


def _worker_folders(folder: Path) -> list[tuple[tuple[int, int], Path]]:
    """Each worker's folder (``workers/pp{P}-tp{T}``) with its ``(pp_rank, tp_rank)``, in
    rank order."""
    workers = folder / "workers"
    if not os.path.lexists(workers):
        return []
    check_input(workers, directory=True)
    found = []
    for entry in _listing(workers):
        match = _WORKER_DIR.fullmatch(entry.name)
        if match is None:
            continue
        check_input(entry.path, directory=True)
        if not entry.is_dir():
            raise KvauditError("is not a folder, expected a worker's folder", entry.path)
        found.append(((int(match.group(1)), int(match.group(2))), Path(entry.path)))
    return sorted(found, key=lambda item: item[0])


def checksum_files(worker: Path) -> list[Path]:
    """A worker's checksum files, oldest first: the rotated ones from the highest number,
    then ``checksums.jsonl``.

    Raises:
        KvauditError: The folder cannot be listed.

    """
    rotated = []
    current = None
    for entry in _listing(worker):
        match = ROTATED.fullmatch(entry.name)
        if match is not None:
            rotated.append((int(match.group(1)), Path(entry.path)))
        elif entry.name == CHECKSUMS:
            current = Path(entry.path)
    files = [path for _, path in sorted(rotated, reverse=True)]
    return files + ([current] if current is not None else [])


def _read_worker(
    worker: Path,
    ranks: tuple[int, int],
    role: str | None,
    prompts: dict[str, str],
    where: dict[str, str],
    torn: list[str],
) -> WorkerRecord | None:
    """One worker's record from its files' lines (None: no line of ``role``); the
    requests' prompt digests go to ``prompts`` (``where``: the line that gave each), the
    torn lines skipped to ``torn``."""
    record: WorkerRecord | None = None
    source = str(worker / CHECKSUMS)
    for path in checksum_files(worker):
        check_input(path)  # a FIFO or a device would block or never end
        for number, data in _lines(path):
            place = f"{path}: line {number}"
            if data is None:
                torn.append(place)
                continue
            line = check_line(RecordReader(place), data, ranks, record)
            prompt = line.prompt
            if prompt is not None:
                request = line.request
                seen = prompts.setdefault(request, prompt)
                if seen != prompt:
                    raise KvauditError(
                        f"request {short(request)}: prompt {prompt}, but {where[request]} "
                        f"gives {seen}: the lines of one request give one prompt",
                        place,
                    )
                where.setdefault(request, place)
            if role is not None and line.role != role:
                continue
            record = merge_line(record, line, source)
    described = worker / DESCRIPTION
    if record is not None and described.exists():
        # The worker's description (written before its first line): its layers' facts,
        # scales included, which the checksum lines do not repeat.
        from ..description import load_description
        from ..records.layers import layer_facts

        record.layers = layer_facts(load_description(described))
    return record


def _lines(path: Path) -> Iterator[tuple[int, Any]]:
    """Each non-blank line's number and parsed JSON (None: a torn line).

    Raises:
        KvauditError: A line too long, not UTF-8, not JSON or nested too deeply; the
            message names the file and line.

    """
    try:
        file = open(path, "rb")  # noqa: SIM115 (closed below, after the last line)
    except OSError as error:
        raise KvauditError(f"cannot read: {error.strerror or error}", str(path)) from None
    with file:
        number = 0
        while True:
            try:
                raw = file.readline(MAX_LINE_BYTES + 1)
            except OSError as error:
                raise KvauditError(
                    f"line {number + 1}: cannot read: {error.strerror or error}", str(path)
                ) from None
            if not raw:
                return
            number += 1
            ended = raw.endswith(b"\n")
            if not ended and len(raw) > MAX_LINE_BYTES:
                raise KvauditError(
                    f"line {number}: longer than the {MAX_LINE_BYTES} bytes of a checksum line",
                    str(path),
                )
            # A crash can leave zeros past what was written (a file extended, never filled).
            body = raw.rstrip(b"\r\n").rstrip(b"\x00").strip()
            if not body:
                if raw.strip():  # zeros only: what a cut write left
                    yield number, None
                continue
            yield number, _parse(body, ended, f"{path}: line {number}")


def _parse(body: bytes, ended: bool, place: str) -> Any:
    """A line's JSON (None when torn: cut short, or the last line, without a newline,
    unparsable).

    Raises:
        KvauditError: Not UTF-8, not JSON, nested too deeply, a key twice.

    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        if not ended:
            return None
        raise KvauditError(
            f"not UTF-8 text (byte {error.start}), expected a checksum line", place
        ) from None
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
    except RecursionError:
        raise KvauditError(f"nested more than {MAX_DEPTH} levels deep", place) from None
    except DuplicateKeyError as error:
        raise KvauditError(f"key {short(error.key)} appears twice in one object", place) from None
    except json.JSONDecodeError as error:
        if not ended or cut_short(text, error):
            return None
        raise KvauditError(f"not a checksum line (not JSON: {error})", place) from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise KvauditError(f"not a checksum line ({short_text(str(error))})", place) from None
    check_plain(data, place)
    return data


def cut_short(text: str, error: json.JSONDecodeError) -> bool:
    """Whether JSON ``text`` fails only because it ends too early (the start of a valid
    text: a write cut short), as the parser's ``error`` shows."""
    rest = text[error.pos :]
    if error.msg.startswith("Unterminated string"):
        return True
    if error.msg.startswith("Invalid \\uXXXX escape"):
        return re.fullmatch(r"\\?u[0-9a-fA-F]{0,4}", rest) is not None
    if error.msg.startswith("Invalid \\escape") or error.msg.startswith("Invalid control"):
        return False
    return rest == "" or (
        error.msg.startswith("Expecting") and _PARTIAL_TOKEN.fullmatch(rest) is not None
    )


def read_output_folder(path: str | os.PathLike[str], role: str | None = None) -> Record:
    """The engine's record: every worker's latest checksums of each audited request (of
    ``role`` only, when given), summed over workers (``read_output``'s record).

    Raises:
        KvauditError: As ``read_output`` raises it.

    """
    return read_output(path, role).record
