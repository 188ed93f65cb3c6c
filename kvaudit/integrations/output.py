"""An in-engine audit's output folder (kvaudit's vLLM connector, its SGLang hooks): the
engine's cache descriptions, every audited request's per-worker checksums (appended as
JSON lines) and its dumps; read back as one record.

Layout (docs/vllm.md, docs/sglang.md)::

    OUTPUT/kvaudit-output.json                  marks the folder (the engine that wrote it)
    OUTPUT/cache.yaml                           the description (one PP stage: TP rank 0's)
    OUTPUT/workers/pp{P}-tp{T}/cache.yaml       each worker's description
    OUTPUT/workers/pp{P}-tp{T}/checksums.jsonl  one line per audited request
    OUTPUT/workers/pp{P}-tp{T}/checksums.{N}.jsonl   the same, rotated (N = 1 the newest)
    OUTPUT/dumps/{request}/pp{P}-tp{T}.safetensors   a dump set per dumped request

This module imports no engine: ``kvaudit`` reads the folder anywhere (``read_output``,
as strictly as a record file; a torn line skipped and counted). Folders written before
the format was shared (marked ``kvaudit-vllm.json``, lines ``kvaudit.vllm-checksums/1``)
are read as well.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import KvauditError
from ..core.files import atomic_path, check_input
from ..core.scheme import to_hex
from ..core.validation import (
    MAX_DEPTH,
    MAX_TOKENS,
    MAX_WORKERS,
    POSITION_NUMBERINGS,
    DuplicateKeyError,
    check_plain,
    check_positions,
    join,
    load_json,
    short,
    short_text,
    unique_keys,
)
from ..records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    combine_workers,
)
from ..records.reading import RecordReader, group_span, group_values, item_path

MARKER = "kvaudit-output.json"
FORMAT = "kvaudit.engine-output/1"
LINE_FORMAT = "kvaudit.engine-checksums/1"
LEGACY_MARKER = "kvaudit-vllm.json"
"""The marker of folders the vLLM connector wrote before the format was shared."""
LEGACY_FORMAT = "kvaudit.vllm-output/1"
"""The format the legacy marker names."""
LINE_FORMATS = (LINE_FORMAT, "kvaudit.vllm-checksums/1")
CHECKSUMS = "checksums.jsonl"
"""A worker's checksum lines; rotated ones are ``checksums.{N}.jsonl``, N = 1 the newest."""
MAX_CHECKSUM_BYTES = 64 << 20
"""The default size ``checksums.jsonl`` grows to before it is rotated (64 MiB: about
20,000 requests of 2,048 tokens per worker)."""
KEEP_CHECKSUM_FILES = 3
"""The default number of rotated checksum files kept: with ``MAX_CHECKSUM_BYTES``, a
worker's checksums take at most 256 MiB."""


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A request's prompt as 16 hex digits: the first 64 bits of the SHA-256 of its token
    ids as little-endian int64, by which ``kvaudit diff`` pairs the requests that two
    engines name differently (docs/vllm.md, "Diffing the two engines' output").

    Args:
        token_ids: The prompt's token ids.

    Returns:
        16 lowercase hex digits.

    Raises:
        ValueError: A token id that is not an integer of 64 bits.

    """
    array = np.asarray(token_ids)
    if array.size == 0:
        array = np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError("expected a sequence of integer token ids (64 bits each)")
    if array.dtype == np.uint64 and (array >> np.uint64(63)).any():
        raise ValueError("a token id does not fit in a signed 64-bit integer")
    data = array.astype("<i8")
    return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def worker_folder(output: str | os.PathLike[str], pp_rank: int, tp_rank: int) -> Path:
    """The folder of one worker's description and checksums."""
    return Path(output) / "workers" / f"pp{pp_rank}-tp{tp_rank}"


def dump_path(output: str | os.PathLike[str], request: str, pp_rank: int, tp_rank: int) -> Path:
    """Where a worker dumps one request's blocks (one dump set per request folder)."""
    return Path(output) / "dumps" / _safe_name(request) / f"pp{pp_rank}-tp{tp_rank}.safetensors"


def block_bytes(tensors: Mapping[str, Any], num_blocks: int) -> int:
    """The bytes one block holds over every layer's tensors (what a dump writes per
    block): each tensor's bytes over the ``num_blocks`` blocks it holds."""
    total = 0
    for tensor in tensors.values():
        for part in tensor if isinstance(tensor, tuple) else (tensor,):
            total += part.numel() * part.element_size() // max(1, num_blocks)
    return total


class DumpBudget:
    """The bytes of dumps one worker may keep (``limit``), and its rotating dumps, which
    are removed oldest first to make room for new ones.

    It counts what is on disk: every dump written, at its path, until the budget removes
    it; a dump that rewrites a path replaces the old file's bytes only once written (a
    rewrite refused, or one whose write failed, leaves the old file counted).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._sizes: dict[Path, int] = {}
        self._rotating: deque[Path] = deque()

    def admits(self, path: Path, size: int, *, rotating: bool) -> bool:
        """Whether a dump of ``size`` bytes at ``path`` fits (``rotating``: after removing
        this worker's oldest rotating dumps as needed). A dump that could never fit
        removes nothing; one that rewrites ``path`` counts in place of the old file."""
        if size <= 0 or size > self.limit:
            return False
        old = self._sizes.get(path, 0)
        while rotating and self.used - old + size > self.limit:
            oldest = next((entry for entry in self._rotating if entry != path), None)
            if oldest is None:
                break
            self._rotating.remove(oldest)
            self.used -= self._sizes.pop(oldest)
            oldest.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # other workers' dumps are still in it
                oldest.parent.rmdir()
        return self.used - old + size <= self.limit

    def written(self, path: Path, size: int, *, rotating: bool) -> None:
        """Count a dump written at ``path`` (in place of a file it replaced; a rotating one
        may be removed later, the newest last)."""
        self.used += size - self._sizes.get(path, 0)
        self._sizes[path] = size
        if path in self._rotating:
            self._rotating.remove(path)
        if rotating:
            self._rotating.append(path)


def _safe_name(request: str) -> str:
    """A request id as one folder name (path separators and dots at the start replaced)."""
    name = re.sub(r"[/\\\x00]", "_", request)
    return "_" + name[1:] if name.startswith(".") or not name else name


def _write_whole(path: Path, data: bytes) -> None:
    with atomic_path(path) as temporary, open(temporary, "wb") as file:
        file.write(data)


def is_output_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an in-engine audit's output folder: it holds a marker (whatever
    the marker is: the reader says what is wrong with it)."""
    return any(os.path.lexists(Path(path) / name) for name in (MARKER, LEGACY_MARKER))


def write_description(
    output: str | os.PathLike[str],
    description: Mapping[str, Any],
    worker: WorkerInfo,
    engine: str = "vllm",
) -> None:
    """Write the worker's ``cache.yaml`` (and the folder's, for TP rank 0 of a one-stage
    engine), and mark the folder as written by ``engine`` (``vllm``, ``sglang``)."""
    folder = worker_folder(output, worker.pp_rank, worker.tp_rank)
    folder.mkdir(parents=True, exist_ok=True)
    import yaml  # only the connector writes YAML; readers of the folder never import it

    text = yaml.safe_dump(dict(description), sort_keys=False).encode("utf-8")
    _write_whole(folder / "cache.yaml", text)
    if worker.pp_size == 1 and worker.tp_rank == 0:
        _write_whole(Path(output) / "cache.yaml", text)
    marker = json.dumps({"format": FORMAT, "engine": engine}).encode("utf-8")
    _write_whole(Path(output) / MARKER, marker)


def checksum_line(
    record: WorkerRecord,
    checksums: RequestChecksums,
    request: str,
    role: str,
    prompt: str | None = None,
) -> str:
    """One request's checksums of a worker's record, as one JSON line under ``request``.

    Args:
        record: The worker's record (its ranks, numbering, fingerprints).
        checksums: The request's checksums in that record.
        request: The name the line gives the request.
        role: ``producer`` or ``consumer``.
        prompt: The request's ``prompt_digest``, written as ``"prompt"`` when given: what
            pairs requests that two engines name differently.

    Returns:
        The line, without a newline (ASCII: JSON escapes the rest).

    """
    worker = record.worker
    groups = {
        str(gid): {
            "block_size": group.block_size,
            "start": group.start,
            "replica_keys": [list(key) for key in group.replica_keys],
            "values": [[to_hex(v) for v in row] for row in group.values.tolist()],
        }
        for gid, group in sorted(checksums.groups.items())
    }
    line: dict[str, Any] = {
        "format": LINE_FORMAT,
        "request": request,
        "role": role,
        "num_tokens": checksums.num_tokens,
        "positions": record.positions,
        "worker": {
            "tp_rank": worker.tp_rank,
            "tp_size": worker.tp_size,
            "pp_rank": worker.pp_rank,
            "pp_size": worker.pp_size,
            "engine": worker.engine,
        },
        "fingerprints": {str(g): to_hex(f) for g, f in sorted(record.fingerprints.items())},
        "not_covered": {str(g): r for g, r in sorted(record.not_covered.items())},
        "groups": groups,
    }
    if prompt is not None:
        line["prompt"] = prompt
    return json.dumps(line, separators=(",", ":"))


def append_checksums(
    output: str | os.PathLike[str],
    lines: Sequence[str],
    worker: WorkerInfo,
    *,
    max_bytes: int | None = MAX_CHECKSUM_BYTES,
    keep: int = KEEP_CHECKSUM_FILES,
) -> None:
    """Append lines to the worker's ``checksums.jsonl``, rotating it past ``max_bytes``.

    The lines are written in one appending write (repeated only for what a short write
    left), so a failed write (a full disk, a crash) leaves at most a torn last line, which
    readers skip; the next append starts a new line after it. When the file holds
    something and the lines would take it past ``max_bytes``, it is first renamed
    ``checksums.1.jsonl`` (``checksums.N.jsonl`` to ``N + 1``; at most ``keep`` rotated
    files are kept, the oldest removed): a worker's checksums take at most about
    ``(keep + 1) * max_bytes``. An append larger than ``max_bytes`` is written whole.

    Args:
        output: The engine's output folder.
        lines: The lines (``checksum_line``), each without a newline.
        worker: The worker whose file they go to.
        max_bytes: The size past which the file is rotated; None never rotates.
        keep: How many rotated files are kept (0: the old lines are dropped).

    Raises:
        ValueError: A line holding a newline, ``max_bytes`` below 1 or ``keep`` below 0.
        OSError: The folder or file cannot be written (the engine's hook logs it), or
            ``checksums.jsonl`` is not a regular file.

    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1 (or None), got {max_bytes}")
    if keep < 0:
        raise ValueError(f"keep must be at least 0, got {keep}")
    if any("\n" in line or "\r" in line for line in lines):
        raise ValueError("a checksum line holds a line break")
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if not data:
        return
    folder = worker_folder(output, worker.pp_rank, worker.tp_rank)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CHECKSUMS
    if max_bytes is not None:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(data) > max_bytes:
            _rotate(folder, keep)
    # Non-blocking: a FIFO in the file's place is refused below, never waited on.
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    descriptor = os.open(path, flags, 0o644)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if info.st_size and os.pread(descriptor, 1, info.st_size - 1) != b"\n":
            data = b"\n" + data  # after a torn line (a failed write): a line of its own
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view) :]
    finally:
        os.close(descriptor)


def rotated_name(number: int) -> str:
    """The name of the ``number``-th rotated checksum file (1: the newest)."""
    return f"checksums.{number}.jsonl" if number else CHECKSUMS


def _rotate(folder: Path, keep: int) -> None:
    """Shift the worker's checksum files by one (``checksums.jsonl`` to ``.1``), keeping
    ``keep`` rotated files and removing any older ones."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            match = ROTATED.fullmatch(entry.name)
            if match is not None and int(match.group(1)) >= keep:
                os.unlink(entry.path)  # the oldest kept is replaced below
    if keep == 0:
        (folder / CHECKSUMS).unlink(missing_ok=True)
        return
    for number in range(keep, 0, -1):
        source = folder / rotated_name(number - 1)
        if source.exists():
            os.replace(source, folder / rotated_name(number))


ROTATED = re.compile(r"checksums\.([1-9][0-9]{0,8})\.jsonl")
"""A rotated checksum file's name, and its number."""


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
_LINE_KEYS = (
    "format",
    "request",
    "role",
    "num_tokens",
    "positions",
    "worker",
    "fingerprints",
    "not_covered",
    "groups",
)
_LINE_ROLES = ("producer", "consumer")
_WORKER_KEYS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "engine")
_GROUP_KEYS = ("block_size", "start", "replica_keys", "values")
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
            line = _check_line(RecordReader(place), data, ranks, record)
            prompt = line.get("prompt")
            if prompt is not None:
                request = line["request"]
                seen = prompts.setdefault(request, prompt)
                if seen != prompt:
                    raise KvauditError(
                        f"request {short(request)}: prompt {prompt}, but {where[request]} "
                        f"gives {seen}: the lines of one request give one prompt",
                        place,
                    )
                where.setdefault(request, place)
            if role is not None and line["role"] != role:
                continue
            record = _merge_line(record, line, source)
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


def _check_line(
    reader: RecordReader, data: Any, ranks: tuple[int, int], record: WorkerRecord | None
) -> dict[str, Any]:
    """A checksum line, every key checked as a record's are: the format, the role, the
    position numbering, the worker (its folder's ranks; its sizes those of the file's
    other lines), counts and ranges, and each group's positions against the tokens.

    Returns:
        The line, with ``groups`` and ``fingerprints`` parsed.

    """
    line = reader.keys(data, "", _LINE_KEYS, ("prompt",))
    if line["format"] not in LINE_FORMATS:
        reader.fail("format", f"expected {LINE_FORMATS[0]!r}, {reader.got(line['format'])}")
    request = reader.string(line["request"], "request")
    role = line["role"]
    if role not in _LINE_ROLES:
        reader.fail("role", f"expected producer or consumer, {reader.got(role)}")
    num_tokens = reader.integer(line["num_tokens"], "num_tokens", 0, MAX_TOKENS)
    if line["positions"] not in POSITION_NUMBERINGS:
        reader.fail(
            "positions",
            f"expected one of {', '.join(POSITION_NUMBERINGS)}, {reader.got(line['positions'])}",
        )
    worker = _check_worker(reader, line["worker"], ranks, record, line["positions"])
    fp_path = "fingerprints"
    fingerprints = {
        reader.group_id(key, fp_path): reader.hex64(value, item_path(fp_path, key))
        for key, value in reader.obj(line[fp_path], fp_path).items()
    }
    nc_path = "not_covered"
    not_covered = {
        reader.group_id(key, nc_path): reader.string(value, item_path(nc_path, key))
        for key, value in reader.obj(line[nc_path], nc_path).items()
    }
    groups: dict[int, GroupChecksums] = {}
    for key, value in reader.obj(line["groups"], "groups").items():
        gid = reader.group_id(key, "groups")
        path = item_path("groups", key)
        group = reader.keys(value, path, _GROUP_KEYS)
        block_size, start = group_span(reader, group, path)
        keys, values = group_values(reader, group, path)
        checks = GroupChecksums(block_size, start, keys, values, fingerprints.get(gid, 0))
        check_positions(reader.source, path, num_tokens, block_size, start, checks.count)
        groups[gid] = checks
    result = {
        "request": request,
        "role": role,
        "num_tokens": num_tokens,
        "positions": line["positions"],
        "worker": worker,
        "fingerprints": fingerprints,
        "not_covered": not_covered,
        "groups": groups,
    }
    if "prompt" in line:
        result["prompt"] = _prompt(reader, line["prompt"])
    return result


def _prompt(reader: RecordReader, value: object) -> str:
    """A prompt digest: 16 lowercase hex digits."""
    reader.hex64(value, "prompt")
    return str(value)


def _check_worker(
    reader: RecordReader,
    value: object,
    ranks: tuple[int, int],
    record: WorkerRecord | None,
    line_positions: str,
) -> dict[str, Any]:
    """A line's ``worker``: sizes from 1 to ``MAX_WORKERS`` (their product too), ranks
    below them and those of the folder it is in; the sizes and position numbering of the
    worker's earlier lines."""
    data = reader.keys(value, "worker", _WORKER_KEYS)
    worker = {
        "tp_size": reader.integer(data["tp_size"], "worker.tp_size", 1, MAX_WORKERS),
        "pp_size": reader.integer(data["pp_size"], "worker.pp_size", 1, MAX_WORKERS),
        "tp_rank": reader.integer(data["tp_rank"], "worker.tp_rank", 0, MAX_WORKERS),
        "pp_rank": reader.integer(data["pp_rank"], "worker.pp_rank", 0, MAX_WORKERS),
        "engine": reader.string(data["engine"], "worker.engine"),
    }
    if worker["tp_size"] * worker["pp_size"] > MAX_WORKERS:
        reader.fail(
            "worker",
            f"tp_size {worker['tp_size']} x pp_size {worker['pp_size']} is more than the "
            f"{MAX_WORKERS} workers kvaudit reads",
        )
    for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
        reader.rank(worker[rank], worker[size], join("worker", rank))
    if (worker["pp_rank"], worker["tp_rank"]) != ranks:
        reader.fail(
            "worker",
            f"pp_rank {worker['pp_rank']}, tp_rank {worker['tp_rank']}, but the line is in "
            f"the folder of pp{ranks[0]}-tp{ranks[1]}",
        )
    if record is not None:
        if line_positions != record.positions:
            reader.fail(
                "positions",
                f"{line_positions}, but the worker's earlier lines number positions by "
                f"{record.positions}",
            )
        for size in ("tp_size", "pp_size"):
            if worker[size] != getattr(record.worker, size):
                reader.fail(
                    join("worker", size),
                    f"{worker[size]}, but the worker's earlier lines give "
                    f"{getattr(record.worker, size)}",
                )
    return worker


def _merge_line(record: WorkerRecord | None, line: Mapping[str, Any], source: str) -> WorkerRecord:
    """``record`` with the line's request (a later line replaces an earlier one)."""
    w = line["worker"]
    role = line["role"]
    info = WorkerInfo(
        w["tp_rank"], w["tp_size"], w["pp_rank"], w["pp_size"], role, w["engine"], source
    )
    if record is None:
        record = WorkerRecord(info, line["positions"], {}, {}, {})
    elif record.worker.role != role:
        # A kv_both engine: its worker holds both roles; every replica counts as a consumer's.
        record.worker = WorkerInfo(**{**record.worker.__dict__, "role": "consumer"})
    record.positions = line["positions"]
    record.fingerprints.update(line["fingerprints"])
    record.not_covered.update(line["not_covered"])
    groups = {
        gid: GroupChecksums(
            group.block_size,
            group.start,
            group.replica_keys,
            group.values,
            record.fingerprints.get(gid, 0),
        )
        for gid, group in line["groups"].items()
    }
    record.requests[line["request"]] = RequestChecksums(line["num_tokens"], groups)
    return record


def read_output_folder(path: str | os.PathLike[str], role: str | None = None) -> Record:
    """The engine's record: every worker's latest checksums of each audited request (of
    ``role`` only, when given), summed over workers (``read_output``'s record).

    Raises:
        KvauditError: As ``read_output`` raises it.

    """
    return read_output(path, role).record
