"""The data of a report's pictures: per request and group, layers x heads and layers x
token positions, from a comparison by value (errors over the tolerance) or a bitwise
diff's located differences (mismatch counts), with the axes spanning the whole request
(every layer of the group, every global KV head, every token) and the positions that
differ or fail marked."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..compare import DiffReport
from ..compare.model import GroupComparison
from ..locate.model import LocatedDifference
from ..numeric.model import GroupNumeric

MAX_TOKEN_BINS = 256
"""At most this many token columns in a bitwise diff's layers x tokens picture."""

RATIO = "tolerance ratio"
"""A cell's largest ``|c - p| / (atol + rtol |p|)``: above 1 is over the tolerance."""
SCALED = "relative error"
"""A cell's ``max |c - p| / max |p|`` (where no tolerance ratio was computed)."""
MISMATCHES = "mismatches"
"""A count of differing cells."""


@dataclass(frozen=True)
class Heatmap:
    """A picture's values ``[rows, columns]``: rows are layers; columns heads, or token
    bins of ``token_bin`` positions. ``kind`` is ``RATIO`` (NaN: not compared),
    ``SCALED`` or ``MISMATCHES`` (a count).

    ``span`` is how many heads or token positions the columns cover (the last bin may
    be partial); ``marked_rows`` the rows that differ or fail, ``marks`` the runs
    ``(first, last)`` of heads or token positions that do (inclusive).
    """

    title: str
    rows: list[str]
    columns: list[str]
    values: np.ndarray
    kind: str
    token_bin: int = 1
    span: int = 0
    marked_rows: tuple[int, ...] = ()
    marks: tuple[tuple[int, int], ...] = field(default=())

    @property
    def by_token(self) -> bool:
        """Whether the columns are token positions (else heads)."""
        return self.title.endswith("tokens")

    @property
    def extent(self) -> int:
        """The heads or token positions the columns cover."""
        return self.span or len(self.columns) * self.token_bin


def runs(values: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted integers as runs of consecutive ones, ``(first, last)`` each."""
    found: list[tuple[int, int]] = []
    for value in sorted(set(values)):
        if found and value == found[-1][1] + 1:
            found[-1] = (found[-1][0], value)
        else:
            found.append((value, value))
    return tuple(found)


def run_text(found: Iterable[tuple[int, int]]) -> str:
    """Runs as ``3, 64-79``."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in found)


def _bin_labels(count: int, width: int, span: int | None = None) -> list[str]:
    last = count * width if span is None else span
    if width == 1:
        return [str(b) for b in range(count)]
    return [f"{b * width}-{min(b * width + width, last) - 1}" for b in range(count)]


def _bins_marked(over: np.ndarray, width: int, span: int) -> tuple[tuple[int, int], ...]:
    """The token runs of the bins ``over`` flags (of ``width`` positions each, up to
    ``span``)."""
    failing = np.flatnonzero(over)
    positions = [p for b in failing for p in range(b * width, min((b + 1) * width, span))]
    return runs(positions)


def layer_head_errors(group: GroupNumeric) -> Heatmap:
    """The tolerance ratio (``SliceErrors.max_tolerance_ratio``) of each (layer, head)
    (NaN where no token was compared), the failing slices marked."""
    values = np.full((len(group.layers), group.heads), np.nan)
    row = {name: index for index, name in enumerate(group.layers)}
    for item in group.slices:
        if item.tokens:
            values[row[item.layer], item.head] = item.max_tolerance_ratio
    failed = [item for item in group.slices if item.failed and item.layer in row]
    heads = [str(h) for h in range(group.heads)]
    return Heatmap(
        "layers x heads",
        list(group.layers),
        heads,
        values,
        RATIO,
        span=group.heads,
        marked_rows=tuple(sorted({row[item.layer] for item in failed})),
        marks=runs(item.head for item in failed),
    )


def layer_token_errors(group: GroupNumeric, num_tokens: int | None = None) -> Heatmap:
    """The largest tolerance ratio of each layer per token bin (the scaled error where
    the group holds no ratios), the bins over the tolerance marked; ``num_tokens``: the
    request's tokens compared (default: every bin's whole)."""
    bins = group.layer_tokens.shape[1]
    span = bins * group.token_bin if num_tokens is None else num_tokens
    labels = _bin_labels(bins, group.token_bin, span)
    if group.layer_token_ratios is None:
        layers = list(group.layers)
        return Heatmap(
            "layers x tokens", layers, labels, group.layer_tokens, SCALED, group.token_bin, span
        )
    values = group.layer_token_ratios
    over = np.nan_to_num(values, nan=0.0) > 1
    return Heatmap(
        "layers x tokens",
        list(group.layers),
        labels,
        values,
        RATIO,
        group.token_bin,
        span,
        tuple(int(r) for r in np.flatnonzero(over.any(axis=1))),
        _bins_marked(over.any(axis=0), group.token_bin, span),
    )


def _request_tokens(report: DiffReport, request_id: str, located: list[LocatedDifference]) -> int:
    """The request's token count (the producer's, else the consumer's), at least past
    the last located token."""
    counts = report.num_tokens.get(request_id, (None, None))
    known = next((count for count in counts if count), 0)
    last = max((max(entry.tokens, default=-1) for entry in located), default=-1)
    return max(known, last + 1)


def _group_layers(group: GroupComparison, located: list[LocatedDifference]) -> list[str]:
    """The group's layers in order (its ``layers`` where known), then any located layer
    they lack."""
    return list(dict.fromkeys([*group.layers, *(entry.layer for entry in located)]))


def located_heatmaps(report: DiffReport) -> dict[tuple[str, int], tuple[Heatmap, Heatmap]]:
    """Per (request, group) with located differences of replica 0: the differing tokens
    of each (layer, head), and the differing heads of each layer per token bin, over
    the whole request: every layer of the group, every global KV head (``heads``) and
    every token (binned to at most ``MAX_TOKEN_BINS`` columns); where the group's layers
    and heads are not known, the located ones. The differing layers, heads and tokens
    are marked."""
    result = {}
    for request_id, group_id, group in report.groups():
        located = [entry for entry in group.located if entry.replica == 0]
        if not located:
            continue
        layers = _group_layers(group, located)
        heads = max(group.heads, max(entry.head for entry in located) + 1)
        tokens = _request_tokens(report, request_id, located)
        width = max(1, -(-tokens // MAX_TOKEN_BINS))
        by_head = np.zeros((len(layers), heads))
        by_token = np.zeros((len(layers), -(-tokens // width)))
        row = {name: index for index, name in enumerate(layers)}
        for entry in located:
            by_head[row[entry.layer], entry.head] += len(entry.tokens)
            np.add.at(
                by_token[row[entry.layer]], np.asarray(entry.tokens, dtype=np.int64) // width, 1
            )
        marked = tuple(sorted({row[entry.layer] for entry in located}))
        columns = [str(h) for h in range(heads)]
        result[request_id, group_id] = (
            Heatmap(
                "layers x heads",
                layers,
                columns,
                by_head,
                MISMATCHES,
                span=heads,
                marked_rows=marked,
                marks=runs(entry.head for entry in located),
            ),
            Heatmap(
                "layers x tokens",
                layers,
                _bin_labels(by_token.shape[1], width, tokens),
                by_token,
                MISMATCHES,
                width,
                tokens,
                marked,
                runs(t for entry in located for t in entry.tokens),
            ),
        )
    return result
