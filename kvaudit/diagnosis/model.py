"""What a diagnosis says: ``Finding``, one fault's kind with its evidence, and the kinds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

FaultKind = Literal[
    "kv_exchanged",
    "heads_exchanged",
    "heads_duplicated",
    "layers_exchanged",
    "layers_duplicated",
    "slices_exchanged",
    "stale_block",
    "tokens_shifted",
    "foreign_tokens",
    "diverges",
    "tail_not_written",
    "nonfinite",
    "zeros",
    "bit_flip",
    "byte_changed",
    "element_changed",
    "untraced",
    "drift",
    "replica_differs",
    "differs",
    "over_tolerance",
]
"""A fault's kind, from the most specific evidence to the least (docs/cli.md, diagnosis);
``over_tolerance`` is the comparison by value's."""

FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)

KIND_TITLES: dict[FaultKind, str] = {
    "kv_exchanged": "K and V exchanged",
    "heads_exchanged": "heads exchanged",
    "heads_duplicated": "head duplicated",
    "layers_exchanged": "layers exchanged",
    "layers_duplicated": "layer duplicated",
    "slices_exchanged": "slices exchanged",
    "stale_block": "stale block",
    "tokens_shifted": "tokens shifted",
    "foreign_tokens": "tokens from elsewhere",
    "diverges": "sequence diverges",
    "tail_not_written": "tail not written",
    "nonfinite": "NaN/Inf",
    "zeros": "zeros",
    "bit_flip": "single bit",
    "byte_changed": "single byte",
    "element_changed": "single element",
    "untraced": "not traced",
    "drift": "small differences everywhere",
    "replica_differs": "replica differs",
    "differs": "differs",
    "over_tolerance": "over the tolerance",
}
"""How a table, a JUnit message and a page name each kind."""


@dataclass(frozen=True)
class Finding:
    """One fault named in a group: its kind, one line of evidence and where it lies.

    ``text`` is the evidence as a person reads it (``consumer head 1 holds producer head
    5 ...``); ``positions`` are the compared block positions it covers, ``tokens`` the
    request positions, ``slices`` the ``(layer, head)`` pairs and ``located`` how many of
    the group's located entries it explains.
    """

    kind: FaultKind
    text: str
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    slices: tuple[tuple[str, int], ...]
    located: int

    @property
    def title(self) -> str:
        """The kind as reports name it (``heads exchanged``)."""
        return KIND_TITLES[self.kind]

    @property
    def line(self) -> str:
        """``title: text``, the line every report shows."""
        return f"{self.title}: {self.text}"
