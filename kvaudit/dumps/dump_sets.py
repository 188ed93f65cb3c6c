"""Dump sets: one engine's dumps opened together, each checked, sorted by worker."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..core.errors import KvauditError
from ..core.validation import fail, worker_layout
from ..description import CacheDescription
from .dump import DumpSet
from .reading import open_dump


def expand_dump_paths(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Dump files and ExampleConnector folders: each path, a directory's files, or the
    ExampleConnector folders inside a directory that holds no files of its own."""
    result = []
    for path in paths:
        source = os.fspath(path)
        if os.path.isdir(source):
            # Imported here: a dump file never needs the ExampleConnector reader.
            from .example_connector import (
                example_connector_folders,
                is_example_connector,
                safetensors_files,
            )

            if is_example_connector(source):
                result.append(source)
                continue
            files = safetensors_files(source) or example_connector_folders(source)
            if not files:
                fail(source, "no .safetensors files or ExampleConnector folders in this directory")
            result.extend(files)
        elif os.path.exists(source):
            result.append(source)
        else:
            fail(source, "no such file or directory")
    return result


def open_dump_set(
    paths: Sequence[str | os.PathLike[str]], config: CacheDescription | None = None
) -> DumpSet:
    """Open one engine's dumps, checking each strictly.

    The paths may be dump files, directories of ``*.safetensors`` dumps, or
    ExampleConnector folders (several read as one dump of their requests, or those inside
    a directory given); ``config`` overrides each dump's description. A worker missing
    from the TP x PP layout is not an error: the set is incomplete.

    Args:
        paths: The dumps' files, directories or folders (one path alone is taken too).
        config: A description that overrides each dump's; None to use the embedded ones.

    Returns:
        The dumps sorted by ``(pp_rank, tp_rank)``, with the workers the set lacks.

    Raises:
        KvauditError: No dumps given, a bad dump, two dumps of one worker, or dumps that
            disagree on ``tp_size`` or ``pp_size``.

    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = expand_dump_paths(paths)
    if not files:
        raise KvauditError("no dumps given")
    folders = [file for file in files if os.path.isdir(file)]
    dumps = [open_dump(file, config) for file in files if not os.path.isdir(file)]
    if folders:
        from .example_connector import open_example_connectors

        dumps.append(open_example_connectors(folders, config))
    missing = worker_layout([dump.worker for dump in dumps])
    dumps.sort(key=lambda dump: (dump.worker.pp_rank, dump.worker.tp_rank))
    return DumpSet(dumps, not missing, missing)
