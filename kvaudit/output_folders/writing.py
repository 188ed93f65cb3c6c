"""Writing an output folder (docs/vllm.md, docs/sglang.md): the marker and the
descriptions, each request's checksums as one JSON line with its prompt's digest,
appended to the worker's file, which is rotated past a size."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..core.files import atomic_path
from ..records import RequestChecksums, WorkerInfo, WorkerRecord
from ..records.encoding import request_line_to_json
from .layout import (
    CHECKSUMS,
    DESCRIPTION,
    FORMAT,
    LINE_FORMAT,
    MARKER,
    ROTATED,
    rotated_name,
    worker_folder,
)

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


def _write_whole(path: Path, data: bytes) -> None:
    with atomic_path(path) as temporary, open(temporary, "wb") as file:
        file.write(data)


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
    _write_whole(folder / DESCRIPTION, text)
    if worker.pp_size == 1 and worker.tp_rank == 0:
        _write_whole(Path(output) / DESCRIPTION, text)
    marker = json.dumps({"format": FORMAT, "engine": engine}).encode("utf-8")
    _write_whole(Path(output) / MARKER, marker)


def checksum_line(
    record: WorkerRecord,
    checksums: RequestChecksums,
    request: str,
    role: str,
    prompt: str | None = None,
) -> str:
    """One request's checksums of a worker's record, as one JSON line under ``request``
    (the record's encoder, ``records.encoding``, gives its data).

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
    data = request_line_to_json(LINE_FORMAT, record, checksums, request, role, prompt)
    return json.dumps(data, separators=(",", ":"))


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
