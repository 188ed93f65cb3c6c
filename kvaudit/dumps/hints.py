"""Hints for common mistakes made when giving dumps: a cache description given where a dump
(or a record) was expected, and a description that belongs to the other engine.
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.validation import Role

DESCRIPTION_HINT = (
    "looks like a cache description: pass it with -c (--config), not as a dump or record"
)
"""The message for a cache description (YAML or JSON) given as a dump or a record."""

RECORD_HINT = "looks like a record (checksums only, from checksum --format json), not a dump"
"""The message for a record given where only a dump will do (``corrupt``)."""

_RECORD_START = re.compile(rb'\s*\{\s*"format"\s*:\s*"kvaudit\.record/')

_SNIFF_BYTES = 1 << 20  # a description is a few kilobytes; a larger file is not sniffed


def is_description_data(data: object) -> bool:
    """Whether parsed YAML or JSON is shaped as a cache description (``kvaudit`` and
    ``groups`` at the top)."""
    return isinstance(data, dict) and "kvaudit" in data and "groups" in data


def looks_like_description(path: str) -> bool:
    """Whether a file is a cache description (YAML or JSON) rather than a dump: small,
    text, and parses to a mapping with ``kvaudit`` and ``groups``."""
    try:
        if os.path.getsize(path) > _SNIFF_BYTES:
            return False
        with open(path, "rb") as handle:
            raw = handle.read(_SNIFF_BYTES)
    except OSError:
        return False
    if b"\0" in raw:
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


def looks_like_record(path: str) -> bool:
    """Whether a file starts as a kvaudit record does (its ``format`` key first)."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(256)
    except OSError:
        return False
    return _RECORD_START.match(start) is not None


def own_description_option(role: str) -> str:
    """The option that gives one side of a command its own cache description."""
    if role in ("producer", "consumer"):
        return f"--{role}-config with diff, -c otherwise"
    return "-c"


def other_engine_hint(role: Role, num_blocks: int) -> str:
    """What to do when a description's ``num_blocks`` does not fit a dump: it is probably
    the other engine's; name this dump's side and the option that takes its own."""
    option = own_description_option(role)
    return (
        f"the cache description given ({num_blocks} blocks) does not fit this {role}'s dump, "
        f"it may be the other engine's: give the {role}'s own description ({option})"
    )
