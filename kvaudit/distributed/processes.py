"""How a command's processes run: one process, or several that torchrun started. The
commands ask this object for everything that differs between the two, and never test
which one they run under.

``processes()`` chooses from the environment only (``spread()``), so a command in one
process never imports torch; the torchrun runtime (``kvaudit.distributed.torchrun``) is
imported only when torchrun started the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from . import spread

if TYPE_CHECKING:
    from ..compare import CompareOptions, DiffReport
    from ..description import CacheDescription
    from ..sources import Source


class Processes(Protocol):
    """What a command asks of the way its processes run: joining and leaving, opening
    SOURCEs, whether this process writes, stamping JSON, and the comparisons whose steps
    differ when the dumps are spread over processes."""

    @property
    def writes(self) -> bool:
        """Whether this process writes the command's output (stdout, ``-o`` files)."""

    def begin(self, command: Sequence[str], debug: bool) -> None:
        """Start the command (``command``: its arguments; ``debug``: ``--debug`` given).

        Raises:
            KvauditError: The processes cannot run it together.

        """

    def finish(
        self, command: Sequence[str], debug: bool, status: int, line: str | None
    ) -> tuple[int, str | None]:
        """End the command that ended with ``status`` and printed ``line`` (None: none).

        Returns:
            The status this process exits with, and one more line to print (None: none).

        """

    def leave(self) -> None:
        """Release what ``begin`` took, whatever happened (safe to call twice)."""

    def open_sources(
        self, names: Sequence[str], config: CacheDescription | None, device: str | None
    ) -> Source:
        """SOURCE arguments opened (live tensors moved to ``device`` only when given).

        Raises:
            KvauditError: An argument that cannot be opened.

        """

    def stamp(self, data: dict[str, Any]) -> dict[str, Any]:
        """A result's JSON, with what it says of the processes that computed it."""

    def diff(
        self,
        producer: Source,
        consumer: Source,
        options: CompareOptions,
        locate: bool | None,
    ) -> DiffReport:
        """``kvaudit.compare.diff_sources`` of the two sides, differences located and
        traced (``locate``: None when both sides hold the raw KV, True always, False never).

        Raises:
            KvauditError: As ``diff_sources`` raises.

        """

    def verify(
        self,
        source: Source,
        options: CompareOptions,
        *,
        against: Source | None,
        received: bool,
        stored: bool,
    ) -> DiffReport:
        """``kvaudit.compare.verify_sources`` of ``source``, one way.

        Raises:
            KvauditError: As ``verify_sources`` raises.

        """


class OneProcess:
    """A command in this process alone: nothing to join, every result written, the
    comparisons run as ``kvaudit.compare`` runs them."""

    writes = True

    def begin(self, command: Sequence[str], debug: bool) -> None:
        """Nothing to join."""

    def finish(
        self, command: Sequence[str], debug: bool, status: int, line: str | None
    ) -> tuple[int, str | None]:
        """The command's own status; nothing more to print."""
        return status, None

    def leave(self) -> None:
        """Nothing to leave."""

    def open_sources(
        self, names: Sequence[str], config: CacheDescription | None, device: str | None
    ) -> Source:
        """``kvaudit.sources.open_source`` of the arguments."""
        from ..sources import open_source

        return open_source(names, config, device_given=device is not None)

    def stamp(self, data: dict[str, Any]) -> dict[str, Any]:
        """The JSON as it is: one process computed it."""
        return data

    def diff(
        self,
        producer: Source,
        consumer: Source,
        options: CompareOptions,
        locate: bool | None,
    ) -> DiffReport:
        """``diff_sources``, which locates and traces in this process."""
        from ..compare import diff_sources

        return diff_sources(producer, consumer, options, locate=locate)

    def verify(
        self,
        source: Source,
        options: CompareOptions,
        *,
        against: Source | None,
        received: bool,
        stored: bool,
    ) -> DiffReport:
        """``verify_sources`` as it is."""
        from ..compare import verify_sources

        return verify_sources(source, options, against=against, received=received, stored=stored)


ONE_PROCESS = OneProcess()


def processes() -> Processes:
    """How this command's processes run, from the environment: under torchrun
    (``WORLD_SIZE > 1``) the torchrun runtime, else one process.

    Example:
        >>> processes().writes  # one process, outside torchrun
        True

    Returns:
        The runtime; the same object on every call in one environment.

    """
    if not spread():
        return ONE_PROCESS
    from .torchrun import TORCHRUN

    return TORCHRUN


__all__ = ["ONE_PROCESS", "OneProcess", "Processes", "processes"]
