"""The data of a report's pictures: per request and group, layers x heads and layers x
token positions, from a comparison by value (relative errors) or a bitwise diff's located
differences (mismatch counts)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..compare import DiffReport
from ..numeric.model import GroupNumeric

MAX_TOKEN_BINS = 256
"""At most this many token columns in a bitwise diff's layers x tokens picture."""


@dataclass(frozen=True)
class Heatmap:
    """A picture's values ``[rows, columns]``: rows are layers; columns heads, or token
    bins of ``token_bin`` positions. ``kind`` is ``relative error`` (``max |c - p| / max
    |p|`` of the cell; NaN: not compared) or ``mismatches`` (a count)."""

    title: str
    rows: list[str]
    columns: list[str]
    values: np.ndarray
    kind: str
    token_bin: int = 1


def layer_head_errors(group: GroupNumeric) -> Heatmap:
    """The scaled error ``max |c - p| / max |p|`` of each (layer, head) (NaN where no
    token was compared)."""
    values = np.full((len(group.layers), group.heads), np.nan)
    row = {name: index for index, name in enumerate(group.layers)}
    for item in group.slices:
        if item.tokens:
            values[row[item.layer], item.head] = item.scaled_error
    heads = [str(h) for h in range(group.heads)]
    return Heatmap("layers x heads", list(group.layers), heads, values, "relative error")


def layer_token_errors(group: GroupNumeric) -> Heatmap:
    """The largest scaled error of each layer per token bin."""
    return Heatmap(
        "layers x tokens",
        list(group.layers),
        _bin_labels(group.layer_tokens.shape[1], group.token_bin),
        group.layer_tokens,
        "relative error",
        group.token_bin,
    )


def _bin_labels(count: int, width: int) -> list[str]:
    if width == 1:
        return [str(b) for b in range(count)]
    return [f"{b * width}-{b * width + width - 1}" for b in range(count)]


def located_heatmaps(report: DiffReport) -> dict[tuple[str, int], tuple[Heatmap, Heatmap]]:
    """Per (request, group) with located differences of replica 0: the differing tokens
    of each (layer, head), and the differing heads of each layer per token bin."""
    result = {}
    for request_id, group_id, group in report.groups():
        located = [entry for entry in group.located if entry.replica == 0]
        if not located:
            continue
        layers = list(dict.fromkeys(entry.layer for entry in located))
        heads = max(entry.head for entry in located) + 1
        tokens = max(max(entry.tokens, default=0) for entry in located) + 1
        width = max(1, -(-tokens // MAX_TOKEN_BINS))
        by_head = np.zeros((len(layers), heads))
        by_token = np.zeros((len(layers), -(-tokens // width)))
        for entry in located:
            row = layers.index(entry.layer)
            by_head[row, entry.head] += len(entry.tokens)
            np.add.at(by_token[row], np.asarray(entry.tokens, dtype=np.int64) // width, 1)
        columns = [str(h) for h in range(heads)]
        result[request_id, group_id] = (
            Heatmap("layers x heads", layers, columns, by_head, "mismatches"),
            Heatmap(
                "layers x tokens",
                layers,
                _bin_labels(by_token.shape[1], width),
                by_token,
                "mismatches",
                width,
            ),
        )
    return result
