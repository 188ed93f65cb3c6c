"""The cache description: a worker's KV cache groups, their layers, specs and layouts.

Mirrors vLLM's ``KVCacheConfig``/``KVCacheGroupSpec``/``KVCacheSpec`` (see
docs/cache-description.md). ``load_description`` reads the YAML; ``parse_description``
validates a dict (a dump's embedded JSON).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from .dtypes import dtype_name, parse_dtype
from .errors import DescriptionError
from .validation import Checker, join, short_text

ATTENTION_TYPES = (
    "full_attention",
    "sliding_window",
    "chunked_local_attention",
    "mla",
    "sliding_window_mla",
)
MLA_TYPES = ("mla", "sliding_window_mla")
SPEC_TYPES = (*ATTENTION_TYPES, "mamba")


@dataclass(frozen=True)
class StateSplit:
    """How one Mamba state is split across TP ranks: the split axis and its segments.

    Each segment is ``(local_rows, replicas)``: this worker's rows of the segment along
    ``axis``, and how many consecutive ranks hold the same rows.
    """

    axis: int
    segments: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's cache holds and how its tensor is laid out (a group's spec,
    with a layer's overrides merged over it)."""

    type: str
    block_size: int
    kernel_block_size: int
    num_kv_heads: int = 1
    head_size: int = 0
    head_size_v: int = 0
    dtype: torch.dtype = torch.bfloat16
    layout: str = "NTHC"
    sliding_window: int | None = None
    max_tp_shards: int | None = None
    # chunked_local_attention only: tokens per attention chunk, where known.
    attention_chunk_size: int | None = None
    # Mamba only.
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    checksummed_states: int | None = None
    tp_replicated: bool = False
    state_splits: tuple[StateSplit, ...] | None = None

    @property
    def is_state(self) -> bool:
        return self.type == "mamba"

    @property
    def is_mla(self) -> bool:
        return self.type in MLA_TYPES

    def axis_sizes(self, *, kernel_blocks: int = 1, tokens: int | None = None) -> dict[str, int]:
        """The size of each layout letter (docs/cache-description.md, "Layouts"):
        ``kernel_blocks`` along N, ``tokens`` along T (default: a kernel block's)."""
        return {
            "N": kernel_blocks,
            "T": self.kernel_block_size if tokens is None else tokens,
            "H": self.num_kv_heads,
            "K": 2,
            "D": self.head_size,
            "C": self.head_size + self.head_size_v,
        }

    @property
    def covered_states(self) -> int:
        """How many leading Mamba states are checksummed."""
        if self.checksummed_states is None:
            return len(self.shapes)
        return self.checksummed_states


@dataclass(frozen=True)
class LayerEntry:
    """One layer of a group: its name, merged spec, and the layer whose cache it aliases."""

    name: str
    spec: LayerSpec
    shares: str | None = None


@dataclass(frozen=True)
class GroupDescription:
    """A KV cache group: layers that share one block table and block size."""

    id: int
    spec: LayerSpec
    layers: tuple[LayerEntry, ...]
    transfer: bool = True
    host_resident: bool = False

    @property
    def block_size(self) -> int:
        return self.spec.block_size


@dataclass(frozen=True)
class CacheDescription:
    """A worker's whole KV cache description."""

    num_blocks: int
    groups: tuple[GroupDescription, ...]
    model_kv_heads: int | None = None
    draft_layers: frozenset[str] = field(default_factory=frozenset)
    # Where it was read from, for error messages; not part of what the description says.
    source: str = field(default="<description>", compare=False)

    def group(self, group_id: int) -> GroupDescription:
        for group in self.groups:
            if group.id == group_id:
                return group
        raise KeyError(group_id)


FORMAT_VERSION = 1
"""The description format version a description's ``kvaudit`` key must give."""

LAYOUT_AXES = "NTHKDC"
"""The axis letters of a layout (see docs/cache-description.md, "Layouts")."""

SLIDING_TYPES = ("sliding_window", "sliding_window_mla")

_TOP_KEYS = ("kvaudit", "num_blocks", "model_kv_heads", "draft_layers", "groups")
_GROUP_KEYS = ("id", "transfer", "host_resident", "spec", "layers")
_LAYER_KEYS = ("name", "spec", "shares")
_SPLIT_KEYS = ("axis", "segments")
_COMMON_SPEC_KEYS = ("type", "block_size", "kernel_block_size")
_ATTENTION_SPEC_KEYS = (
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "dtype",
    "layout",
    "sliding_window",
    "attention_chunk_size",
    "max_tp_shards",
)
_STATE_SPEC_KEYS = ("shapes", "dtypes", "checksummed_states", "tp_replicated", "state_splits")
_SPEC_KEYS = (*_COMMON_SPEC_KEYS, *_ATTENTION_SPEC_KEYS, *_STATE_SPEC_KEYS)
# Spec keys a layer may not set to another value than its group's.
_GROUP_WIDE_KEYS = ("block_size", "kernel_block_size")


def _integer_kind(minimum: int, maximum: int | None) -> str:
    if maximum is not None:
        return f"an integer from {minimum} to {maximum}"
    if minimum == 1:
        return "a positive integer"
    if minimum == 0:
        return "a non-negative integer"
    return f"an integer of at least {minimum}"


def _is_list(value: object) -> bool:
    return isinstance(value, (list, tuple))


@dataclass
class _RawLayer:
    """A parsed layer with the key paths its later checks report at."""

    entry: LayerEntry
    path: str
    name_path: str
    shares_path: str


class _Validator(Checker):
    """Checks a description dict key by key; every failure is one DescriptionError."""

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
        self, value: object, path: str, minimum: int = 1, maximum: int | None = None
    ) -> int:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            self.fail(path, f"expected {_integer_kind(minimum, maximum)}, {self.got(value)}")
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
    ) -> int | None:
        value = raw.get(key)
        if value is None:
            if required:
                self.fail(join(path, key), f"missing; expected {_integer_kind(minimum, maximum)}")
            return default
        return self.integer(value, join(path, key), minimum, maximum)

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

    def choice(self, value: object, path: str, choices: tuple[str, ...]) -> str:
        if value is None:
            self.fail(path, f"missing; expected one of {' | '.join(choices)}")
        if not isinstance(value, str) or value not in choices:
            self.fail(path, f"expected one of {' | '.join(choices)}, {self.got(value)}")
        return value

    def dtype(self, value: object, path: str) -> torch.dtype:
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
            type_keys = _STATE_SPEC_KEYS if value["type"] == "mamba" else _ATTENTION_SPEC_KEYS
            for key in value:
                if key not in _SPEC_KEYS:
                    allowed = ", ".join((*_COMMON_SPEC_KEYS, *type_keys))
                    self.fail(join(path, key), f"unknown key; expected one of {allowed}")
        return self.mapping(value, path, _SPEC_KEYS, "a layer spec")

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

    def spec(self, value: object, path: str) -> LayerSpec:
        raw = self.spec_mapping(value, path)
        type_ = self.choice(raw.get("type"), join(path, "type"), SPEC_TYPES)
        self.spec_keys_for_type(raw, path, type_)
        block_size = self.field_int(raw, path, "block_size", required=True)
        kernel_block_size = self.field_int(raw, path, "kernel_block_size", default=block_size)
        if block_size % kernel_block_size:
            self.fail(
                join(path, "kernel_block_size"),
                f"expected a divisor of block_size ({block_size}), got {kernel_block_size}",
            )
        if type_ == "mamba":
            return self.state_spec(raw, path, block_size, kernel_block_size)
        return self.attention_spec(raw, path, type_, block_size, kernel_block_size)

    def spec_keys_for_type(self, raw: Mapping[str, Any], path: str, type_: str) -> None:
        for key in raw:
            if type_ == "mamba" and key in _ATTENTION_SPEC_KEYS:
                self.fail(join(path, key), "not allowed for type mamba (attention types only)")
            if type_ != "mamba" and key in _STATE_SPEC_KEYS:
                self.fail(join(path, key), f"not allowed for type {type_} (mamba only)")
            if key == "sliding_window" and type_ not in SLIDING_TYPES:
                self.fail(
                    join(path, key),
                    f"not allowed for type {type_} (sliding_window and sliding_window_mla only)",
                )
            if key == "attention_chunk_size" and type_ != "chunked_local_attention":
                self.fail(
                    join(path, key),
                    f"not allowed for type {type_} (chunked_local_attention only)",
                )

    def attention_spec(
        self,
        raw: Mapping[str, Any],
        path: str,
        type_: str,
        block_size: int,
        kernel_block_size: int,
    ) -> LayerSpec:
        mla = type_ in MLA_TYPES
        num_kv_heads = self.field_int(raw, path, "num_kv_heads", required=not mla, default=1)
        head_size = self.field_int(raw, path, "head_size", required=True)
        head_size_v = self.field_int(
            raw, path, "head_size_v", minimum=0, default=0 if mla else head_size
        )
        dtype = self.dtype(raw.get("dtype"), join(path, "dtype"))
        layout = self.layout(raw.get("layout"), join(path, "layout"))
        sliding_window = self.field_int(
            raw, path, "sliding_window", required=type_ in SLIDING_TYPES
        )
        attention_chunk_size = self.field_int(raw, path, "attention_chunk_size")
        max_tp_shards = self.field_int(raw, path, "max_tp_shards")
        if "K" in layout and head_size_v != head_size:
            default = "" if "head_size_v" in raw else " (the default)"
            self.fail(
                join(path, "head_size_v"),
                f"expected {head_size} (head_size): layout {layout} keeps K and V rows on one "
                f"D axis, got {head_size_v}{default}",
            )
        if "H" not in layout and num_kv_heads != 1:
            self.fail(
                join(path, "layout"),
                f"{layout} has no H axis, so it holds one head, but num_kv_heads is {num_kv_heads}",
            )
        return LayerSpec(
            type=type_,
            block_size=block_size,
            kernel_block_size=kernel_block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            head_size_v=head_size_v,
            dtype=dtype,
            layout=layout,
            sliding_window=sliding_window,
            max_tp_shards=max_tp_shards,
            attention_chunk_size=attention_chunk_size,
        )

    def state_spec(
        self, raw: Mapping[str, Any], path: str, block_size: int, kernel_block_size: int
    ) -> LayerSpec:
        shapes = self.shapes(raw.get("shapes"), join(path, "shapes"))
        dtypes_path = join(path, "dtypes")
        dtypes = raw.get("dtypes")
        if dtypes is None:
            self.fail(dtypes_path, f"missing; expected {len(shapes)} dtype names, one per state")
        if not _is_list(dtypes) or len(dtypes) != len(shapes):
            count = f"got {len(dtypes)}" if _is_list(dtypes) else self.got(dtypes)
            self.fail(dtypes_path, f"expected {len(shapes)} dtype names, one per state, {count}")
        state_dtypes = tuple(
            self.dtype(item, f"{dtypes_path}[{i}]") for i, item in enumerate(dtypes)
        )
        checksummed_states = self.field_int(
            raw, path, "checksummed_states", minimum=0, maximum=len(shapes)
        )
        tp_replicated = self.boolean(raw, path, "tp_replicated", False)
        state_splits = None
        if "state_splits" in raw:
            state_splits = self.state_splits(
                raw["state_splits"], join(path, "state_splits"), shapes
            )
        return LayerSpec(
            type="mamba",
            block_size=block_size,
            kernel_block_size=kernel_block_size,
            shapes=shapes,
            dtypes=state_dtypes,
            checksummed_states=checksummed_states,
            tp_replicated=tp_replicated,
            state_splits=state_splits,
        )

    def shapes(self, value: object, path: str) -> tuple[tuple[int, ...], ...]:
        what = "a non-empty list of state shapes, e.g. [[3, 4096], [64, 128, 64]]"
        if value is None:
            self.fail(path, f"missing; expected {what}")
        if not _is_list(value) or not value:
            self.fail(path, f"expected {what}, {self.got(value)}")
        shapes = []
        for i, shape in enumerate(value):
            if not _is_list(shape) or not shape:
                self.fail(
                    f"{path}[{i}]",
                    f"expected a non-empty list of positive integers, {self.got(shape)}",
                )
            shapes.append(
                tuple(self.integer(dim, f"{path}[{i}][{j}]") for j, dim in enumerate(shape))
            )
        return tuple(shapes)

    def state_splits(
        self, value: object, path: str, shapes: tuple[tuple[int, ...], ...]
    ) -> tuple[StateSplit, ...]:
        if not _is_list(value) or len(value) != len(shapes):
            count = f"got {len(value)}" if _is_list(value) else self.got(value)
            self.fail(
                path,
                f"expected {len(shapes)} entries {{axis, segments}}, one per state, {count}",
            )
        splits = []
        for i, item in enumerate(value):
            item_path = f"{path}[{i}]"
            raw = self.mapping(item, item_path, _SPLIT_KEYS, "axis, segments")
            ndim = len(shapes[i])
            axis_path = join(item_path, "axis")
            if "axis" not in raw:
                self.fail(axis_path, f"missing; expected an axis of state {i}, 0 to {ndim - 1}")
            axis = self.integer(raw["axis"], axis_path, 0, ndim - 1)
            segments_path = join(item_path, "segments")
            segments = raw.get("segments")
            what = "a non-empty list of [local_rows, replicas]"
            if segments is None:
                self.fail(segments_path, f"missing; expected {what}")
            if not _is_list(segments) or not segments:
                self.fail(segments_path, f"expected {what}, {self.got(segments)}")
            pairs = []
            for j, segment in enumerate(segments):
                segment_path = f"{segments_path}[{j}]"
                if not _is_list(segment) or len(segment) != 2:
                    self.fail(
                        segment_path,
                        "expected [local_rows, replicas], two positive integers, "
                        + self.got(segment),
                    )
                pairs.append(
                    (
                        self.integer(segment[0], f"{segment_path}[0]"),
                        self.integer(segment[1], f"{segment_path}[1]"),
                    )
                )
            splits.append(StateSplit(axis=axis, segments=tuple(pairs)))
        return tuple(splits)

    # Groups and layers.

    def description(self, data: object) -> CacheDescription:
        raw = self.mapping(data, "", _TOP_KEYS, "kvaudit, num_blocks, groups, ...")
        version = raw.get("kvaudit")
        if version is None:
            self.fail(
                "kvaudit", f"missing; expected {FORMAT_VERSION}, the description format version"
            )
        if type(version) is not int or version != FORMAT_VERSION:
            self.fail(
                "kvaudit",
                f"expected {FORMAT_VERSION} (the description format version), {self.got(version)}",
            )
        num_blocks = self.field_int(raw, "", "num_blocks", required=True)
        model_kv_heads = self.field_int(raw, "", "model_kv_heads")
        draft_layers = raw.get("draft_layers", [])
        if not _is_list(draft_layers):
            self.fail("draft_layers", f"expected a list of layer names, {self.got(draft_layers)}")
        drafts = frozenset(
            self.name(item, f"draft_layers[{i}]", "a layer name")
            for i, item in enumerate(draft_layers)
        )
        groups_raw = raw.get("groups")
        if groups_raw is None:
            self.fail("groups", "missing; expected a non-empty list of groups")
        if not _is_list(groups_raw) or not groups_raw:
            self.fail("groups", f"expected a non-empty list of groups, {self.got(groups_raw)}")
        groups: list[GroupDescription] = []
        layers: dict[str, _RawLayer] = {}
        id_paths: dict[int, str] = {}
        for index, group_raw in enumerate(groups_raw):
            group = self.group(group_raw, f"groups[{index}]", index, layers)
            if group.id in id_paths:
                self.fail(
                    f"groups[{index}].id",
                    f"id {group.id} is already the id of {id_paths[group.id]}",
                )
            id_paths[group.id] = f"groups[{index}]"
            groups.append(group)
        self.check_shares(layers)
        return CacheDescription(
            num_blocks=num_blocks,
            groups=tuple(groups),
            model_kv_heads=model_kv_heads,
            draft_layers=drafts,
            source=self.source,
        )

    def group(
        self, value: object, path: str, index: int, layers: dict[str, _RawLayer]
    ) -> GroupDescription:
        raw = self.mapping(value, path, _GROUP_KEYS, "id, transfer, host_resident, spec, layers")
        # The wire format carries group ids as u32.
        group_id = self.field_int(raw, path, "id", default=index, minimum=0, maximum=2**32 - 1)
        transfer = self.boolean(raw, path, "transfer", True)
        host_resident = self.boolean(raw, path, "host_resident", False)
        spec_path = join(path, "spec")
        if "spec" not in raw:
            self.fail(spec_path, "missing; expected the group's layer spec (a mapping)")
        spec = self.spec(raw["spec"], spec_path)
        layers_path = join(path, "layers")
        layers_raw = raw.get("layers")
        if layers_raw is None:
            self.fail(layers_path, "missing; expected a non-empty list of layers")
        if not _is_list(layers_raw) or not layers_raw:
            self.fail(layers_path, f"expected a non-empty list of layers, {self.got(layers_raw)}")
        entries = []
        for i, layer_raw in enumerate(layers_raw):
            layer = self.layer(layer_raw, f"{layers_path}[{i}]", raw["spec"], spec, spec_path)
            if layer.entry.name in layers:
                self.fail(
                    layer.name_path,
                    f"layer {layer.entry.name!r} is already listed at "
                    f"{layers[layer.entry.name].path}",
                )
            layers[layer.entry.name] = layer
            entries.append(layer.entry)
        return GroupDescription(
            id=group_id,
            spec=spec,
            layers=tuple(entries),
            transfer=transfer,
            host_resident=host_resident,
        )

    def layer(
        self,
        value: object,
        path: str,
        group_spec_raw: Mapping[str, Any],
        group_spec: LayerSpec,
        group_spec_path: str,
    ) -> _RawLayer:
        if isinstance(value, str):
            name = self.name(value, path, "a layer name")
            return _RawLayer(LayerEntry(name, group_spec), path, path, path)
        if not isinstance(value, Mapping):
            self.fail(
                path, f"expected a layer name or a mapping (name, spec, shares), {self.got(value)}"
            )
        raw = self.mapping(value, path, _LAYER_KEYS, "name, spec, shares")
        name_path = join(path, "name")
        if "name" not in raw:
            self.fail(name_path, "missing; expected the layer's name")
        name = self.name(raw["name"], name_path, "a layer name")
        spec = group_spec
        if "spec" in raw:
            spec_path = join(path, "spec")
            override = raw["spec"]
            if not isinstance(override, Mapping):
                self.fail(
                    spec_path, f"expected a mapping of spec keys to override, {self.got(override)}"
                )
            merged = self.merge(override, spec_path, group_spec_raw, group_spec, group_spec_path)
            spec = self.spec(merged, spec_path)
        shares_path = join(path, "shares")
        shares = None
        if "shares" in raw:
            shares = self.name(raw["shares"], shares_path, "the name of the layer it shares")
        return _RawLayer(LayerEntry(name, spec, shares), path, name_path, shares_path)

    def merge(
        self,
        override: Mapping[Any, Any],
        path: str,
        group_spec_raw: Mapping[str, Any],
        group_spec: LayerSpec,
        group_spec_path: str,
    ) -> dict[Any, Any]:
        """The group's spec dict with a layer's override over it; null removes a key."""
        new_type = override.get("type")
        if new_type is not None:
            new_type = self.choice(new_type, join(path, "type"), SPEC_TYPES)
            if (new_type == "mamba") != group_spec.is_state:
                self.fail(
                    join(path, "type"),
                    f"a layer cannot change its group's type {group_spec.type} to {new_type}: "
                    "mamba and attention layers go in different groups",
                )
        for key in _GROUP_WIDE_KEYS:
            group_value = getattr(group_spec, key)
            if key in override and override[key] != group_value:
                self.fail(
                    join(path, key),
                    f"a layer cannot change its group's {key} ({group_value}); "
                    f"set it on {group_spec_path}",
                )
        merged = dict(group_spec_raw)
        for key, item in override.items():
            if item is None:
                merged.pop(key, None)
            else:
                merged[key] = item
        return merged

    def check_shares(self, layers: Mapping[str, _RawLayer]) -> None:
        for layer in layers.values():
            target_name = layer.entry.shares
            if target_name is None:
                continue
            target = layers.get(target_name)
            if target is None:
                self.fail(layer.shares_path, f"no layer named {target_name!r} in the description")
            if target is layer:
                self.fail(layer.shares_path, "a layer cannot share its own cache")
            if target.entry.shares is not None:
                self.fail(
                    layer.shares_path,
                    f"{target_name!r} itself shares {target.entry.shares!r}; "
                    "name the layer that owns the cache",
                )


def parse_description(data: Mapping[str, Any], source: str) -> CacheDescription:
    """Validate a description dict (from YAML or a dump's JSON) into a ``CacheDescription``.

    Raises:
        DescriptionError: One line: the source, the key path and what is expected there.

    """
    return _Validator(source).description(data)


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


def _spec_to_dict(spec: LayerSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": spec.type,
        "block_size": spec.block_size,
        "kernel_block_size": spec.kernel_block_size,
    }
    if spec.is_state:
        out["shapes"] = [list(shape) for shape in spec.shapes]
        out["dtypes"] = [dtype_name(dtype) for dtype in spec.dtypes]
        if spec.checksummed_states is not None:
            out["checksummed_states"] = spec.checksummed_states
        out["tp_replicated"] = spec.tp_replicated
        if spec.state_splits is not None:
            out["state_splits"] = [
                {"axis": split.axis, "segments": [list(segment) for segment in split.segments]}
                for split in spec.state_splits
            ]
        return out
    out["num_kv_heads"] = spec.num_kv_heads
    out["head_size"] = spec.head_size
    out["head_size_v"] = spec.head_size_v
    out["dtype"] = dtype_name(spec.dtype)
    out["layout"] = spec.layout
    optional: dict[str, int | None] = {
        "sliding_window": spec.sliding_window,
        "attention_chunk_size": spec.attention_chunk_size,
        "max_tp_shards": spec.max_tp_shards,
    }
    out.update({key: value for key, value in optional.items() if value is not None})
    return out


def _layer_to_dict(layer: LayerEntry, group_spec: dict[str, Any]) -> str | dict[str, Any]:
    spec = _spec_to_dict(layer.spec)
    override: dict[str, Any] = {
        key: value for key, value in spec.items() if group_spec.get(key) != value
    }
    # Null in an override removes a key the group's spec sets.
    override.update({key: None for key in group_spec if key not in spec})
    if not override and layer.shares is None:
        return layer.name
    out: dict[str, Any] = {"name": layer.name}
    if override:
        out["spec"] = override
    if layer.shares is not None:
        out["shares"] = layer.shares
    return out


def description_to_dict(description: CacheDescription) -> dict[str, Any]:
    """A plain JSON-able dict of a description that ``parse_description`` reads back equal.

    A layer whose spec differs from its group's lists only the keys that differ.
    """
    out: dict[str, Any] = {"kvaudit": FORMAT_VERSION, "num_blocks": description.num_blocks}
    if description.model_kv_heads is not None:
        out["model_kv_heads"] = description.model_kv_heads
    if description.draft_layers:
        out["draft_layers"] = sorted(description.draft_layers)
    groups = []
    for group in description.groups:
        group_spec = _spec_to_dict(group.spec)
        groups.append(
            {
                "id": group.id,
                "transfer": group.transfer,
                "host_resident": group.host_resident,
                "spec": group_spec,
                "layers": [_layer_to_dict(layer, group_spec) for layer in group.layers],
            }
        )
    out["groups"] = groups
    return out
