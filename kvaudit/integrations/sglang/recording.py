"""What kvaudit's SGLang hooks write to disk: their settings (environment variables, since
SGLang's plug-ins take no arguments; the switches' names too) and, per scheduler process,
the output folder's description, checksum lines and bounded dumps
(``kvaudit.output_folders``; docs/sglang.md, "The output folder").

A prefill writes each sent request's per-block checksums and, with rotating dumps, a dump
of its blocks (the latest within the budget kept); a decode writes each checked request's
checksums and dumps a request whose check failed, before SGLang frees its KV. Then
``kvaudit diff PREFILL_OUT DECODE_OUT`` names the differing block positions and ``kvaudit
diff PREFILL_OUT/dumps/RID DECODE_OUT/dumps/RID`` locates layer, head and token.

This module imports neither SGLang nor anything that does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import output_folders as output
from ...core.errors import KvauditError
from ...description import CacheDescription
from ...dumps import write_dump
from ...dumps.writing import dump_bytes
from ...records import WorkerInfo, WorkerRecord
from ...views.inputs import RequestBlocks

if TYPE_CHECKING:
    from .describe import LayerCaches

logger = logging.getLogger(__name__)

INLINE_VARIABLE = "KVAUDIT_SGLANG_INLINE"
"""``1`` turns the inline check on."""
LIVE_VARIABLE = "KVAUDIT_SGLANG_LIVE"
"""The folder every scheduler process serves its pool in (``serving``)."""
OUTPUT_VARIABLE = "KVAUDIT_SGLANG_OUTPUT"
MAX_DUMP_BYTES_VARIABLE = "KVAUDIT_SGLANG_MAX_DUMP_BYTES"
ROTATE_DUMPS_VARIABLE = "KVAUDIT_SGLANG_ROTATE_DUMPS"
LAYER_SUMS_VARIABLE = "KVAUDIT_SGLANG_LAYER_SUMS"
"""``0`` leaves the per-layer K/V sums out of the checksum lines (default ``1``)."""
WHERE = "environment"


@dataclass(frozen=True)
class InlineSettings:
    """Where the hooks write and how much.

    ``output``: the engine's output folder (None: nothing written; logs and counts still
    work); ``max_dump_bytes``: at most this many bytes of dumps per scheduler process (0:
    no dumps, not even of a mismatch); ``rotate_dumps``: a prefill dumps every request it
    sends and keeps the latest within ``max_dump_bytes``, so that a decode's failed check
    finds the prefill's side still on disk; ``layer_sums``: each checksum line also holds
    every block's total split per layer and K or V plane, so that ``kvaudit diff`` of two
    output folders names the differing layer without a dump (docs/checksum.md, "Layer
    sums").
    """

    output: str | None = None
    max_dump_bytes: int = 0
    rotate_dumps: bool = False
    layer_sums: bool = True


def settings_from_environment(environ: Mapping[str, str] = os.environ) -> InlineSettings:
    """The settings ``KVAUDIT_SGLANG_OUTPUT``, ``KVAUDIT_SGLANG_MAX_DUMP_BYTES``,
    ``KVAUDIT_SGLANG_ROTATE_DUMPS`` and ``KVAUDIT_SGLANG_LAYER_SUMS`` give.

    Args:
        environ: The environment (default: this process's).

    Returns:
        The settings.

    Raises:
        KvauditError: A value that is not what the variable takes (one line).

    """
    folder = environ.get(OUTPUT_VARIABLE) or None
    size_text = environ.get(MAX_DUMP_BYTES_VARIABLE, "0").strip() or "0"
    if not size_text.isdigit():
        raise KvauditError(
            f"{MAX_DUMP_BYTES_VARIABLE}: expected a non-negative integer, got {size_text!r}",
            WHERE,
        )
    rotate_text = environ.get(ROTATE_DUMPS_VARIABLE, "0").strip() or "0"
    if rotate_text not in ("0", "1"):
        raise KvauditError(f"{ROTATE_DUMPS_VARIABLE}: expected 0 or 1, got {rotate_text!r}", WHERE)
    sums_text = environ.get(LAYER_SUMS_VARIABLE, "1").strip() or "1"
    if sums_text not in ("0", "1"):
        raise KvauditError(f"{LAYER_SUMS_VARIABLE}: expected 0 or 1, got {sums_text!r}", WHERE)
    if folder is None and (int(size_text) or rotate_text == "1"):
        raise KvauditError(
            f"{MAX_DUMP_BYTES_VARIABLE} and {ROTATE_DUMPS_VARIABLE} need {OUTPUT_VARIABLE}",
            WHERE,
        )
    return InlineSettings(folder, int(size_text), rotate_text == "1", sums_text == "1")


class Recorder:
    """One scheduler process's writer into the engine's output folder."""

    def __init__(
        self,
        settings: InlineSettings,
        worker: WorkerInfo,
        description: CacheDescription,
        raw: Mapping[str, Any],
        tensors: LayerCaches,
    ) -> None:
        assert settings.output is not None
        self.settings = settings
        self.worker = worker
        self.description = description
        self.tensors = tensors
        self.budget = output.DumpBudget(settings.max_dump_bytes)
        output.write_description(settings.output, raw, worker, engine="sglang")

    def checksums(self, record: WorkerRecord, request: str) -> None:
        """Append the request's per-block checksums of this worker (one line)."""
        assert self.settings.output is not None
        checks = record.requests[request]
        line = output.checksum_line(record, checks, request, self.worker.role)
        output.append_checksums(self.settings.output, [line], self.worker)

    def dump(self, request: str, blocks: RequestBlocks, *, rotating: bool) -> Path | None:
        """Dump the request's blocks of every layer this worker holds, within
        ``max_dump_bytes`` (``rotating``: the oldest rotating dumps removed to make room).

        Returns:
            The dump written, or None (over the budget, or no dumps configured).

        """
        assert self.settings.output is not None
        size = dump_bytes(self.description, self.tensors, [blocks])
        path = output.dump_path(
            self.settings.output, request, self.worker.pp_rank, self.worker.tp_rank
        )
        if not self.budget.admits(path, size, rotating=rotating):
            if self.settings.max_dump_bytes:
                logger.info("kvaudit: request %s not dumped: max dump bytes reached", request)
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        write_dump(path, self.description, self.tensors, {request: blocks}, worker=self.worker)
        self.budget.written(path, size, rotating=rotating)
        return path
