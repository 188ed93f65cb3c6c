"""What every comparison driver is asked besides its sides: which requests, where to
checksum, whom to tell of progress, and what a pass may accept."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..sources.base import Runtime, resolve_device
from ..workers import Progress


class Judged(Protocol):
    """A report a verdict is asked of (``DiffReport``, ``kvaudit.numeric.NumericReport``):
    what it may accept is set on it."""

    allow_missing: bool
    allow_empty: bool


@dataclass(frozen=True)
class CompareOptions:
    """The options that every comparison driver takes besides its sides (docs/api.md).

    ``diff_sources``, ``verify_sources``, ``numeric_sources`` and the torchrun runtime share
    them. ``request_ids``: the requests compared (None: every request either side holds);
    ``runtime``: where checksums are computed (None: the best device at hand);
    ``progress``: called with the bytes checksummed since its last call;
    ``allow_missing``: positions the producer holds that the consumer lacks do not fail
    the report; ``allow_empty``: a report that compared nothing does not fail;
    ``seed_lane_only``: compare the seed lane of the checksum alone, not both lanes where
    both sides carry the strong lane (for records of the seed engine; docs/checksum.md).
    """

    request_ids: Sequence[str] | None = None
    runtime: Runtime | None = None
    progress: Progress | None = None
    allow_missing: bool = False
    allow_empty: bool = False
    seed_lane_only: bool = False

    def device(self) -> Runtime:
        """The runtime checksums are computed on: the one given, else the best at hand."""
        return self.runtime or resolve_device("auto")

    def judge(self, report: Judged) -> None:
        """Tell the report what its verdict may accept: missing positions, nothing compared.

        Args:
            report: The report whose ``allow_missing`` and ``allow_empty`` are set.

        """
        report.allow_missing, report.allow_empty = self.allow_missing, self.allow_empty


DEFAULT_OPTIONS = CompareOptions()
"""Every request, the best device, no progress, nothing accepted that fails."""
