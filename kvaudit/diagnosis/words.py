"""The words every finding is written in: layers, heads, tokens and positions in short,
and a ``Finding`` built from the located entries it explains."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ..core.ranges import ranges
from ..locate.model import LocatedDifference
from .model import FaultKind, Finding

SHOWN = 4
"""At most this many items (head pairs, positions, sources) are spelled out in a line."""


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


def heads_of(items: Sequence[LocatedDifference]) -> str:
    """The heads of the entries: ``head 5`` or ``heads 2-3, 6``."""
    return heads_text(item.head for item in items)


def where(items: Sequence[LocatedDifference], layers: Sequence[str] = ()) -> str:
    """``heads 2-3 of model.layers.{0-3}.attn, consumer worker tp 1 pp 0``."""
    text = f"{heads_of(items)} of {layer_text([item.layer for item in items], layers)}"
    workers = {item.consumer_worker for item in items}
    if len(workers) == 1 and None not in workers:
        tp, pp = next(iter(workers))  # type: ignore[misc]
        text += f", consumer worker tp {tp} pp {pp}"
    return text


def span(first: int, last: int) -> str:
    """``token 41`` or ``tokens 41-47``."""
    return f"token {first}" if first == last else f"tokens {first}-{last}"


def at(positions: Sequence[int]) -> str:
    """``position 4`` or ``positions 0-6``."""
    return f"{'position' if len(set(positions)) == 1 else 'positions'} {ranges(positions)}"


def positions_of(items: Sequence[LocatedDifference]) -> tuple[int, ...]:
    """The entries' block positions, sorted, each once."""
    return tuple(sorted({item.position for item in items}))


def tokens_of(items: Sequence[LocatedDifference]) -> tuple[int, ...]:
    """The entries' differing request positions, sorted, each once."""
    return tuple(sorted({int(t) for item in items for t in item.tokens}))


def make_finding(kind: FaultKind, text: str, items: Sequence[LocatedDifference]) -> Finding:
    """A finding of ``kind`` explaining the entries, with their places."""
    slices = tuple(sorted({(item.layer, item.head) for item in items}))
    return Finding(kind, text, positions_of(items), tokens_of(items), slices, len(items))


def listed(parts: Sequence[str]) -> str:
    """The first ``SHOWN`` parts, each whole, and how many more there are."""
    shown = ", ".join(parts[:SHOWN])
    return shown if len(parts) <= SHOWN else f"{shown} and {len(parts) - SHOWN} more"


def token_text(items: Sequence[LocatedDifference]) -> str:
    """``tokens 3-5 (position 0)``."""
    tokens = tokens_of(items)
    word = "token" if len(tokens) == 1 else "tokens"
    return f"{word} {ranges(tokens)} ({at(positions_of(items))})"


def spans(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted tokens as runs of consecutive ones, ``(first, last)`` each."""
    spans: list[tuple[int, int]] = []
    for token in tokens:
        if spans and token == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], token)
        else:
            spans.append((token, token))
    return spans
