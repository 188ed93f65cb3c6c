"""The result of comparing two sides' raw KV by value (``kvaudit.numeric``): per request,
group, layer and head, the errors and where they are (docs/numeric.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    """When an element fails: ``|consumer - producer| > atol + rtol * |producer|``."""

    atol: float = 0.0
    rtol: float = 0.0

    def pair(self) -> tuple[float, float]:
        """``(atol, rtol)``, as the C extension takes them."""
        return self.atol, self.rtol


@dataclass
class SliceErrors:
    """The errors of one (layer, global head) of one request's group.

    They are taken over the tokens both sides hold.
    """

    layer: str
    number: int
    head: int
    tokens: int = 0
    elements: int = 0
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    max_producer: float = 0.0
    """The largest ``|producer|`` (finite or not) compared."""
    sum_squares: float = 0.0
    over_tolerance: int = 0
    nonfinite_mismatches: int = 0
    worst: list[tuple[int, float]] = field(default_factory=list)
    """``(request position, largest absolute error there)``, worst first."""
    max_tolerance_ratio: float = 0.0
    """The largest ``|c - p| / (atol + rtol |p|)`` (with atol 0, the largest relative
    error over rtol; 0 / 0 is 0): above 1 where an element is over the tolerance."""

    @property
    def rms_error(self) -> float:
        """The root mean square of the errors of the elements with finite errors."""
        return math.sqrt(self.sum_squares / self.elements) if self.elements else 0.0

    @property
    def scaled_error(self) -> float:
        """The largest error against the slice's scale: ``max_abs_error / max_producer``.

        It is what the pictures colour; elementwise relative errors blow up near 0.
        """
        if self.max_abs_error == 0:
            return 0.0
        return self.max_abs_error / self.max_producer if self.max_producer else math.inf

    @property
    def failed(self) -> bool:
        return self.over_tolerance > 0 or self.nonfinite_mismatches > 0


@dataclass
class GroupNumeric:
    """One request's group compared by value.

    ``slices`` holds its (layer, head) errors, sorted by layer number, name and head;
    ``layer_tokens`` per layer and token bin (``token_bin`` positions a bin) the largest
    scaled error ``max |c - p| / max |p|`` of a token's head (NaN where no token of the
    bin was compared); ``layer_token_ratios`` likewise the largest tolerance ratio
    ``|c - p| / (atol + rtol |p|)`` (``SliceErrors.max_tolerance_ratio``; None where not
    computed).
    """

    group: int
    layers: list[str]
    heads: int
    slices: list[SliceErrors]
    token_bin: int
    layer_tokens: np.ndarray
    not_compared: list[str] = field(default_factory=list)
    """Why parts of the group were not compared (a layer one side lacks, ...)."""
    layer_token_ratios: np.ndarray | None = None

    @property
    def failed(self) -> bool:
        """A slice over the tolerance, or a part of the group not compared."""
        return bool(self.not_compared) or any(item.failed for item in self.slices)


@dataclass
class RequestNumeric:
    """One request compared by value over ``num_tokens`` tokens."""

    request_id: str
    num_tokens: int
    groups: dict[int, GroupNumeric] = field(default_factory=dict)


@dataclass
class NumericReport:
    """A producer compared with a consumer by value, as ``numeric_sources`` reports it.

    It holds the tolerances, each request's groups, the requests one side lacks and what
    could not be compared (``(request, group, why)``). What a diff must never pass is
    checked as the bitwise diff checks it (``scale_differences``: each layer scale that
    differs between the sides, as ``diff`` names it); ``missing`` holds ``(request, group or None,
    what)`` the producer holds that the consumer lacks (its tokens, or block positions,
    accepted with ``allow_missing``);
    ``copies_differing`` each ``(request, group, [(position, R, r)])`` where the
    consumer's copy ``r`` of replicated heads holds other bits than its copy 0 (the one
    compared by value); ``incomplete`` each side whose set lacks workers; nothing
    compared fails unless ``allow_empty``; ``warnings`` as the bitwise diff's.
    """

    atol: float
    rtol: float
    requests: dict[str, RequestNumeric] = field(default_factory=dict)
    only_producer: list[str] = field(default_factory=list)
    only_consumer: list[str] = field(default_factory=list)
    not_compared: list[tuple[str, int, str]] = field(default_factory=list)
    missing: list[tuple[str, int | None, str]] = field(default_factory=list)
    copies_differing: list[tuple[str, int, list[tuple[int, int, int]]]] = field(
        default_factory=list
    )
    incomplete: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    scale_differences: list[str] = field(default_factory=list)
    allow_missing: bool = False
    allow_empty: bool = False

    def slices(self) -> Iterator[SliceErrors]:
        """Every (layer, head) slice of every request's groups."""
        for request in self.requests.values():
            for group in request.groups.values():
                yield from group.slices

    @property
    def compared_tokens(self) -> int:
        """The (layer, head) tokens compared over every request."""
        return sum(item.tokens for item in self.slices())

    @property
    def empty_reason(self) -> str | None:
        """Why nothing was compared, or None when something was (or ``allow_empty``)."""
        if self.allow_empty or self.compared_tokens or self.only_producer:
            return None
        if not self.requests:
            return "the two sides have no request in common"
        return "no token was compared"

    @property
    def failed_slices(self) -> int:
        """How many (layer, head) slices fail: over the tolerance or non-finite on one side."""
        return sum(item.failed for item in self.slices())

    @property
    def ok(self) -> bool:
        """Whether the comparison passes.

        No element is over the tolerance, nothing is on one side only, nothing is
        uncompared or missing (unless allowed), no consumer copy differs, both sets are
        complete, no layer's scale differs and something was compared (unless allowed).
        """
        return not (
            self.failed_slices
            or self.only_producer
            or self.only_consumer
            or self.not_compared
            or (self.missing and not self.allow_missing)
            or self.copies_differing
            or self.incomplete
            or self.scale_differences
            or self.empty_reason
        )
