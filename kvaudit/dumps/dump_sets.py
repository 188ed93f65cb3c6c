"""Dump sets: one engine's dumps opened together, each checked, sorted by worker; and a
folder of dump sets, one per request (an output folder's ``dumps/``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..core.errors import KvauditError
from ..core.validation import fail, worker_layout
from ..description import CacheDescription
from .dump import DumpSet
from .reading import open_dump
from .safetensors_io import safetensors_files


def expand_dump_paths(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Dump files: each path, or a directory's ``*.safetensors`` files."""
    result = []
    for path in paths:
        source = os.fspath(path)
        if os.path.isdir(source):
            files = safetensors_files(source)
            if not files and dump_folders(source):
                fail(
                    source,
                    "holds a folder of dumps per request (an output folder's dumps/): give "
                    "it alone, or with other such folders",
                )
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

    The paths may be dump files or directories of ``*.safetensors`` dumps (vLLM
    ExampleConnector folders are a source kind of their own: ``kvaudit.sources``);
    ``config`` overrides each dump's description. A worker missing from the TP x PP
    layout is not an error: the set is incomplete.

    Args:
        paths: The dumps' files or directories (one path alone is taken too).
        config: A description that overrides each dump's; None to use the embedded ones.

    Returns:
        The dumps sorted by ``(pp_rank, tp_rank)``, with the workers the set lacks.

    Raises:
        KvauditError: No dumps given, a bad dump, two dumps of one worker, or dumps that
            disagree on ``tp_size`` or ``pp_size``.

    Example:
        Two TP ranks of a prefill engine, each with its own head, written and opened as a set:

        >>> import pathlib, tempfile, torch
        >>> from kvaudit import RequestBlocks, WorkerInfo
        >>> from kvaudit.description import parse_description
        >>> from kvaudit.dumps import open_dump_set, write_dump
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> description = parse_description({"kvaudit": 1, "num_blocks": 3, "model_kv_heads": 2,
        ...     "groups": [{"spec": {"type": "full_attention", "block_size": 4, "head_size": 2,
        ...     "num_kv_heads": 1, "dtype": "float16", "layout": "NHTC"},
        ...     "layers": ["model.layers.0.attn"]}]}, "tp rank")
        >>> for rank in range(2):
        ...     write_dump(folder / f"rank{rank}.safetensors", description,
        ...                {"model.layers.0.attn": torch.zeros(3, 1, 4, 4, dtype=torch.float16)},
        ...                {"req": RequestBlocks(6, {0: (0, [0, 2])})},
        ...                worker=WorkerInfo(tp_rank=rank, tp_size=2, role="producer"))
        >>> dump_set = open_dump_set([folder])
        >>> [dump.worker.tp_rank for dump in dump_set.dumps], dump_set.complete
        ([0, 1], True)

    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = expand_dump_paths(paths)
    if not files:
        raise KvauditError("no dumps given")
    dumps = [open_dump(file, config) for file in files]
    missing = worker_layout([dump.worker for dump in dumps])
    dumps.sort(key=lambda dump: (dump.worker.pp_rank, dump.worker.tp_rank))
    return DumpSet(dumps, not missing, missing)


def dump_folders(directory: str | os.PathLike[str]) -> list[str]:
    """The folders directly inside ``directory`` that hold kvaudit dump files of their own
    (an output folder's ``dumps/``: a dump set per request), sorted by name; none when
    ``directory`` holds dump files itself.

    Raises:
        KvauditError: A folder cannot be listed, or a dump file in one is not a regular
            file.

    """
    source = os.fspath(directory)
    if not os.path.isdir(source):  # a dump file, the usual argument, needs no more
        return []
    if safetensors_files(source):
        return []
    try:
        names = sorted(os.listdir(source))
    except OSError as error:
        fail(source, f"cannot list: {error.strerror}")
    folders = [os.path.join(source, name) for name in names]
    return [folder for folder in folders if os.path.isdir(folder) and _names_dumps(folder)]


def _names_dumps(folder: str) -> bool:
    """Whether a folder lists a ``*.safetensors`` entry that is not a folder (what it is,
    a FIFO or a device, is checked where it is opened)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(
        name.endswith(".safetensors") and not os.path.isdir(os.path.join(folder, name))
        for name in names
    )


def is_dump_folders(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder of dump sets, one per request (``dump_folders``)."""
    return bool(dump_folders(path))


def open_dump_folders(
    directories: Sequence[str | os.PathLike[str]],
    config: CacheDescription | None = None,
    *,
    skip_bad: bool = False,
) -> tuple[list[DumpSet], list[str]]:
    """Open folders of dump sets (``dump_folders``): each inner folder one dump set, every
    request in one set only, every dump of one engine in one role.

    Args:
        directories: The folders of dump sets.
        config: A description that overrides each dump's; None to use the embedded ones.
        skip_bad: Leave out an inner folder that cannot be opened, and say why (the
            second value), rather than fail.

    Returns:
        The dump sets, in order of folder and name, and what was left out (one line
        each).

    Raises:
        KvauditError: A bad dump (unless ``skip_bad``), a request in two sets, or dumps of
            different roles, TP or PP sizes.

    """
    sets: list[DumpSet] = []
    skipped: list[str] = []
    holder: dict[str, str] = {}
    for directory in directories:
        for folder in dump_folders(directory):
            try:
                dump_set = open_dump_set([folder], config)
            except KvauditError as error:
                if not skip_bad:
                    raise
                skipped.append(str(error))
                continue
            for request_id in dump_set.request_ids:
                if request_id in holder:
                    fail(folder, f"request {request_id!r} is also in {holder[request_id]}")
                holder[request_id] = folder
            if sets:
                _same_engine(sets[0], dump_set)
            sets.append(dump_set)
    return sets, skipped


def _same_engine(first: DumpSet, other: DumpSet) -> None:
    """Refuse dump sets whose workers disagree on the role or the TP and PP sizes."""
    a, b = first.dumps[0], other.dumps[0]
    for key in ("role", "tp_size", "pp_size"):
        if getattr(a.worker, key) != getattr(b.worker, key):
            fail(
                b.path,
                f"{key} {getattr(b.worker, key)}, but {a.path} has {key} "
                f"{getattr(a.worker, key)}: the dumps of one folder come from one engine in "
                "one role",
            )
