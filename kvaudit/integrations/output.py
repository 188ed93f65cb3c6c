"""An in-engine audit's output folder (kvaudit's vLLM connector, its SGLang hooks): the
engine's cache descriptions, every audited request's per-worker checksums (appended as
JSON lines) and its dumps; read back as one record.

Layout (docs/vllm.md, docs/sglang.md)::

    OUTPUT/kvaudit-output.json                  marks the folder (the engine that wrote it)
    OUTPUT/cache.yaml                           the description (one PP stage: TP rank 0's)
    OUTPUT/workers/pp{P}-tp{T}/cache.yaml       each worker's description
    OUTPUT/workers/pp{P}-tp{T}/checksums.jsonl  one line per audited request
    OUTPUT/dumps/{request}/pp{P}-tp{T}.safetensors   a dump set per dumped request

This module imports no engine: ``kvaudit`` reads the folder anywhere. Folders written before
the format was shared (marked ``kvaudit-vllm.json``, lines ``kvaudit.vllm-checksums/1``)
are read as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import KvauditError
from ..core.files import atomic_path
from ..core.scheme import from_hex, to_hex
from ..core.validation import unique_keys
from ..records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    combine_workers,
)

MARKER = "kvaudit-output.json"
FORMAT = "kvaudit.engine-output/1"
LINE_FORMAT = "kvaudit.engine-checksums/1"
LEGACY_MARKER = "kvaudit-vllm.json"
"""The marker of folders the vLLM connector wrote before the format was shared."""
LINE_FORMATS = (LINE_FORMAT, "kvaudit.vllm-checksums/1")
_WORKER_DIR = re.compile(r"pp(\d+)-tp(\d+)")


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
    are removed oldest first to make room for new ones."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._rotating: deque[tuple[Path, int]] = deque()

    def admits(self, path: Path, size: int, *, rotating: bool) -> bool:
        """Whether a dump of ``size`` bytes at ``path`` fits (``rotating``: after removing
        this worker's oldest rotating dumps as needed). A dump that could never fit
        removes nothing; one that rewrites ``path`` no longer counts the old file."""
        for entry in [e for e in self._rotating if e[0] == path]:
            self._rotating.remove(entry)
            self.used -= entry[1]
        if size <= 0 or size > self.limit:
            return False
        while rotating and self._rotating and self.used + size > self.limit:
            old_path, old = self._rotating.popleft()
            old_path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # other workers' dumps are still in it
                old_path.parent.rmdir()
            self.used -= old
        return self.used + size <= self.limit

    def written(self, path: Path, size: int, *, rotating: bool) -> None:
        """Count a dump written (a rotating one may be removed later)."""
        self.used += size
        if rotating:
            self._rotating.append((path, size))


def _safe_name(request: str) -> str:
    """A request id as one folder name (path separators and dots at the start replaced)."""
    name = re.sub(r"[/\\\x00]", "_", request)
    return "_" + name[1:] if name.startswith(".") or not name else name


def _write_whole(path: Path, data: bytes) -> None:
    with atomic_path(path) as temporary, open(temporary, "wb") as file:
        file.write(data)


def is_output_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an in-engine audit's output folder."""
    return (Path(path) / MARKER).is_file() or (Path(path) / LEGACY_MARKER).is_file()


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
    record: WorkerRecord, checksums: RequestChecksums, request: str, role: str
) -> str:
    """One request's checksums of a worker's record, as one JSON line under ``request``."""
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
    return json.dumps(
        {
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
        },
        separators=(",", ":"),
    )


def append_checksums(output: str | os.PathLike[str], lines: list[str], worker: WorkerInfo) -> None:
    """Append lines to the worker's ``checksums.jsonl``."""
    folder = worker_folder(output, worker.pp_rank, worker.tp_rank)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "checksums.jsonl", "a", encoding="utf-8") as file:
        file.write("".join(line + "\n" for line in lines))


def read_output_folder(path: str | os.PathLike[str], role: str | None = None) -> Record:
    """The engine's record: every worker's latest checksums of each audited request (of
    ``role`` only, when given), summed over workers.

    Raises:
        KvauditError: No marker, no worker with checksums, or a line that is not what the
            connector writes; the message names the file and line.

    """
    folder = Path(path)
    if not is_output_folder(folder):
        raise KvauditError(f"not a kvaudit output folder (no {MARKER})", str(folder))
    workers = sorted(
        p
        for p in (folder / "workers").glob("*/checksums.jsonl")
        if _WORKER_DIR.fullmatch(p.parent.name)
    )
    records = [_read_worker(p, role) for p in workers]
    records = [r for r in records if r is not None]
    if not records:
        raise KvauditError("no audited request has been written yet", str(folder))
    return combine_workers(records)


def _read_worker(path: Path, role: str | None) -> WorkerRecord | None:
    """One worker's record from its JSON lines (None: no line of ``role``)."""
    record: WorkerRecord | None = None
    with open(path, encoding="utf-8") as file:
        for number, text in enumerate(file, 1):
            if not text.strip():
                continue
            where = f"{path}: line {number}"
            try:
                line = json.loads(text, object_pairs_hook=unique_keys)
                if line.get("format") not in LINE_FORMATS:
                    raise KvauditError(f"format is not {LINE_FORMAT}", where)
                if role is not None and line["role"] != role:
                    continue
                record = _merge_line(record, line, str(path))
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                raise KvauditError(f"not a checksum line ({error!r:.80})", where) from None
    return record


def _merge_line(record: WorkerRecord | None, line: dict[str, Any], source: str) -> WorkerRecord:
    """``record`` with the line's request (a later line replaces an earlier one)."""
    w = line["worker"]
    role = "producer" if line["role"] == "producer" else "consumer"
    info = WorkerInfo(
        int(w["tp_rank"]), int(w["tp_size"]), int(w["pp_rank"]), int(w["pp_size"]), role,
        str(w["engine"]), source,
    )  # fmt: skip
    if record is None:
        record = WorkerRecord(info, line["positions"], {}, {}, {})
    elif record.worker.role != role:
        # A kv_both engine: its worker holds both roles; every replica counts as a consumer's.
        record.worker = WorkerInfo(**{**record.worker.__dict__, "role": "consumer"})
    record.positions = line["positions"]
    record.fingerprints.update({int(g): from_hex(v) for g, v in line["fingerprints"].items()})
    record.not_covered.update({int(g): str(r) for g, r in line["not_covered"].items()})
    groups = {}
    for gid, group in line["groups"].items():
        values = [[from_hex(v) for v in row] for row in group["values"]]
        keys = [tuple(int(x) for x in key) for key in group["replica_keys"]]
        groups[int(gid)] = GroupChecksums(
            block_size=int(group["block_size"]),
            start=int(group["start"]),
            replica_keys=keys,
            values=np.array(values, dtype=np.uint64).reshape(len(values), len(keys)),
            fingerprint=record.fingerprints.get(int(gid), 0),
        )
    record.requests[str(line["request"])] = RequestChecksums(int(line["num_tokens"]), groups)
    return record
