"""The description checker's fields: scalars, mappings, dtypes and layouts, each failure
one ``DescriptionError`` naming the source and key path."""

from __future__ import annotations

import keyword
import math
from collections.abc import Mapping
from typing import Any

from ..core.dtypes import DType, parse_dtype
from ..core.errors import DescriptionError
from ..core.validation import MAX_COUNT, Checker, join, short_text
from .model import LAYOUT_AXES, SPEC_TYPES

TOP_KEYS = ("kvaudit", "num_blocks", "model_kv_heads", "draft_layers", "groups")
GROUP_KEYS = ("id", "num_blocks", "transfer", "host_resident", "spec", "layers")
LAYER_KEYS = ("name", "spec", "shares")
SPLIT_KEYS = ("axis", "segments")
COMMON_SPEC_KEYS = ("type", "block_size", "kernel_block_size")
ATTENTION_SPEC_KEYS = (
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "layout",
    "sliding_window",
    "attention_chunk_size",
    "max_tp_shards",
    "scale",
    "k_scale",
    "v_scale",
)
STATE_SPEC_KEYS = ("shapes", "dtypes", "checksummed_states", "tp_replicated", "state_splits")
# vLLM's KVCacheSpec class (any type), for the fingerprint.
SPEC_CLASS_KEY = "spec_class"
SPEC_KEYS = (*COMMON_SPEC_KEYS, *ATTENTION_SPEC_KEYS, *STATE_SPEC_KEYS, SPEC_CLASS_KEY)
# Spec keys a layer may not set to another value than its group's.
GROUP_WIDE_KEYS = ("block_size", "kernel_block_size")


def integer_kind(minimum: int, maximum: int | None) -> str:
    if maximum is not None:
        return f"an integer from {minimum} to {maximum}"
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    return f"an integer of at least {minimum}"


def is_list(value: object) -> bool:
    return isinstance(value, (list, tuple))


class FieldChecker(Checker):
    """Checks a description's scalar values, mappings and layouts key by key; every
    failure is one ``DescriptionError``."""

    error = DescriptionError

    def got(self, value: object) -> str:
        """``got <value>`` as YAML's reader sees it, kept to one short line."""
        if value is None:
            return "got nothing"
        if isinstance(value, Mapping):
            return "got a mapping"
        text = repr(list(value)) if isinstance(value, (list, tuple)) else repr(value)
        if isinstance(value, (list, tuple)) and len(text) > 40:
            return f"got a list of {len(value)} items"
        return f"got {short_text(text, self.limit)}"

    # Scalars.

    def integer(
        self,
        value: object,
        path: str,
        minimum: int = 1,
        maximum: int | None = None,
        limit: int = MAX_COUNT,
    ) -> int:
        """An integer from ``minimum`` to ``maximum``; ``limit`` (docs/cli.md, "Limits on
        input") caps it too, and is named only when exceeded."""
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            maximum = limit if maximum is None else min(maximum, limit)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            self.fail(path, f"expected {integer_kind(minimum, maximum)}, {self.got(value)}")
        return value

    def field_int(
        self,
        raw: Mapping[str, Any],
        path: str,
        key: str,
        *,
        required: bool = False,
        default: int | None = None,
        minimum: int = 1,
        maximum: int | None = None,
        limit: int = MAX_COUNT,
    ) -> int | None:
        value = raw.get(key)
        if value is None:
            if required:
                self.fail(join(path, key), f"missing; expected {integer_kind(minimum, maximum)}")
            return default
        return self.integer(value, join(path, key), minimum, maximum, limit)

    def boolean(self, raw: Mapping[str, Any], path: str, key: str, default: bool) -> bool:
        value = raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(join(path, key), f"expected true or false, {self.got(value)}")
        return value

    def name(self, value: object, path: str, what: str) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(path, f"expected {what} (a non-empty string), {self.got(value)}")
        return value

    def class_name(self, value: object, path: str) -> str:
        """A Python class name, such as vLLM's ``FullAttentionSpec``."""
        if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value):
            self.fail(
                path,
                "expected a class name (a Python identifier) such as FullAttentionSpec, "
                + self.got(value),
            )
        return value

    def scale(
        self, raw: Mapping[str, Any], path: str, key: str, default: float | None
    ) -> float | None:
        """A positive, finite scale factor (an integer or a float), else ``default``."""
        value = raw.get(key)
        if value is None:
            return default
        try:
            # An integer past float's range overflows: not a finite number either.
            number = float(value) if isinstance(value, (int, float)) else math.nan
        except OverflowError:
            number = math.inf
        if isinstance(value, bool) or not math.isfinite(number) or number <= 0:
            self.fail(join(path, key), f"expected a positive finite number, {self.got(value)}")
        return number

    def choice(self, value: object, path: str, choices: tuple[str, ...]) -> str:
        if value is None:
            self.fail(path, f"missing; expected one of {' | '.join(choices)}")
        if not isinstance(value, str) or value not in choices:
            self.fail(path, f"expected one of {' | '.join(choices)}, {self.got(value)}")
        return value

    def dtype(self, value: object, path: str) -> DType:
        if value is None:
            self.fail(path, "missing; expected a dtype name such as bfloat16, float16, fp8_e4m3")
        if not isinstance(value, str):
            self.fail(path, f"expected a dtype name such as bfloat16, {self.got(value)}")
        try:
            return parse_dtype(value)
        except ValueError as exc:
            self.fail(path, str(exc))

    def mapping(
        self, value: object, path: str, allowed: tuple[str, ...], what: str
    ) -> dict[Any, Any]:
        """The mapping with its null values dropped (null means "not given")."""
        if not isinstance(value, Mapping):
            where = "" if path else " at the top level"
            self.fail(path, f"expected a mapping ({what}){where}, {self.got(value)}")
        for key in value:
            if key not in allowed:
                self.fail(join(path, key), f"unknown key; expected one of {', '.join(allowed)}")
        return {key: item for key, item in value.items() if item is not None}

    def spec_mapping(self, value: object, path: str) -> dict[Any, Any]:
        """A spec's mapping; an unknown key's error lists the keys its type takes."""
        if isinstance(value, Mapping) and value.get("type") in SPEC_TYPES:
            type_keys = STATE_SPEC_KEYS if value["type"] == "mamba" else ATTENTION_SPEC_KEYS
            for key in value:
                if key not in SPEC_KEYS:
                    allowed = ", ".join((*COMMON_SPEC_KEYS, *type_keys, SPEC_CLASS_KEY))
                    self.fail(join(path, key), f"unknown key; expected one of {allowed}")
        return self.mapping(value, path, SPEC_KEYS, "a layer spec")

    def layout(self, value: object, path: str) -> str:
        example = "such as NTHC, NHTC, KNTHD, NKTHD or NTC"
        if value is None:
            self.fail(path, f"missing; expected a layout {example}")
        if not isinstance(value, str) or not value:
            self.fail(
                path, f"expected a layout of axis letters N, T, H, K, D, C, {self.got(value)}"
            )
        layout = value.upper()
        for axis in layout:
            if axis not in LAYOUT_AXES:
                self.fail(path, f"unknown axis {axis!r} in {value!r}; axes are N, T, H, K, D, C")
            if layout.count(axis) > 1:
                self.fail(path, f"axis {axis} appears more than once in {value!r}")
        # N may be left out only by token-major tensors of one request (vLLM
        # ExampleConnector folders); dumps and live caches are checked for it where read.
        if "T" not in layout:
            self.fail(path, f"{value!r} has no T (tokens) axis")
        if "C" in layout and "D" in layout:
            self.fail(path, f"{value!r} has both C (a whole cell) and D (one K or V row)")
        if "C" not in layout and "D" not in layout:
            self.fail(path, f"{value!r} needs C (a whole cell) or D (one K or V row)")
        if "K" in layout and "D" not in layout:
            self.fail(path, f"{value!r} has K (the K/V plane) but no D (one K or V row)")
        return layout

    # Specs.
