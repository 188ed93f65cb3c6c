"""Reading a cache description YAML file: strict YAML (no key given twice), one-line
errors naming the file and line, then ``parse_description``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ..errors import DescriptionError
from .model import CacheDescription
from .validator import parse_description


class _StrictLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "malformed"
        if mark is not None:
            return f"line {mark.line + 1}: invalid YAML: {problem}"
        return f"invalid YAML: {problem}"
    return "invalid YAML: " + " ".join(str(exc).split())


def load_description(path: str | os.PathLike[str]) -> CacheDescription:
    """Read and validate a cache description YAML file.

    Raises:
        DescriptionError: One line naming the file and the problem (missing file, malformed
            YAML with its line, or an invalid description with its key path).

    """
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DescriptionError("no such file", source=source) from None
    except IsADirectoryError:
        raise DescriptionError("is a directory, expected a YAML file", source=source) from None
    except UnicodeDecodeError:
        raise DescriptionError("not a UTF-8 text file", source=source) from None
    except OSError as exc:
        raise DescriptionError(f"cannot read: {exc.strerror}", source=source) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds no objects
    except yaml.YAMLError as exc:
        raise DescriptionError(_yaml_problem(exc), source=source) from None
    if data is None:
        raise DescriptionError(
            "empty; expected a mapping with kvaudit, num_blocks and groups", source=source
        )
    return parse_description(data, source)
