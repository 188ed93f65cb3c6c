"""Output folders of kvaudit's in-engine audits (the vLLM connector, the SGLang hooks) as
sources: the checksums the engine's workers appended (``kvaudit.output_folders``), as
one record, with the dumps the folder holds (``OUTPUT/dumps/{request}/``) for locating
the differences of the requests dumped, and each request's prompt digest for pairing
requests two engines name differently. A folder stands alone among a command's SOURCE
arguments (docs/vllm.md, docs/sglang.md)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from ..core.errors import KvauditError
from ..output_folders import OutputFolder, read_output
from ..records import Record
from ..workers import RawWorker
from .record_source import RecordSource
from .registry import OpenOptions


class OutputFolderSource(RecordSource):
    """An in-engine audit's output folder: its checksum lines as a record; its dumps, read
    when a diff locates differences (a dump folder that cannot be read is left out with a
    warning: the checksums still give the verdict)."""

    def __init__(
        self,
        name: str,
        folder: OutputFolder,
        renames: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(name, folder.record)
        self.folder = folder
        self.warnings = list(folder.warnings)
        self._renames = dict(renames or {})
        self._dumps: list[RawWorker] | None = None
        self._opened = False

    def prompt_digests(self) -> Mapping[str, str]:
        return self.folder.prompts

    def renamed(self, names: Mapping[str, str]) -> OutputFolderSource:
        record = self.folder.record
        requests = {names.get(rid, rid): request for rid, request in record.requests.items()}
        renamed_record = Record(
            record.positions,
            record.workers,
            record.complete,
            requests,
            list(record.missing_workers),
        )
        prompts = {names.get(rid, rid): digest for rid, digest in self.folder.prompts.items()}
        folder = dataclasses.replace(self.folder, record=renamed_record, prompts=prompts)
        # Dumps keep their own ids: each original id maps to its name after both renames.
        renames = {old: names.get(now, now) for old, now in self._renames.items()}
        earlier = set(self._renames.values())
        renames.update({now: new for now, new in names.items() if now not in earlier})
        source = OutputFolderSource(self.names[0], folder, renames)
        source.warnings = list(self.warnings)
        return source

    def dumped_kv(self) -> list[RawWorker] | None:
        if not self._opened:
            self._opened = True
            self._dumps = self._open_dumps()
        return self._dumps

    def _open_dumps(self) -> list[RawWorker] | None:
        """The folder's dumps, each request under its name in this source (None: none)."""
        directory = os.path.join(self.names[0], "dumps")
        if not os.path.isdir(directory):
            return None
        from ..dumps.dump_sets import open_dump_folders

        try:
            sets, skipped = open_dump_folders([directory], skip_bad=True)
        except KvauditError as error:
            self.warnings.append(f"its dumps are not read for locating: {error}")
            return None
        self.warnings.extend(f"a dump is not read for locating: {line}" for line in skipped)
        dumps: list[RawWorker] = []
        for dump_set in sets:
            for dump in dump_set.dumps:
                requests = {self._renames.get(rid, rid): r for rid, r in dump.requests.items()}
                dumps.append(dataclasses.replace(dump, requests=requests))
        return dumps or None


def open_output_folders(
    names: Sequence[str], folders: Sequence[str], options: OpenOptions
) -> OutputFolderSource:
    """The output-folder kind's opener: one folder, standing alone."""
    if len(names) != 1:
        raise KvauditError(f"{folders[0]}: a kvaudit output folder stands alone; give one folder")
    return OutputFolderSource(folders[0], read_output(folders[0]))
