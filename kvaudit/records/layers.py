"""Layer facts: what a record keeps of each layer of a worker's description, read from the
description and from a record's JSON, and what two records' facts say differs: the scales
of quantized caches (``scale_differences``) and the field behind differing fingerprints
(``fingerprint_difference``).

Scales are description data, never checksum input: a checksum is over the stored bytes
(docs/checksum.md), so two fp8 caches of equal bytes under different scales give equal
checksums, and only these facts tell them apart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ..core.dtypes import dtype_name
from ..core.validation import Checker, join
from .model import LayerFacts, WorkerSummary

if TYPE_CHECKING:
    from ..description import CacheDescription


class WithWorkers(Protocol):
    """What the comparisons here read of a ``Record`` (which this layer cannot import):
    its workers."""

    @property
    def workers(self) -> Sequence[WorkerSummary]: ...


FACT_KEYS = ("group", "spec_class", "dtype", "head_size", "head_size_v", "k_scale", "v_scale")
"""The keys of a layer's entry in a record worker's ``layers`` (docs/cli.md, checksum)."""

LISTED_LAYERS = 8
"""At most this many layer names are listed where one side's group has layers the
other's lacks; the count of all of them is said."""


def layer_facts(description: CacheDescription) -> dict[str, LayerFacts]:
    """The facts of every layer of a description, drafter layers left out (they are
    never checksummed).

    Args:
        description: A worker's cache description.

    Returns:
        Layer name to its facts, in the description's order.

    """
    facts: dict[str, LayerFacts] = {}
    for group in description.groups:
        for entry in group.layers:
            if entry.name in description.draft_layers:
                continue
            spec = entry.spec
            if spec.is_state:
                dtype = ",".join(dtype_name(d) for d in spec.dtypes)
                facts[entry.name] = LayerFacts(group.id, spec.class_name, dtype)
                continue
            facts[entry.name] = LayerFacts(
                group.id,
                spec.class_name,
                dtype_name(spec.dtype),
                spec.head_size,
                spec.head_size_v,
                spec.k_scale,
                spec.v_scale,
            )
    return facts


def facts_to_json(facts: Mapping[str, LayerFacts]) -> dict[str, dict[str, object]]:
    """A worker's layer facts as a record's JSON holds them (a scale only where given).

    Args:
        facts: Layer name to its facts.

    Returns:
        Layer name to its entry.

    """
    out: dict[str, dict[str, object]] = {}
    for name, fact in facts.items():
        entry: dict[str, object] = {
            "group": fact.group,
            "spec_class": fact.spec_class,
            "dtype": fact.dtype,
            "head_size": fact.head_size,
            "head_size_v": fact.head_size_v,
        }
        if fact.k_scale is not None:
            entry["k_scale"] = fact.k_scale
        if fact.v_scale is not None:
            entry["v_scale"] = fact.v_scale
        out[name] = entry
    return out


def facts_from_json(reader: Checker, value: object, path: str) -> dict[str, LayerFacts]:
    """A record worker's ``layers``, validated: each entry's keys, types and ranges.

    Args:
        reader: What names the source in errors (a ``RecordReader``).
        value: The parsed ``layers`` object.
        path: Its key path.

    Returns:
        Layer name to its facts.

    Raises:
        KvauditError: An entry that is not an object, a key missing or unknown, a value
            of the wrong type, a scale that is not a positive finite number.

    """
    if not isinstance(value, Mapping):
        reader.fail(path, f"expected an object, {reader.got(value)}")
    facts: dict[str, LayerFacts] = {}
    for name, item in value.items():
        where = f"{path}[{name!r}]"
        if not isinstance(item, Mapping):
            reader.fail(where, f"expected an object, {reader.got(item)}")
        for key in FACT_KEYS[:5]:
            if key not in item:
                reader.fail(join(where, key), "missing")
        for key in item:
            if key not in FACT_KEYS:
                reader.fail(join(where, str(key)), "unknown key")
        numbers = {key: item[key] for key in ("group", "head_size", "head_size_v")}
        for key, number in numbers.items():
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                reader.fail(join(where, key), f"expected an integer from 0, {reader.got(number)}")
        texts = {key: item[key] for key in ("spec_class", "dtype")}
        for key, text in texts.items():
            if not isinstance(text, str) or not text:
                reader.fail(join(where, key), f"expected a non-empty string, {reader.got(text)}")
        scales: dict[str, float | None] = {}
        for key in ("k_scale", "v_scale"):
            scale = item.get(key)
            if scale is not None and (
                isinstance(scale, bool)
                or not isinstance(scale, (int, float))
                or not math.isfinite(scale)
                or scale <= 0
            ):
                reader.fail(
                    join(where, key), f"expected a positive finite number, {reader.got(scale)}"
                )
            scales[key] = None if scale is None else float(scale)
        facts[str(name)] = LayerFacts(
            numbers["group"],
            texts["spec_class"],
            texts["dtype"],
            numbers["head_size"],
            numbers["head_size_v"],
            scales["k_scale"],
            scales["v_scale"],
        )
    return facts


def side_facts(record: WithWorkers) -> dict[str, LayerFacts]:
    """A record's layer facts over its workers (a layer's first worker that gives it: TP
    ranks hold the same layers; PP stages, other layers)."""
    facts: dict[str, LayerFacts] = {}
    for summary in record.workers:
        for name, fact in summary.layers.items():
            facts.setdefault(name, fact)
    return facts


def _scale_text(scale: float | None) -> str:
    return "none" if scale is None else repr(float(scale))


def scale_differences(producer: WithWorkers, consumer: WithWorkers) -> list[str]:
    """Each scale that differs between the two sides' layers, one line each:
    ``scale differs: consumer k_scale 2.0, producer 1.0, model.layers.2``.

    Only layers both sides give facts of and store in one dtype are compared (a record
    without facts, written before they were kept, compares nothing; a bf16 side against
    an fp8 one holds other bytes for the same values, which ``diff --numeric`` compares
    through the scales); a scale not given counts as 1.0 (the values are the stored
    ones), so ``none`` against ``1.0`` does not differ.

    Args:
        producer: The producer's record.
        consumer: The consumer's record.

    Returns:
        The lines, layers in the consumer's order, K before V.

    """
    produced = side_facts(producer)
    lines = []
    for name, fact in side_facts(consumer).items():
        other = produced.get(name)
        if other is None or other.dtype != fact.dtype:
            continue
        for key in ("k_scale", "v_scale"):
            mine, theirs = getattr(fact, key), getattr(other, key)
            if (1.0 if mine is None else mine) != (1.0 if theirs is None else theirs):
                lines.append(
                    f"scale differs: consumer {key} {_scale_text(mine)}, producer "
                    f"{_scale_text(theirs)}, {name}"
                )
    return lines


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED_LAYERS])
    return shown if len(names) <= LISTED_LAYERS else f"{shown} ({len(names)} layers in all)"


def fingerprint_difference(producer: WithWorkers, consumer: WithWorkers, group: int) -> str | None:
    """What differs between the two sides' layers of a group, for a fingerprint that
    differs: ``dtype bfloat16 vs float8_e4m3fn``, ``head_size 128 vs 64``, ``spec_class
    ...``, the layers only one side holds; None where a side gives no facts or the facts
    show no difference (a state layer's shapes, which they do not keep).

    Args:
        producer: The producer's record.
        consumer: The consumer's record.
        group: The group id.

    Returns:
        The differences, producer's value first, joined by ``; ``; or None.

    """
    sides = [
        {name: fact for name, fact in side_facts(record).items() if fact.group == group}
        for record in (producer, consumer)
    ]
    if not sides[0] or not sides[1]:
        return None
    parts: list[str] = []
    for key in ("dtype", "spec_class", "head_size", "head_size_v"):
        pairs: dict[tuple[object, object], int] = {}
        for name, fact in sides[1].items():
            other = sides[0].get(name)
            if other is not None and getattr(other, key) != getattr(fact, key):
                pair = (getattr(other, key), getattr(fact, key))
                pairs[pair] = pairs.get(pair, 0) + 1
        parts.extend(f"{key} {left} vs {right}" for left, right in pairs)
    only_producer = [name for name in sides[0] if name not in sides[1]]
    only_consumer = [name for name in sides[1] if name not in sides[0]]
    if only_producer:
        parts.append(f"layers on the producer only: {_names(only_producer)}")
    if only_consumer:
        parts.append(f"layers on the consumer only: {_names(only_consumer)}")
    return "; ".join(parts) if parts else None
