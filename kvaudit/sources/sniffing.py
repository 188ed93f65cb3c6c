"""The one place that recognises what a SOURCE argument is, without importing the modules
that open it: a record file, an in-engine audit's output folder, vLLM ExampleConnector
folders, a Python handle (``py:``), a live socket (``live:``); and what a file given as a
dump or a record looks like instead (a cache description, a record), for the hint in its
error line. ``kvaudit.sources.registry`` lists the kinds in the order they are tried.
"""

from __future__ import annotations

import json
import os
import stat

from ..core.errors import KvauditError

RECORD_SUFFIX = ".json"
DUMP_SUFFIX = ".safetensors"
LIVE_PREFIX = "live:"
PY_PREFIX = "py:"

DESCRIPTION_HINT = (
    "looks like a cache description: pass it with -c (--config), not as a dump or record"
)
"""The message for a cache description (YAML or JSON) given as a dump or a record."""

RECORD_HINT = "looks like a record (checksums only, from checksum --format json), not a dump"
"""The message for a record given where only a dump will do (``corrupt``)."""

_HEAD_BYTES = 64
_SNIFF_BYTES = 1 << 20  # a description is a few kilobytes; a larger file is not sniffed


# Records and descriptions.


def _head(name: str, size: int) -> bytes | None:
    """The first ``size`` bytes of a regular file (None: not one, or unreadable)."""
    if not os.path.isfile(name):
        return None
    try:
        with open(name, "rb") as handle:
            return handle.read(size)
    except OSError:
        return None


def is_record(name: str) -> bool:
    """Whether a SOURCE argument is a record: a ``.json`` file, or a file not named
    ``.safetensors`` whose first non-blank byte is ``{`` and whose start holds no NUL.

    A safetensors file starts with its header's length, 8 bytes of which the high ones are
    NUL, so a dump never passes even when the length's low byte is ``{``.
    """
    lowered = name.lower()
    if lowered.endswith(RECORD_SUFFIX):
        return True
    if lowered.endswith(DUMP_SUFFIX):
        return False
    head = _head(name, _HEAD_BYTES)
    return head is not None and b"\0" not in head and head.lstrip()[:1] == b"{"


def is_description_data(data: object) -> bool:
    """Whether parsed YAML or JSON is shaped as a cache description (``kvaudit`` and
    ``groups`` at the top)."""
    return isinstance(data, dict) and "kvaudit" in data and "groups" in data


def looks_like_description(path: str) -> bool:
    """Whether a file is a cache description (YAML or JSON): small, text, and parses to a
    mapping with ``kvaudit`` and ``groups``."""
    try:
        if os.path.getsize(path) > _SNIFF_BYTES:
            return False
    except OSError:
        return False
    raw = _head(path, _SNIFF_BYTES)
    if raw is None or b"\0" in raw:
        return False
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    # Strict YAML, as a description is read: hostile text stays within the input limits.
    # YAML (slow to import) only for a small text file, the rare mistake this catches.
    import yaml

    from ..description.loader import parse_yaml

    for parse in (json.loads, parse_yaml):
        try:
            if is_description_data(parse(text)):
                return True
        except (ValueError, RecursionError, yaml.YAMLError):
            continue
    return False


def wrong_input_hint(path: str) -> str | None:
    """What a file that did not read as a dump looks like instead: a cache description,
    or a record (None: neither)."""
    if looks_like_description(path):
        return DESCRIPTION_HINT
    if is_record(path):
        return RECORD_HINT
    return None


def with_hint(error: KvauditError) -> KvauditError:
    """A dump reader's error, or, when the file it names is a description or a record,
    the hint that says so (a valid dump is neither, so only its reader's error is kept).

    Args:
        error: What the dump reader raised.

    Returns:
        The error to raise: the hint naming the same file, or ``error`` itself.

    """
    source = error.source
    hint = wrong_input_hint(source) if source is not None and os.path.isfile(source) else None
    return KvauditError(hint, source) if hint is not None else error


# Folders.


def is_output_folder(name: str) -> bool:
    """Whether a SOURCE argument is an in-engine audit's output folder: a directory that
    holds a marker (whatever the marker holds: its reader says what is wrong with it)."""
    if not os.path.isdir(name):  # a dump file, the usual argument, needs no more
        return False
    from ..output_folders.layout import LEGACY_MARKER, MARKER

    return any(os.path.lexists(os.path.join(name, marker)) for marker in (MARKER, LEGACY_MARKER))


def is_example_connector(folder: str) -> bool:
    """Whether a directory is one vLLM ExampleConnector folder: ``.safetensors`` files,
    each one ``kv_cache`` tensor and no kvaudit metadata.

    Raises:
        KvauditError: The folder cannot be listed, or one of its ``.safetensors`` entries is
            not a regular file.

    """
    from ..dumps.dump import META_FORMAT
    from ..dumps.example_connector import EXAMPLE_CONNECTOR_TENSOR
    from ..dumps.safetensors_io import read_header, safetensors_files

    files = safetensors_files(folder)
    if not files:
        return False
    for file in files:
        try:
            header = read_header(file)
        except KvauditError:
            return False
        if META_FORMAT in header.metadata or set(header.tensors) != {EXAMPLE_CONNECTOR_TENSOR}:
            return False
    return True


def example_connector_folders(directory: str) -> list[str]:
    """The ExampleConnector folders a SOURCE directory names, sorted by name: itself, or,
    when it holds no ``.safetensors`` files of its own, the ExampleConnector folders
    directly inside it (a connector's storage path); none when it is neither.

    Raises:
        KvauditError: A folder cannot be listed, or a ``.safetensors`` entry in it is not a
            regular file.

    """
    if not os.path.isdir(directory):  # a dump file, the usual argument, needs no more
        return []
    from ..dumps.safetensors_io import safetensors_files

    if is_example_connector(directory):
        return [directory]
    if safetensors_files(directory):
        return []
    try:
        names = sorted(os.listdir(directory))
    except OSError as error:
        raise KvauditError(f"cannot list: {error.strerror}", directory) from None
    inner = [os.path.join(directory, name) for name in names]
    return [folder for folder in inner if os.path.isdir(folder) and is_example_connector(folder)]


def is_example_connector_source(name: str) -> bool:
    """Whether a SOURCE argument is an ExampleConnector folder or a directory of them."""
    return bool(example_connector_folders(name))


# Prefixes.


def _is_socket_or_folder(target: str) -> bool:
    try:
        mode = os.stat(target).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISSOCK(mode) or stat.S_ISDIR(mode)


def live_target_error(name: str) -> KvauditError | None:
    """The error for a ``live:`` argument that names a Python handle, the ``py:`` kind's
    target (``live:`` always names a socket or a folder of sockets; None: no such error).

    A target is taken for a Python handle when it is no socket or folder and ends
    ``.py``, or is no path at all and reads as a dotted module name.
    """
    target = name[len(LIVE_PREFIX) :]
    if not target or _is_socket_or_folder(target):
        return None
    if target.endswith(".py"):
        what = "names a Python file, not a socket or a folder of sockets (what live: names)"
    elif not os.path.lexists(target) and all(part.isidentifier() for part in target.split(".")):
        what = "is no socket or folder but reads as a Python module name"
    else:
        return None
    return KvauditError(f"{what}; write py:{target} for a Python handle", name)
