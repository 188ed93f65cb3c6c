"""Output folders of kvaudit's in-engine audits (the vLLM connector, the SGLang hooks) as
sources: the checksums the engine's workers appended (``kvaudit.integrations.output``), as
one record. A folder stands alone among a command's SOURCE arguments (docs/vllm.md,
docs/sglang.md)."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.errors import KvauditError
from ..integrations.output import read_output_folder
from .record_source import RecordSource
from .registry import OpenOptions


def open_output_folders(
    names: Sequence[str], folders: Sequence[str], options: OpenOptions
) -> RecordSource:
    """The output-folder kind's opener: one folder, standing alone."""
    if len(names) != 1:
        raise KvauditError(f"{folders[0]}: a kvaudit output folder stands alone; give one folder")
    return RecordSource(folders[0], read_output_folder(folders[0]))
