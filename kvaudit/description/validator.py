"""The description checker: groups and layers, layer overrides and shared caches, on top
of the spec checks; ``parse_description`` validates a whole description dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import DescriptionError
from ..core.validation import check_plain, join
from .fields import GROUP_KEYS, GROUP_WIDE_KEYS, LAYER_KEYS, TOP_KEYS, is_list
from .model import (
    FORMAT_VERSION,
    SPEC_TYPES,
    CacheDescription,
    GroupDescription,
    LayerEntry,
    LayerSpec,
)
from .specs import SpecChecker


@dataclass
class _RawLayer:
    """A parsed layer with the key paths its later checks report at."""

    entry: LayerEntry
    path: str
    name_path: str
    shares_path: str


class _Validator(SpecChecker):
    """Checks a description dict key by key; every failure is one DescriptionError."""

    def description(self, data: object) -> CacheDescription:
        raw = self.mapping(data, "", TOP_KEYS, "kvaudit, num_blocks, groups, ...")
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
        if not is_list(draft_layers):
            self.fail("draft_layers", f"expected a list of layer names, {self.got(draft_layers)}")
        drafts = frozenset(
            self.name(item, f"draft_layers[{i}]", "a layer name")
            for i, item in enumerate(draft_layers)
        )
        groups_raw = raw.get("groups")
        if groups_raw is None:
            self.fail("groups", "missing; expected a non-empty list of groups")
        if not is_list(groups_raw) or not groups_raw:
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
        raw = self.mapping(
            value, path, GROUP_KEYS, "id, num_blocks, transfer, host_resident, spec, layers"
        )
        # The wire format carries group ids as u32.
        group_id = self.field_int(raw, path, "id", default=index, minimum=0, maximum=2**32 - 1)
        num_blocks = self.field_int(raw, path, "num_blocks")
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
        if not is_list(layers_raw) or not layers_raw:
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
            num_blocks=num_blocks,
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
        raw = self.mapping(value, path, LAYER_KEYS, "name, spec, shares")
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
        for key in GROUP_WIDE_KEYS:
            group_value = getattr(group_spec, key)
            # null is "not given": the group's value stays.
            if override.get(key) is not None and override[key] != group_value:
                self.fail(
                    join(path, key),
                    f"a layer cannot change its group's {key} ({group_value}); "
                    f"set it on {group_spec_path}",
                )
        merged = dict(group_spec_raw)
        for key, item in override.items():
            if item is None and key in GROUP_WIDE_KEYS:
                continue
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

    Args:
        data: The description's plain data: mappings, lists, strings and numbers.
        source: What names the description in errors (a file, a dump).

    Returns:
        The validated description.

    Raises:
        DescriptionError: One line: the source, the key path and what is expected there.

    Example:
        A cache of one full-attention layer (the keys docs/cache-description.md lists):

        >>> from kvaudit.description import parse_description
        >>> description = parse_description({
        ...     "kvaudit": 1, "num_blocks": 64, "groups": [{
        ...         "spec": {"type": "full_attention", "block_size": 16, "num_kv_heads": 8,
        ...                  "head_size": 128, "dtype": "bfloat16", "layout": "NTHC"},
        ...         "layers": ["model.layers.0.self_attn.attn"]}]}, "inline")
        >>> description.groups[0].spec.block_size, description.num_blocks
        (16, 64)
        >>> parse_description({"kvaudit": 1, "groups": []}, "inline")
        Traceback (most recent call last):
        ...
        kvaudit.core.errors.DescriptionError: inline: num_blocks: missing; expected a positive ...

    """
    check_plain(data, source, error=DescriptionError)
    return _Validator(source).description(data)
