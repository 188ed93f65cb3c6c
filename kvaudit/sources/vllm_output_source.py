"""Output folders of kvaudit's vLLM connector as sources: the checksums the engine's
workers appended (``kvaudit.integrations.vllm.output``), as one record. A folder stands
alone among a command's SOURCE arguments (docs/vllm.md)."""

from __future__ import annotations

from collections.abc import Sequence

from ..core.errors import KvauditError
from ..integrations.vllm.output import read_output_folder
from .record_source import RecordSource
from .registry import OpenOptions


def open_output_folders(
    names: Sequence[str], folders: Sequence[str], options: OpenOptions
) -> RecordSource:
    """The vLLM output kind's opener: one folder, standing alone."""
    if len(names) != 1:
        raise KvauditError(
            f"{folders[0]}: a kvaudit vLLM output folder stands alone; give one folder"
        )
    return RecordSource(folders[0], read_output_folder(folders[0]))
