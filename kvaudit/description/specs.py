"""The description checker's layer specs: attention and Mamba specs, their state shapes
and TP splits, validated into ``LayerSpec``s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

from ..core.validation import MAX_BLOCK_SIZE, join
from .fields import (
    ATTENTION_SPEC_KEYS,
    SPLIT_KEYS,
    STATE_SPEC_KEYS,
    FieldChecker,
    is_list,
)
from .model import MLA_TYPES, SLIDING_TYPES, SPEC_TYPES, LayerSpec, StateSplit


class SpecChecker(FieldChecker):
    """Checks a layer spec (a group's, or a layer's merged over it) key by key."""

    def spec(self, value: object, path: str) -> LayerSpec:
        raw = self.spec_mapping(value, path)
        type_ = self.choice(raw.get("type"), join(path, "type"), SPEC_TYPES)
        self.spec_keys_for_type(raw, path, type_)
        block_size = self.field_int(raw, path, "block_size", required=True, limit=MAX_BLOCK_SIZE)
        kernel_block_size = self.field_int(raw, path, "kernel_block_size", default=block_size)
        if block_size % kernel_block_size:
            self.fail(
                join(path, "kernel_block_size"),
                f"expected a divisor of block_size ({block_size}), got {kernel_block_size}",
            )
        if type_ == "mamba":
            spec = self.state_spec(raw, path, block_size, kernel_block_size)
        else:
            spec = self.attention_spec(raw, path, type_, block_size, kernel_block_size)
        if "spec_class" in raw:
            class_name = self.class_name(raw["spec_class"], join(path, "spec_class"))
            spec = replace(spec, spec_class=class_name)
        return spec

    def spec_keys_for_type(self, raw: Mapping[str, Any], path: str, type_: str) -> None:
        for key in raw:
            if type_ == "mamba" and key in ATTENTION_SPEC_KEYS:
                self.fail(join(path, key), "not allowed for type mamba (attention types only)")
            if type_ != "mamba" and key in STATE_SPEC_KEYS:
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
        if mla and num_kv_heads != 1:
            # MLA caches one latent per token, shared by every head.
            self.fail(
                join(path, "num_kv_heads"), f"expected 1 for type {type_}, got {num_kv_heads}"
            )
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
        scale = self.scale(raw, path, "scale", None)
        k_scale = self.scale(raw, path, "k_scale", scale)
        # Without V rows there is nothing for a V scale to scale, not even scale's default.
        v_scale = self.scale(raw, path, "v_scale", scale if head_size_v else None)
        if v_scale is not None and head_size_v == 0:
            self.fail(join(path, "v_scale"), "not allowed without V rows (head_size_v is 0)")
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
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def state_spec(
        self, raw: Mapping[str, Any], path: str, block_size: int, kernel_block_size: int
    ) -> LayerSpec:
        shapes = self.shapes(raw.get("shapes"), join(path, "shapes"))
        dtypes_path = join(path, "dtypes")
        dtypes = raw.get("dtypes")
        if dtypes is None:
            self.fail(
                dtypes_path, f"missing; expected {_count(len(shapes), 'dtype name')}, one per state"
            )
        if not is_list(dtypes) or len(dtypes) != len(shapes):
            count = f"got {len(dtypes)}" if is_list(dtypes) else self.got(dtypes)
            self.fail(
                dtypes_path, f"expected {_count(len(shapes), 'dtype name')}, one per state, {count}"
            )
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

    def filled_list(self, value: object, path: str, what: str) -> Sequence[Any]:
        """A key's value that must be a non-empty list (``what`` says of what), else a
        failure that says it is missing or what it got instead."""
        if value is None:
            self.fail(path, f"missing; expected {what}")
        if not is_list(value) or not value:
            self.fail(path, f"expected {what}, {self.got(value)}")
        return cast(Sequence[Any], value)

    def shapes(self, value: object, path: str) -> tuple[tuple[int, ...], ...]:
        items = self.filled_list(
            value, path, "a non-empty list of state shapes, e.g. [[3, 4096], [64, 128, 64]]"
        )
        shapes = []
        for i, shape in enumerate(items):
            if not is_list(shape) or not shape:
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
        if not is_list(value) or len(value) != len(shapes):
            count = f"got {len(value)}" if is_list(value) else self.got(value)
            self.fail(
                path,
                f"expected {_count(len(shapes), 'entry')} {{axis, segments}}, one per state, "
                f"{count}",
            )
        splits = []
        for i, item in enumerate(value):
            item_path = f"{path}[{i}]"
            raw = self.mapping(item, item_path, SPLIT_KEYS, "axis, segments")
            ndim = len(shapes[i])
            axis_path = join(item_path, "axis")
            if "axis" not in raw:
                self.fail(axis_path, f"missing; expected an axis of state {i}, 0 to {ndim - 1}")
            axis = self.integer(raw["axis"], axis_path, 0, ndim - 1)
            segments_path = join(item_path, "segments")
            segments = self.filled_list(
                raw.get("segments"), segments_path, "a non-empty list of [local_rows, replicas]"
            )
            pairs = []
            for j, segment in enumerate(segments):
                segment_path = f"{segments_path}[{j}]"
                if not is_list(segment) or len(segment) != 2:
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


def _count(number: int, noun: str) -> str:
    """``1 dtype name``, ``2 dtype names``; ``1 entry``, ``2 entries``."""
    if number == 1:
        return f"1 {noun}"
    return f"{number} {noun[:-1]}ies" if noun.endswith("y") else f"{number} {noun}s"
