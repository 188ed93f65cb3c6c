"""``diagnose``: the faults a diff's located differences show, each named with its evidence.

The locate step says which slices differ where; this module says what that looks like:
K and V exchanged, heads or layers exchanged (a consumer slice holds another producer
slice's bytes) or duplicated (the slice it holds is intact), a stale block (the trace
found the producer block it holds), tokens shifted by a few slots, tokens of another
place (the token trace found them), a sequence diverging from a token on, a tail never
written, NaN/Inf, zeros, a single bit, byte or element, small differences everywhere
(another dtype or kernel), and what nothing explains (the kinds that move or mix KV
within a request are worded in ``kinds``). Each
located entry is explained by the first finding, in that order, that claims it; a finding
that explains every entry of its group makes the located rows detail, not news.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from ..compare.model import (
    DiffReport,
    GroupComparison,
    LocatedDifference,
    StaleSource,
    matches_text,
)
from ..core.ranges import ranges
from .kinds import diverges, duplicated, element_text, kv_exchanged, shifted, single
from .model import FaultKind, Finding
from .words import (
    at,
    heads_of,
    layer_text,
    listed,
    make_finding,
    positions_of,
    span,
    spans,
    token_text,
    tokens_of,
    where,
)

DRIFT_SCALED_ERROR = 1 / 32
"""The largest scaled error (error over the slice's largest value) that still reads as
small differences everywhere: bf16 against fp16 is about 1/256."""

DRIFT_MIN_SLICES = 4
"""Fewer differing slices than this are never called small differences everywhere."""


def diagnose(report: DiffReport) -> dict[tuple[str, int], list[Finding]]:
    """The findings of every group of a report with located differences or a trace.

    Args:
        report: A diff or verify report, located and traced where the raw KV was read.

    Returns:
        Per ``(request, group)`` that differs, its findings, most specific first; a group
        whose blocks differ but was not located has one ``differs`` finding.

    """
    result = {}
    for request_id, gid, group in report.groups():
        if not group.differs:
            continue
        counts = [n for n in report.num_tokens.get(request_id, (None, None)) if n is not None]
        result[request_id, gid] = diagnose_group(group, min(counts) if counts else None)
    return result


def diagnose_group(group: GroupComparison, num_tokens: int | None) -> list[Finding]:
    """The findings of one differing group.

    Args:
        group: The group's comparison, located and traced.
        num_tokens: The request's tokens compared (None where unknown: no tail is named).

    Returns:
        Its findings, most specific first; each located entry is explained by one.

    """
    rows = [item for item in group.located if item.replica == 0]
    left = list(rows)

    def claim(test: Callable[[LocatedDifference], bool]) -> list[LocatedDifference]:
        taken = [item for item in left if test(item)]
        left[:] = [item for item in left if not test(item)]
        return taken

    findings: list[Finding] = kv_exchanged(claim, group.layers)
    findings += _exchanged(claim(lambda item: item.holds is not None), group)
    findings += _stale(group, claim)
    findings += shifted(group, claim)
    findings += _foreign_tokens(group, claim)
    findings += diverges(left, claim, num_tokens, group)
    findings += _tail(left, claim, num_tokens, group)
    findings += _simple(
        "nonfinite", claim(lambda item: item.nonfinite > 0), _nonfinite_text, group.layers
    )
    findings += _simple("zeros", claim(lambda item: item.consumer_zeros), _zeros_text, group.layers)
    for kind, test in (
        ("bit_flip", lambda item: len(item.tokens) == 1 and item.differing_bits == 1),
        ("byte_changed", lambda item: len(item.tokens) == 1 and item.differing_bytes == 1),
        ("element_changed", lambda item: len(item.tokens) == 1 and item.element is not None),
    ):
        findings += [single(kind, item) for item in claim(test)]
    findings += _drift(left, claim, group.layers)
    findings += _untraced(group, claim)
    findings += _replicas(group)
    if left:
        findings.append(_differs(group, claim(lambda item: True)))
    named = {
        p for finding in findings if finding.kind != "replica_differs" for p in finding.positions
    }
    unlocated = sorted(set(group.mismatched_positions) - named)
    by_layers: dict[str, list[int]] = defaultdict(list)
    for position in unlocated:
        parts = group.layer_differences.get(position)
        by_layers[layer_parts_text(parts) if parts else ""].append(position)
    for differing, positions in sorted(by_layers.items(), key=lambda item: item[1][0]):
        blocks = "the block" if len(positions) == 1 else "blocks"
        verb = "differs" if len(positions) == 1 else "differ"
        why = f": {group.not_located}" if group.not_located else ""
        if differing:
            # The records' layer sums name the layer and plane; heads and tokens need KV.
            text = (
                f"{blocks} at {at(positions)}: {differing} "
                f"(by the records' layer sums; heads and tokens not located{why})"
            )
        else:
            text = f"{blocks} at {at(positions)} {verb} (not located{why})"
        findings.append(Finding("differs", text, tuple(positions), (), (), 0))
    return findings


def layer_parts_text(parts: Sequence[tuple[int, str]]) -> str:
    """Differing layer sums in words: ``layer 2 V differs``, ``layers 0-3 K and V differ``.

    Layers with the same planes differing are named together; a whole-cell plane (``KV``
    of a fused row or a latent) names the layer alone.

    Args:
        parts: ``(layer number, plane)`` labels that differ.

    Returns:
        The text, every layer named (ranges of numbers).

    """
    planes: dict[int, set[str]] = defaultdict(set)
    for number, plane in parts:
        planes[number].add(plane)
    together: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for number in sorted(planes):
        together[tuple(sorted(planes[number]))].append(number)
    phrases = []
    for kinds, numbers in sorted(together.items(), key=lambda item: item[1][0]):
        noun = "layer" if len(numbers) == 1 else "layers"
        plane = "" if kinds == ("KV",) else " " + " and ".join(p for p in kinds if p != "KV")
        phrases.append(f"{noun} {ranges(numbers)}{plane}")
    several = len(parts) > 1
    return f"{', '.join(phrases)} {'differ' if several else 'differs'}"


def _exchanged(items: list[LocatedDifference], group: GroupComparison) -> list[Finding]:
    """Slices holding other producer slices: heads (same layer), layers (same head) or
    both exchanged, one finding each; a head or layer whose source is intact at the same
    position (its cells the producer's) was copied over, not exchanged: duplicated."""
    differing = {(item.position, item.layer, item.head) for item in group.located}
    kinds: dict[FaultKind, list[LocatedDifference]] = defaultdict(list)
    for item in items:
        layer, head = item.holds  # type: ignore[misc]
        intact = (item.position, layer, head) not in differing
        if layer == item.layer:
            kinds["heads_duplicated" if intact else "heads_exchanged"].append(item)
        elif head == item.head:
            kinds["layers_duplicated" if intact else "layers_exchanged"].append(item)
        else:
            kinds["slices_exchanged"].append(item)
    findings = []
    for kind in ("heads_duplicated", "layers_duplicated"):
        findings += duplicated(kind, kinds[kind], group.layers)  # type: ignore[arg-type]
    where = at(positions_of(items))
    if kinds["heads_exchanged"]:
        found = kinds["heads_exchanged"]
        pairs = sorted({(item.head, item.holds[1]) for item in found})  # type: ignore[index]
        said = [f"consumer head {pairs[0][0]} holds producer head {pairs[0][1]}"]
        said += [f"head {c} holds head {p}" for c, p in pairs[1:]]
        layers = layer_text([item.layer for item in found])
        text = f"{listed(said)}, in {layers} at {where}"
        findings.append(make_finding("heads_exchanged", text, found))
    if kinds["layers_exchanged"]:
        found = kinds["layers_exchanged"]
        pairs_l = sorted({(item.layer, item.holds[0]) for item in found})  # type: ignore[index]
        said = [f"consumer {c} holds producer {p}" for c, p in pairs_l]
        text = f"{listed(said)}, {heads_of(found)} at {where}"
        findings.append(make_finding("layers_exchanged", text, found))
    if kinds["slices_exchanged"]:
        found = kinds["slices_exchanged"]
        said = [
            f"consumer {item.layer} head {item.head} holds producer "
            f"{item.holds[0]} head {item.holds[1]}"  # type: ignore[index]
            for item in found
        ]
        text = f"{listed(list(dict.fromkeys(said)))}, at {where}"
        findings.append(make_finding("slices_exchanged", text, found))
    return findings


def _source_text(source: StaleSource) -> str:
    size = f" at block size {source.block_size}" if source.block_size is not None else ""
    return f"{source.request} position {source.position}{size}"


def _stale(
    group: GroupComparison, claim: Callable[[Callable[[LocatedDifference], bool]], list]
) -> list[Finding]:
    """The positions the trace found in other producer blocks: one finding. A position
    whose differing cells all hold zeros is not one: zeros match zeros anywhere, which
    says nothing of where they came from (the zeros or tail finding explains them)."""
    zeros: dict[int, bool] = {}
    for item in group.located:
        if item.replica == 0:
            zeros[item.position] = zeros.get(item.position, True) and item.consumer_zeros
    traced = {
        position: sources
        for position, sources in group.stale_sources.items()
        if sources and not zeros.get(position, False)
    }
    if not traced:
        return []
    items = claim(lambda item: item.position in traced)
    said = []
    for position, sources in sorted(traced.items()):
        finer = [s for s in sources if s.block_size is not None and s.consumer_position is not None]
        if finer:
            size = finer[0].block_size or 1
            unit = finer[0].consumer_position or 0
            said.append(
                f"position {position} tokens {unit * size}-{unit * size + size - 1} hold "
                + " or ".join(_source_text(s) for s in finer[:2])
            )
        else:
            at = [item for item in items if item.position == position]
            held = tokens_of(at)
            word = "token" if len(held) == 1 else "tokens"
            tokens = f" ({word} {ranges(held)})" if at else ""
            said.append(
                f"position {position}{tokens} holds "
                + " or ".join(_source_text(s) for s in sources[:2])
            )
        if position in group.stale_matches:
            said[-1] += f" ({matches_text(group.stale_matches[position], min(len(sources), 2))})"
    text = listed(said)
    if items:
        text += f" ({where(items, group.layers)}): a slot reused or a stale sender"
    return [make_finding("stale_block", text, items)]


def _foreign_tokens(
    group: GroupComparison, claim: Callable[[Callable[[LocatedDifference], bool]], list]
) -> list[Finding]:
    """The runs of tokens the token trace found elsewhere in the producer."""
    shifted_tokens = {t for s in group.token_shifts for t in range(s.first, s.last + 1)}
    found = [
        run
        for run in group.token_runs
        if run.sources and not set(range(run.first, run.last + 1)) <= shifted_tokens
    ]
    if not found:
        return []
    covered = {(run.position, t) for run in found for t in range(run.first, run.last + 1)}
    items = claim(
        lambda item: (
            all((item.position, int(t)) in covered for t in item.tokens)
            and any(run.position == item.position for run in found)
        )
    )
    said = []
    for run in found:
        places = " or ".join(
            f"{rid} {span(first, first + run.count - 1)}" for rid, first in run.sources[:2]
        )
        verb = "holds" if run.count == 1 else "hold"
        more = f" ({matches_text(run.matches, min(len(run.sources), 2))})" if run.matches else ""
        said.append(f"{span(run.first, run.last)} (position {run.position}) {verb} {places}{more}")
    text = listed(said)
    if items:
        text += f" ({where(items, group.layers)})"
    return [make_finding("foreign_tokens", text, items)]


def _tail(
    left: list[LocatedDifference],
    claim: Callable[[Callable[[LocatedDifference], bool]], list],
    num_tokens: int | None,
    group: GroupComparison,
) -> list[Finding]:
    """The request's last tokens differing in every slice that differs, from some token
    on to the end: KV never written past it."""
    if num_tokens is None or not left:
        return []
    tokens = tokens_of(left)
    first, last = tokens[0], tokens[-1]
    if first == 0 or last != num_tokens - 1 or len(tokens) != last - first + 1:
        return []
    if len(positions_of(left)) >= group.compared:
        return []  # every block compared differs: nothing was right before the tail
    slices = {(item.layer, item.head) for item in left}
    if len(slices) < 2 and len(left) < 2:
        return []
    by_position: dict[int, set[tuple[str, int]]] = defaultdict(set)
    for item in left:
        lo = max(first, item.position * group.block_size)
        hi = min(num_tokens, (item.position + 1) * group.block_size)
        if list(item.tokens) != list(range(lo, hi)):
            return []
        by_position[item.position].add((item.layer, item.head))
    if any(held != slices for held in by_position.values()):
        return []
    items = claim(lambda item: True)
    zeros = " and hold zeros" if all(item.consumer_zeros for item in items) else ""
    text = (
        f"tokens {first}-{last} of {num_tokens} differ in {where(items, group.layers)}{zeros}: "
        f"the KV past token {first - 1} is not the producer's (a transfer cut short, "
        "completion signalled before its last write landed, or another sender's writes)"
    )
    return [make_finding("tail_not_written", text, items)]


def _nonfinite_text(items: Sequence[LocatedDifference], layers: Sequence[str]) -> str:
    count = sum(item.nonfinite for item in items)
    noun = "element is" if count == 1 else "elements are"
    text = (
        f"{count} consumer {noun} NaN or infinite where the producer's are finite, at "
        f"{token_text(items)} in {where(items, layers)}"
    )
    if len(items) == 1 and items[0].element is not None:
        text += f": {element_text(items[0].element)}"
    return text


def _zeros_text(items: Sequence[LocatedDifference], layers: Sequence[str]) -> str:
    return f"the consumer holds zeros at {token_text(items)} in {where(items, layers)}"


def _simple(
    kind: FaultKind,
    items: list[LocatedDifference],
    text: Callable[[Sequence[LocatedDifference], Sequence[str]], str],
    layers: Sequence[str],
) -> list[Finding]:
    return [make_finding(kind, text(items, layers), items)] if items else []


def _drift(
    left: list[LocatedDifference],
    claim: Callable[[Callable[[LocatedDifference], bool]], list],
    layers: Sequence[str],
) -> list[Finding]:
    """Many slices at several positions, each differing only a little."""
    small = [
        item
        for item in left
        if item.nonfinite == 0 and item.scaled_error <= DRIFT_SCALED_ERROR and item.holds is None
    ]
    if len(small) != len(left) or len(small) < DRIFT_MIN_SLICES or len(positions_of(small)) < 2:
        return []
    items = claim(lambda item: True)
    worst = max(item.scaled_error for item in items)
    text = (
        f"{len(items)} slices at {at(positions_of(items))} "
        f"({heads_of(items)} of {layer_text([i.layer for i in items], layers)}) differ by at "
        f"most {worst:.3g} of their largest value: another dtype or kernel rather than a "
        "transfer fault; compare by value with --numeric"
    )
    return [make_finding("drift", text, items)]


def _untraced(
    group: GroupComparison, claim: Callable[[Callable[[LocatedDifference], bool]], list]
) -> list[Finding]:
    """Differing tokens of positions the trace found nowhere in the producer: the tokens
    of the entries it explains, each run of consecutive tokens with its positions (the
    runs of other entries, a NaN's explained by another finding, are not these)."""
    untraced = {p for p, sources in group.stale_sources.items() if not sources}
    items = claim(lambda item: item.position in untraced)
    if not items:
        return []
    held: dict[int, set[int]] = defaultdict(set)
    for item in items:
        held[item.position].update(int(t) for t in item.tokens)
    said = []  # runs of consecutive tokens, across positions: each place said whole
    for first, last in spans(sorted({t for tokens in held.values() for t in tokens})):
        places = sorted(p for p, tokens in held.items() if any(first <= t <= last for t in tokens))
        said.append(f"{span(first, last)} ({at(places)})")
    skipped = [
        run
        for run in group.token_runs
        if not run.traced and any(run.first <= t <= run.last for t in held.get(run.position, ()))
    ]
    what = listed(said)
    text = f"{what} differ in {where(items, group.layers)}; no producer slice holds these bytes"
    if skipped:
        text += f" ({len(skipped)} more runs of tokens were not looked for)"
    return [make_finding("untraced", text, items)]


def _replicas(group: GroupComparison) -> list[Finding]:
    """Consumer replicas that differ from their replica 0."""
    items = [item for item in group.located if item.replica]
    if not items and not group.replica_mismatches:
        return []
    keys = sorted({(r, i) for _, r, i in group.replica_mismatches})
    named = ", ".join(f"{r}:{i}" for r, i in keys) or "?"
    positions = sorted({p for p, _, _ in group.replica_mismatches})
    text = f"consumer replicas {named} differ from their replica 0 at {at(positions)}"
    if items:
        text += f" ({heads_of(items)} of {layer_text([i.layer for i in items], group.layers)})"
    if len(items) == 1 and len(items[0].tokens) == 1 and items[0].differing_bits == 1:
        item = items[0]
        text += f": one bit of byte {item.first_byte} of token {item.tokens[0]}'s cell"
    slices = tuple(sorted({(item.layer, item.head) for item in items}))
    return [
        Finding("replica_differs", text, tuple(positions), tokens_of(items), slices, len(items))
    ]


def _differs(group: GroupComparison, items: list[LocatedDifference]) -> Finding:
    """What no other finding explains: where, and the largest damage."""
    worst = max(items, key=lambda item: item.scaled_error)
    text = (
        f"{len(items)} slices differ at {token_text(items)} in {where(items, group.layers)}; "
        f"the largest scaled error {worst.scaled_error:.3g} at {worst.layer} head {worst.head}"
    )
    return make_finding("differs", text, items)
