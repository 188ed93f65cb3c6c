"""The output folder's names: its marker and formats, each worker's folder and checksum
files (rotated ones numbered), where a request's dump goes."""

from __future__ import annotations

import os
import re
from pathlib import Path

MARKER = "kvaudit-output.json"
FORMAT = "kvaudit.engine-output/1"
LINE_FORMAT = "kvaudit.engine-checksums/1"
LEGACY_MARKER = "kvaudit-vllm.json"
"""The marker of folders the vLLM connector wrote before the format was shared."""
LEGACY_FORMAT = "kvaudit.vllm-output/1"
"""The format the legacy marker names."""
LINE_FORMATS = (LINE_FORMAT, "kvaudit.vllm-checksums/1")
DESCRIPTION = "cache.yaml"
"""The folder's and each worker's cache description (YAML)."""
CHECKSUMS = "checksums.jsonl"
"""A worker's checksum lines; rotated ones are ``checksums.{N}.jsonl``, N = 1 the newest."""
ROTATED = re.compile(r"checksums\.([1-9][0-9]{0,8})\.jsonl")
"""A rotated checksum file's name, and its number."""


def worker_folder(output: str | os.PathLike[str], pp_rank: int, tp_rank: int) -> Path:
    """The folder of one worker's description and checksums."""
    return Path(output) / "workers" / f"pp{pp_rank}-tp{tp_rank}"


def dump_path(output: str | os.PathLike[str], request: str, pp_rank: int, tp_rank: int) -> Path:
    """Where a worker dumps one request's blocks (one dump set per request folder)."""
    return Path(output) / "dumps" / _safe_name(request) / f"pp{pp_rank}-tp{tp_rank}.safetensors"


def _safe_name(request: str) -> str:
    """A request id as one folder name (path separators and dots at the start replaced)."""
    name = re.sub(r"[/\\\x00]", "_", request)
    return "_" + name[1:] if name.startswith(".") or not name else name


def rotated_name(number: int) -> str:
    """The name of the ``number``-th rotated checksum file (1: the newest)."""
    return f"checksums.{number}.jsonl" if number else CHECKSUMS
