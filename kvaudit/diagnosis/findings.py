"""``diagnose``: the faults a diff's located differences show, each named with its evidence.

The locate step says which slices differ where; this module says what that looks like:
heads or layers exchanged (a consumer slice holds another producer slice's bytes), a
stale block (the trace found the producer block it holds), tokens of another place (the
token trace found them), a tail never written, NaN/Inf, zeros, a single bit or byte,
small differences everywhere (another dtype or kernel), and what nothing explains. Each
located entry is explained by the first finding, in that order, that claims it; a finding
that explains every entry of its group makes the located rows detail, not news.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from ..compare.model import (
    DiffReport,
    GroupComparison,
    LocatedDifference,
    StaleSource,
    matches_text,
)
from ..core.ranges import ranges
from .model import FaultKind, Finding

DRIFT_SCALED_ERROR = 1 / 32
"""The largest scaled error (error over the slice's largest value) that still reads as
small differences everywhere: bf16 against fp16 is about 1/256."""

DRIFT_MIN_SLICES = 4
"""Fewer differing slices than this are never called small differences everywhere."""

SHOWN = 4
"""At most this many items (head pairs, positions, sources) are spelled out in a line."""


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

    findings: list[Finding] = []
    findings += _exchanged(claim(lambda item: item.holds is not None))
    findings += _stale(group, claim)
    findings += _foreign_tokens(group, claim)
    findings += _tail(left, claim, num_tokens, group)
    findings += _simple(
        "nonfinite", claim(lambda item: item.nonfinite > 0), _nonfinite_text, group.layers
    )
    findings += _simple("zeros", claim(lambda item: item.consumer_zeros), _zeros_text, group.layers)
    for kind, test in (
        ("bit_flip", lambda item: len(item.tokens) == 1 and item.differing_bits == 1),
        ("byte_changed", lambda item: len(item.tokens) == 1 and item.differing_bytes == 1),
    ):
        findings += [_single(kind, item) for item in claim(test)]
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
    for where, positions in sorted(by_layers.items(), key=lambda item: item[1][0]):
        blocks = "the block" if len(positions) == 1 else "blocks"
        verb = "differs" if len(positions) == 1 else "differ"
        why = f": {group.not_located}" if group.not_located else ""
        if where:
            # The records' layer sums name the layer and plane; heads and tokens need KV.
            text = (
                f"{blocks} at {_at(positions)}: {where} "
                f"(by the records' layer sums; heads and tokens not located{why})"
            )
        else:
            text = f"{blocks} at {_at(positions)} {verb} (not located{why})"
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


def layer_text(names: Sequence[str], every: Sequence[str] = ()) -> str:
    """Layer names in short: ``every layer``, one name, or names that differ in one number
    as ``model.layers.{0-3}.attn``; else the first names and how many more.

    Args:
        names: The layers named (repeats once).
        every: The group's layers, where known: all of them read as ``every layer``.

    Returns:
        The text.

    """
    unique = list(dict.fromkeys(names))
    if len(every) > 1 and set(unique) == set(every):
        return "every layer"
    if len(unique) == 1:
        return unique[0]
    parts = [re.split(r"(\d+)", name) for name in unique]
    if len({len(p) for p in parts}) == 1:
        varying = [k for k in range(len(parts[0])) if len({p[k] for p in parts}) > 1]
        if len(varying) == 1 and varying[0] % 2 == 1:
            k = varying[0]
            numbers = ranges(int(p[k]) for p in parts)
            return "".join(parts[0][:k]) + "{" + numbers + "}" + "".join(parts[0][k + 1 :])
    shown = ", ".join(unique[:2])
    return shown if len(unique) <= 2 else f"{shown} and {len(unique) - 2} more layers"


def heads_text(heads: Iterable[int]) -> str:
    """``head 5`` or ``heads 2-3, 6``.

    Args:
        heads: The heads named (repeats once).

    Returns:
        The text.

    """
    unique = sorted(set(heads))
    return f"head {unique[0]}" if len(unique) == 1 else f"heads {ranges(unique)}"


def _heads(items: Sequence[LocatedDifference]) -> str:
    return heads_text(item.head for item in items)


def _where(items: Sequence[LocatedDifference], layers: Sequence[str] = ()) -> str:
    """``heads 2-3 of model.layers.{0-3}.attn, consumer worker tp 1 pp 0``."""
    text = f"{_heads(items)} of {layer_text([item.layer for item in items], layers)}"
    workers = {item.consumer_worker for item in items}
    if len(workers) == 1 and None not in workers:
        tp, pp = next(iter(workers))  # type: ignore[misc]
        text += f", consumer worker tp {tp} pp {pp}"
    return text


def _span(first: int, last: int) -> str:
    """``token 41`` or ``tokens 41-47``."""
    return f"token {first}" if first == last else f"tokens {first}-{last}"


def _at(positions: Sequence[int]) -> str:
    """``position 4`` or ``positions 0-6``."""
    return f"{'position' if len(set(positions)) == 1 else 'positions'} {ranges(positions)}"


def _positions(items: Sequence[LocatedDifference]) -> tuple[int, ...]:
    return tuple(sorted({item.position for item in items}))


def _tokens(items: Sequence[LocatedDifference]) -> tuple[int, ...]:
    return tuple(sorted({int(t) for item in items for t in item.tokens}))


def _finding(kind: FaultKind, text: str, items: Sequence[LocatedDifference]) -> Finding:
    slices = tuple(sorted({(item.layer, item.head) for item in items}))
    return Finding(kind, text, _positions(items), _tokens(items), slices, len(items))


def _listed(parts: Sequence[str]) -> str:
    shown = ", ".join(parts[:SHOWN])
    return shown if len(parts) <= SHOWN else f"{shown} and {len(parts) - SHOWN} more"


def _exchanged(items: list[LocatedDifference]) -> list[Finding]:
    """Slices holding other producer slices: heads (same layer), layers (same head) or
    both exchanged, one finding each."""
    kinds: dict[FaultKind, list[LocatedDifference]] = defaultdict(list)
    for item in items:
        layer, head = item.holds  # type: ignore[misc]
        if layer == item.layer:
            kinds["heads_exchanged"].append(item)
        elif head == item.head:
            kinds["layers_exchanged"].append(item)
        else:
            kinds["slices_exchanged"].append(item)
    findings = []
    where = _at(_positions(items))
    if kinds["heads_exchanged"]:
        found = kinds["heads_exchanged"]
        pairs = sorted({(item.head, item.holds[1]) for item in found})  # type: ignore[index]
        said = [f"consumer head {pairs[0][0]} holds producer head {pairs[0][1]}"]
        said += [f"head {c} holds head {p}" for c, p in pairs[1:]]
        layers = layer_text([item.layer for item in found])
        text = f"{_listed(said)}, in {layers} at {where}"
        findings.append(_finding("heads_exchanged", text, found))
    if kinds["layers_exchanged"]:
        found = kinds["layers_exchanged"]
        pairs_l = sorted({(item.layer, item.holds[0]) for item in found})  # type: ignore[index]
        said = [f"consumer {c} holds producer {p}" for c, p in pairs_l]
        text = f"{_listed(said)}, {_heads(found)} at {where}"
        findings.append(_finding("layers_exchanged", text, found))
    if kinds["slices_exchanged"]:
        found = kinds["slices_exchanged"]
        said = [
            f"consumer {item.layer} head {item.head} holds producer "
            f"{item.holds[0]} head {item.holds[1]}"  # type: ignore[index]
            for item in found
        ]
        text = f"{_listed(list(dict.fromkeys(said)))}, at {where}"
        findings.append(_finding("slices_exchanged", text, found))
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
            held = _tokens(at)
            word = "token" if len(held) == 1 else "tokens"
            tokens = f" ({word} {ranges(held)})" if at else ""
            said.append(
                f"position {position}{tokens} holds "
                + " or ".join(_source_text(s) for s in sources[:2])
            )
        if position in group.stale_matches:
            said[-1] += f" ({matches_text(group.stale_matches[position], min(len(sources), 2))})"
    text = _listed(said)
    if items:
        text += f" ({_where(items, group.layers)}): a slot reused or a stale sender"
    return [_finding("stale_block", text, items)]


def _foreign_tokens(
    group: GroupComparison, claim: Callable[[Callable[[LocatedDifference], bool]], list]
) -> list[Finding]:
    """The runs of tokens the token trace found elsewhere in the producer."""
    found = [run for run in group.token_runs if run.sources]
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
            f"{rid} {_span(first, first + run.count - 1)}" for rid, first in run.sources[:2]
        )
        verb = "holds" if run.count == 1 else "hold"
        more = f" ({matches_text(run.matches, min(len(run.sources), 2))})" if run.matches else ""
        said.append(f"{_span(run.first, run.last)} (position {run.position}) {verb} {places}{more}")
    text = _listed(said)
    if items:
        text += f" ({_where(items, group.layers)})"
    return [_finding("foreign_tokens", text, items)]


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
    tokens = _tokens(left)
    first, last = tokens[0], tokens[-1]
    if first == 0 or last != num_tokens - 1 or len(tokens) != last - first + 1:
        return []
    if len(_positions(left)) >= group.compared:
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
        f"tokens {first}-{last} of {num_tokens} differ in {_where(items, group.layers)}{zeros}: "
        f"the KV past token {first - 1} is not the producer's (a transfer cut short, "
        "completion signalled before its last write landed, or another sender's writes)"
    )
    return [_finding("tail_not_written", text, items)]


def _token_text(items: Sequence[LocatedDifference]) -> str:
    tokens = _tokens(items)
    word = "token" if len(tokens) == 1 else "tokens"
    return f"{word} {ranges(tokens)} ({_at(_positions(items))})"


def _nonfinite_text(items: Sequence[LocatedDifference], layers: Sequence[str]) -> str:
    count = sum(item.nonfinite for item in items)
    noun = "element is" if count == 1 else "elements are"
    return (
        f"{count} consumer {noun} NaN or infinite where the producer's are finite, at "
        f"{_token_text(items)} in {_where(items, layers)}"
    )


def _zeros_text(items: Sequence[LocatedDifference], layers: Sequence[str]) -> str:
    return f"the consumer holds zeros at {_token_text(items)} in {_where(items, layers)}"


def _simple(
    kind: FaultKind,
    items: list[LocatedDifference],
    text: Callable[[Sequence[LocatedDifference], Sequence[str]], str],
    layers: Sequence[str],
) -> list[Finding]:
    return [_finding(kind, text(items, layers), items)] if items else []


def _single(kind: FaultKind, item: LocatedDifference) -> Finding:
    """One token's cell in one slice, one bit or byte changed."""
    what = "one bit of byte" if kind == "bit_flip" else "byte"
    text = (
        f"{item.layer} head {item.head} token {item.tokens[0]} (position {item.position}), "
        f"{what} {item.first_byte} of its cell"
    )
    return _finding(kind, text, [item])


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
    if len(small) != len(left) or len(small) < DRIFT_MIN_SLICES or len(_positions(small)) < 2:
        return []
    items = claim(lambda item: True)
    worst = max(item.scaled_error for item in items)
    text = (
        f"{len(items)} slices at {_at(_positions(items))} "
        f"({_heads(items)} of {layer_text([i.layer for i in items], layers)}) differ by at "
        f"most {worst:.3g} of their largest value: another dtype or kernel rather than a "
        "transfer fault; compare by value with --numeric"
    )
    return [_finding("drift", text, items)]


def _untraced(
    group: GroupComparison, claim: Callable[[Callable[[LocatedDifference], bool]], list]
) -> list[Finding]:
    """Differing tokens of positions the trace found nowhere in the producer: the tokens
    of the entries it explains, each run of consecutive tokens at its position (the runs
    of other entries, a NaN's explained by another finding, are not these)."""
    untraced = {p for p, sources in group.stale_sources.items() if not sources}
    items = claim(lambda item: item.position in untraced)
    if not items:
        return []
    held: dict[int, set[int]] = defaultdict(set)
    for item in items:
        held[item.position].update(int(t) for t in item.tokens)
    said = []
    for position, tokens in sorted(held.items()):
        for first, last in _spans(sorted(tokens)):
            said.append(f"{_span(first, last)} (position {position})")
    skipped = [
        run
        for run in group.token_runs
        if not run.traced and any(run.first <= t <= run.last for t in held.get(run.position, ()))
    ]
    what = _listed(said)
    text = f"{what} differ in {_where(items, group.layers)}; no producer slice holds these bytes"
    if skipped:
        text += f" ({len(skipped)} more runs of tokens were not looked for)"
    return [_finding("untraced", text, items)]


def _spans(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted tokens as runs of consecutive ones, ``(first, last)`` each."""
    spans: list[tuple[int, int]] = []
    for token in tokens:
        if spans and token == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], token)
        else:
            spans.append((token, token))
    return spans


def _replicas(group: GroupComparison) -> list[Finding]:
    """Consumer replicas that differ from their replica 0."""
    items = [item for item in group.located if item.replica]
    if not items and not group.replica_mismatches:
        return []
    keys = sorted({(r, i) for _, r, i in group.replica_mismatches})
    named = ", ".join(f"{r}:{i}" for r, i in keys) or "?"
    positions = sorted({p for p, _, _ in group.replica_mismatches})
    text = f"consumer replicas {named} differ from their replica 0 at {_at(positions)}"
    if items:
        text += f" ({_heads(items)} of {layer_text([i.layer for i in items], group.layers)})"
    if len(items) == 1 and len(items[0].tokens) == 1 and items[0].differing_bits == 1:
        item = items[0]
        text += f": one bit of byte {item.first_byte} of token {item.tokens[0]}'s cell"
    slices = tuple(sorted({(item.layer, item.head) for item in items}))
    return [Finding("replica_differs", text, tuple(positions), _tokens(items), slices, len(items))]


def _differs(group: GroupComparison, items: list[LocatedDifference]) -> Finding:
    """What no other finding explains: where, and the largest damage."""
    worst = max(items, key=lambda item: item.scaled_error)
    text = (
        f"{len(items)} slices differ at {_token_text(items)} in {_where(items, group.layers)}; "
        f"the largest scaled error {worst.scaled_error:.3g} at {worst.layer} head {worst.head}"
    )
    return _finding("differs", text, items)
