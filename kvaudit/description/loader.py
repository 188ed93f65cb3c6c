"""Reading a cache description YAML file: strict YAML (no key given twice, bounded alias
expansion and nesting, no value a tag cannot build), one-line errors naming the file and
line, then ``parse_description``."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import DescriptionError, KvauditError
from ..core.files import check_input
from ..core.validation import MAX_DEPTH, MAX_YAML_BYTES, MAX_YAML_NODES, short_text
from .model import CacheDescription
from .validator import parse_description

_STANDARD_TAGS = "tag:yaml.org,2002:"


class _StrictLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key given twice in one mapping, a document that
    expands (aliases counted at each use) to more than ``MAX_YAML_NODES`` nodes or nests
    deeper than ``MAX_DEPTH``, an alias inside the value it names, and explicitly tagged
    values their tag cannot build (``!!int x``, ``!!timestamp x``)."""

    _depth = 0
    _composed = 0

    def fetch_flow_collection_start(self, token_class: type[yaml.Token]) -> None:
        # The scanner looks ahead over every "[" or "{" that may start a key, at a cost
        # that grows with the nesting: refuse deep flow nesting as it is scanned.
        if self.flow_level >= MAX_DEPTH:
            raise yaml.scanner.ScannerError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", self.get_mark()
            )
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        # Refused while composing, before Python's recursion limit or the scanner's cost
        # per nesting level adds up.
        self._depth += 1
        self._composed += 1
        try:
            if self._composed > MAX_YAML_NODES:
                # Refused as the document is read: a long flat list would otherwise be
                # built whole (gigabytes) before the expansion is counted.
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"holds more than {MAX_YAML_NODES} values",
                    self.peek_event().start_mark,
                )
            if self._depth > MAX_DEPTH + 1:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested more than {MAX_DEPTH} levels deep",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return self.construct_document(node)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, AttributeError, KeyError, IndexError, OverflowError):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"cannot read {short_text(repr(_shown(node)), 40)} as "
                f"{node.tag.replace(_STANDARD_TAGS, '!!')}",
                node.start_mark,
            ) from None

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


_INT = _STANDARD_TAGS + "int"
_FLOAT = _STANDARD_TAGS + "float"

# Numbers as YAML 1.2 reads them (PyYAML keeps YAML 1.1's): 1e-3 is a float, not text;
# 1:04 (sexagesimal), 6_4 and 010 (octal) are not the numbers 64, 64 and 8.
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_StrictLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    """An integer of YAML 1.2: decimal (leading zeros too), ``0o`` octal, ``0x`` hex."""
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


_StrictLoader.add_constructor(_INT, _construct_int)


def _shown(node: yaml.Node) -> object:
    return node.value if isinstance(node, yaml.ScalarNode) else f"a {node.id}"


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a composed document that expands past the limits, before anything is built.

    Aliases share nodes, so a few bytes can name billions of values (an "alias bomb");
    each node's expanded size is counted once, from its children's.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    pending: list[tuple[yaml.Node, int, bool]] = [(root, 0, False)]
    while pending:
        node, depth, children_done = pending.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            size = 1 + sum(sizes[id(child)] for child in _children(node))
            if size > MAX_YAML_NODES:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"expands to more than {MAX_YAML_NODES} values (aliases counted at each use)",
                    node.start_mark,
                )
            sizes[key] = size
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise yaml.composer.ComposerError(
                None, None, "an alias inside the value it names", node.start_mark
            )
        if depth > MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", node.start_mark
            )
        on_path.add(key)
        pending.append((node, depth, True))
        pending.extend((child, depth + 1, False) for child in _children(node))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "malformed"
        if mark is not None:
            return f"line {mark.line + 1}: invalid YAML: {problem}"
        return f"invalid YAML: {problem}"
    return "invalid YAML: " + " ".join(str(exc).split())


def parse_yaml(text: str) -> Any:
    """YAML text parsed strictly and within the limits (``_StrictLoader``).

    Raises:
        yaml.YAMLError: Malformed YAML, or YAML past the limits, with its line.

    """
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: builds no objects


def load_description(path: str | os.PathLike[str]) -> CacheDescription:
    """Read and validate a cache description YAML file.

    Args:
        path: The YAML file (docs/cache-description.md).

    Returns:
        The validated description, its ``source`` the path.

    Raises:
        DescriptionError: One line naming the file and the problem (missing file, malformed
            YAML with its line, or an invalid description with its key path).

    Example:
        >>> import pathlib, tempfile
        >>> from kvaudit import load_description
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "cache.yaml"
        >>> _ = path.write_text(
        ...     "{kvaudit: 1, num_blocks: 128, groups: [{"
        ...     "spec: {type: full_attention, block_size: 32, num_kv_heads: 4, head_size: 64,"
        ...     " dtype: float16, layout: NHTC},"
        ...     " layers: [model.layers.0.self_attn.attn, model.layers.1.self_attn.attn]}]}"
        ... )  # YAML (here in flow style: JSON is YAML too)
        >>> description = load_description(path)
        >>> [layer.name for layer in description.groups[0].layers]
        ['model.layers.0.self_attn.attn', 'model.layers.1.self_attn.attn']

    """
    source = os.fspath(path)
    try:
        check_input(source)  # a FIFO or a device would block or never end
    except KvauditError as error:
        raise DescriptionError(error.message, source=source) from None
    try:
        if os.path.getsize(source) > MAX_YAML_BYTES:
            raise DescriptionError(
                f"{os.path.getsize(source)} bytes, more than the {MAX_YAML_BYTES} a "
                "description may have",
                source=source,
            )
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
        data = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise DescriptionError(_yaml_problem(exc), source=source) from None
    if data is None:
        raise DescriptionError(
            "empty; expected a mapping with kvaudit, num_blocks and groups", source=source
        )
    return parse_description(data, source)
