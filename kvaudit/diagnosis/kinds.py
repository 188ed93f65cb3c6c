"""The findings of faults that move or mix KV within a request: K and V exchanged, a
slice copied over another that stays intact (duplicated, not exchanged), tokens shifted
by a few slots, a sequence that diverges from a token on, and a single element changed
(its value before and after). ``findings.diagnose_group`` claims entries for them in
its order of evidence.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

from ..compare.model import GroupComparison
from ..core.ranges import ranges
from ..locate.model import ElementChange, LocatedDifference
from .model import FaultKind, Finding
from .words import at, heads_of, layer_text, listed, make_finding, positions_of, span, tokens_of

KV_SCALE = 8.0
"""Another sequence's KV differs from the producer's by at most a few times the largest
value around it (``scaled_error``); junk bytes read as values reach far beyond."""

Claim = Callable[[Callable[[LocatedDifference], bool]], list[LocatedDifference]]
"""Takes the entries not yet explained that pass a test: they are the finding's."""


def kv_exchanged(claim: Claim, layers: Sequence[str]) -> list[Finding]:
    """Slices whose K rows hold the producer's V rows and whose V rows its K rows."""
    items = claim(lambda item: item.kv_exchanged)
    if not items:
        return []
    by_layer: dict[str, list[LocatedDifference]] = defaultdict(list)
    for item in items:
        by_layer[item.layer].append(item)
    said = [
        f"{layer} {heads_of(found)}, tokens {ranges(tokens_of(found))} ({at(positions_of(found))})"
        for layer, found in by_layer.items()
    ]
    text = (
        f"{listed(said)}: the consumer's K rows hold the producer's V rows and its V rows "
        "the producer's K rows (the K and V planes read or written the wrong way round)"
    )
    return [make_finding("kv_exchanged", text, items)]


def duplicated(
    kind: FaultKind, items: Sequence[LocatedDifference], every: Sequence[str]
) -> list[Finding]:
    """Slices holding another producer slice of the same layer (heads) or the same head
    (layers) that is itself intact at the same place: copied over, not exchanged."""
    if not items:
        return []
    where = at(positions_of(items))
    if kind == "heads_duplicated":
        pairs = sorted({(item.holds[1], item.head) for item in items})  # type: ignore[index]
        said = [f"head {pairs[0][0]} duplicated over head {pairs[0][1]}"]
        said += [f"head {source} over head {target}" for source, target in pairs[1:]]
        intact = sorted({source for source, _ in pairs})
        noun = "head" if len(intact) == 1 else "heads"
        text = (
            f"{listed(said)} ({noun} {ranges(intact)} intact), in "
            f"{layer_text([item.layer for item in items], every)} at {where}"
        )
    else:
        pairs_l = sorted({(item.holds[0], item.layer) for item in items})  # type: ignore[index]
        said = [f"{source} duplicated over {target}" for source, target in pairs_l]
        intact_l = list(dict.fromkeys(source for source, _ in pairs_l))
        text = f"{listed(said)} ({layer_text(intact_l)} intact), {heads_of(items)} at {where}"
    return [make_finding(kind, text, items)]


def shifted(group: GroupComparison, claim: Claim) -> list[Finding]:
    """The runs of tokens the shift trace found a few slots from where they belong, with
    the tokens of their blocks the shift leaves unexplained."""
    if not group.token_shifts:
        return []
    covered: set[int] = set()
    for shift in group.token_shifts:
        covered.update(range(shift.first, shift.last + 1))
        covered.update(shift.residue)
    ranged = {t for shift in group.token_shifts for t in range(shift.first, shift.last + 1)}
    items = claim(
        lambda item: (
            not item.replica
            and item.holds is None
            and all(int(t) in covered for t in item.tokens)
            and any(int(t) in ranged for t in item.tokens)
        )
    )
    if not items:
        return []
    said = []
    for shift in group.token_shifts:
        slots = "slot" if abs(shift.shift) == 1 else "slots"
        source = span(shift.first - shift.shift, shift.last - shift.shift)
        text = (
            f"by {shift.shift:+d} {slots} from token {shift.first}: "
            f"{span(shift.first, shift.last)} hold the producer's {source}"
        )
        if shift.residue:
            one = len(shift.residue) == 1
            word, verb = ("token", "holds") if one else ("tokens", "hold")
            text += f" ({word} {ranges(shift.residue)} of the same blocks {verb} other bytes)"
        said.append(text)
    where = f"{heads_of(items)} of {layer_text([i.layer for i in items], group.layers)}"
    text = f"{listed(said)}, in {where} at {at(positions_of(items))}"
    return [make_finding("tokens_shifted", text, items)]


def diverges(
    left: Sequence[LocatedDifference],
    claim: Claim,
    num_tokens: int | None,
    group: GroupComparison,
) -> list[Finding]:
    """Every token from one on differs and every layer and head differs at that token,
    the consumer holding KV there (not zeros, no NaN, values of the producer's scale),
    every token before it the producer's: the same prefix, then another sequence."""
    rows = [item for item in left if not item.replica]
    if num_tokens is None or not rows or not group.layers or group.heads < 1:
        return []
    tokens = tokens_of(rows)
    first, last = tokens[0], tokens[-1]
    if first == 0 or last != num_tokens - 1 or len(tokens) != last - first + 1:
        return []
    at_first = {(item.layer, item.head) for item in rows if first in item.tokens}
    if len(at_first) < len(set(group.layers)) * group.heads:
        return []
    if all(item.consumer_zeros for item in rows):
        return []  # never written: the tail finding's
    if any(item.nonfinite or not item.scaled_error <= KV_SCALE for item in rows):
        return []  # bytes that are no KV (junk, NaN): not another sequence's KV
    items = claim(lambda item: not item.replica)
    text = (
        f"the consumer's KV diverges from token {first}: tokens {first}-{last} of {num_tokens} "
        f"differ (every layer and head at token {first}), tokens 0-{first - 1} match "
        f"(another prompt sharing the first {first} tokens, a prefix cache hit on the wrong "
        f"sequence, or another sender's writes past token {first - 1})"
    )
    return [make_finding("diverges", text, items)]


def value_text(value: float | int) -> str:
    """A value as its dtype holds it: floats exactly (every float of 64 bits or fewer is
    one double), integers as integers."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return repr(value)
    return str(value)


def element_text(element: ElementChange) -> str:
    """``V element 5 (bfloat16): 0.125 -> -0.125``."""
    part = f"{element.part} element" if element.part else "element"
    return (
        f"{part} {element.index} ({element.dtype}): "
        f"{value_text(element.before)} -> {value_text(element.after)}"
    )


def single(kind: FaultKind, item: LocatedDifference) -> Finding:
    """One token's cell in one slice: one bit, one byte or one element changed, with the
    element's value before and after where one element holds the change."""
    place = f"{item.layer} head {item.head} token {item.tokens[0]} (position {item.position})"
    if kind == "element_changed" and item.element is not None:
        text = f"{place}, {element_text(item.element)}"
    else:
        what = "one bit of byte" if kind == "bit_flip" else "byte"
        text = f"{place}, {what} {item.first_byte} of its cell"
        if item.element is not None:
            text += f": {element_text(item.element)}"
    return make_finding(kind, text, [item])
