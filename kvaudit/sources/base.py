"""What every source is: the ``Source`` interface the commands and the diff driver use,
where checksums are computed (``Runtime``), and the request bookkeeping sources share.

A source holds requests' KV or their checksums, says each request's token count and
gives a ``Record``. Its capabilities, each None where it lacks them: ``trimmed`` (it can be
checksummed again over fewer tokens), ``raw_kv`` (its workers' raw KV, for locating
differences: rows at hand, or fetched on demand from a running engine), ``value_kv``
(every row of given requests at hand, for comparing values), ``carried_checksums``
(dumps carrying checksums to verify), ``positions`` (a record's fixed position
numbering), ``dumped_kv`` (raw KV of some of its requests, for locating only: an output
folder's dumps) and ``prompt_digests`` with ``renamed`` (requests that another engine
names differently, paired by their prompts). ``warnings`` says what its files warranted
a warning about (a torn line skipped).
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ..core.errors import KvauditError
from ..workers.protocol import Listing, Progress

if TYPE_CHECKING:
    from ..description import CacheDescription
    from ..dumps import DumpSet
    from ..records import Record, WorkerInfo
    from ..workers import FetchingWorker, Inventory, RawWorker

_Listed = TypeVar("_Listed")
"""A request as a worker lists it (``DumpRequest``, ``RequestBlocks``): a ``Listing``."""


@dataclass(frozen=True)
class Runtime:
    """Where checksums are computed: the backend and device ``--device`` resolves to."""

    backend: str
    device: str


@dataclass(frozen=True)
class RecordQuery:
    """What a source's checksum is asked, as every ``Source.checksum`` takes it.

    ``request_ids``: the requests (None: every request the source holds); ``positions``:
    the position numbering (None: the source's own, else ``request``); ``runtime``: where
    the checksums are computed; ``progress``: called with the bytes checksummed since its
    last call.
    """

    runtime: Runtime
    request_ids: Sequence[str] | None = None
    positions: str | None = None
    progress: Progress | None = None

    def ids(self) -> list[str] | None:
        """The requests asked for, as a list; None for every request."""
        return None if self.request_ids is None else list(self.request_ids)

    def numbering(self) -> str:
        """The position numbering a source without one of its own uses."""
        return self.positions or "request"


def resolve_device(choice: str) -> Runtime:
    """The runtime of a ``--device`` choice; ``auto`` is CUDA with the Triton kernel where
    available, else the CPU path (numpy).

    Raises:
        KvauditError: ``cuda`` without a CUDA device, or an unknown choice.

    """
    if choice not in ("auto", "cuda", "cpu"):
        raise KvauditError(f"--device {choice}: expected auto, cpu or cuda")
    if choice == "cpu" or (choice == "auto" and not _gpu_driver_present()):
        return Runtime("auto", "cpu")
    import torch  # only to ask for a GPU

    available = torch.cuda.is_available()
    if choice == "auto":
        return Runtime("auto", "cuda" if available else "cpu")
    if not available:
        raise KvauditError("--device cuda: no CUDA device is available")
    return Runtime("auto", "cuda")


def _gpu_driver_present() -> bool:
    """Whether a GPU driver's device files exist: without them torch finds no CUDA device,
    so ``auto`` need not import torch to ask."""
    return any(os.path.exists(path) for path in _GPU_DEVICE_FILES)


_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


class Source(ABC):
    """Resolved SOURCE arguments: something to inspect and checksum."""

    kind: str = ""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.warnings: list[str] = []

    @property
    @abstractmethod
    def request_ids(self) -> list[str]:
        """The requests the source holds, in order."""

    @abstractmethod
    def inventory(self) -> Inventory:
        """What the source holds."""

    @abstractmethod
    def checksum(self, query: RecordQuery) -> Record:
        """The record of the requests ``query`` asks for, summed over the source's workers."""

    @abstractmethod
    def token_counts(self) -> dict[str, int]:
        """Each request's token count, as the source holds it."""

    def work(self, request_ids: Sequence[str] | None) -> int:
        """Bytes a checksum of the requests reads (0: not worth a progress bar)."""
        return 0

    @property
    def positions(self) -> str | None:
        """The position numbering the source's checksums are fixed to (a record's); None
        when it can checksum with either."""
        return None

    def trimmed(self, num_tokens: Mapping[str, int]) -> Source | None:
        """The same source with the given requests cut to at most ``num_tokens[id]``
        tokens, so that its checksums cover only those; None when the source cannot be
        checksummed again (a record)."""
        return None

    def raw_kv(self) -> list[RawWorker | FetchingWorker] | None:
        """Each worker's raw KV for locating differences: its rows at hand
        (``kvaudit.workers.RawWorker``: dumps, live tensors) or fetched on demand
        (``FetchingWorker``: a running engine's agent); None when the source holds only
        checksums."""
        return None

    def dumped_kv(self) -> list[RawWorker] | None:
        """The raw KV of some of the source's requests, for locating their differences
        when the source holds only checksums of the others (an output folder's dumps);
        None when it holds none (or holds the raw KV of all: ``raw_kv``)."""
        return None

    def prompt_digests(self) -> Mapping[str, str] | None:
        """Each request's prompt digest (``kvaudit.output_folders.prompt_digest``)
        where the source knows it, in order of appearance; None when it knows none."""
        return None

    def renamed(self, names: Mapping[str, str]) -> Source:
        """The same source with requests renamed (``names``: old id to new id; the new ids
        not held already).

        Raises:
            KvauditError: The source cannot rename its requests.

        """
        raise KvauditError(f"{', '.join(self.names)}: a {self.kind} cannot rename its requests")

    def value_kv(self, request_ids: Sequence[str] | None) -> list[RawWorker] | None:
        """Each worker's raw KV holding every row of the requests (all when None) at hand,
        for the by-value comparison, which reads them all; None when the source holds
        only checksums.

        Raises:
            KvauditError: The rows cannot be had (a running engine that no longer holds a
                request, or refuses to copy that much).

        """
        return None

    def descriptions(self) -> list[CacheDescription]:
        """The cache descriptions of the source's workers (none for a record)."""
        return [worker.description for worker in self.raw_kv() or []]

    def carried_checksums(self) -> DumpSet | None:
        """The dumps whose carried checksums (the producer's wire bytes a consumer
        received, stored checksums of offloaded blocks) ``verify`` checks; None for a
        source that carries none."""
        return None

    def describe(self) -> str:
        """The source in a report's title: its names, its kind and, where its dumps or
        record state it, the engine's TP x PP layout."""
        worker = self._stated_worker()
        layout = f", TP {worker.tp_size} x PP {worker.pp_size}" if worker is not None else ""
        return f"{', '.join(self.names)} ({self.kind}{layout})"

    def _stated_worker(self) -> WorkerInfo | None:
        """A worker as the source's files state it, for ``describe``; None for live ones."""
        return None

    def check_request_ids(self, request_ids: Sequence[str]) -> None:
        """Reject a request id the source does not hold."""
        known = self.request_ids
        for request_id in request_ids:
            if request_id not in known:
                held = ", ".join(known) if known else "none"
                raise KvauditError(
                    f"unknown request {request_id!r} in {', '.join(self.names)} (it holds: {held})"
                )


def request_ids_of(mappings: Iterable[Mapping[str, object]]) -> list[str]:
    """The request ids of the workers' mappings, each once, in order of appearance."""
    return list(dict.fromkeys(rid for mapping in mappings for rid in mapping))


def token_counts_of(mappings: Iterable[Mapping[str, Listing]]) -> dict[str, int]:
    """Each request's token count, from the first worker that lists it."""
    counts: dict[str, int] = {}
    for mapping in mappings:
        for request_id, request in mapping.items():
            counts.setdefault(request_id, request.num_tokens)
    return counts


def trim(requests: Mapping[str, _Listed], num_tokens: Mapping[str, int]) -> dict[str, _Listed]:
    """The requests (dataclasses with ``num_tokens``) with each one in ``num_tokens`` cut
    to at most that many tokens."""
    return {
        rid: (
            dataclasses.replace(request, num_tokens=min(request.num_tokens, num_tokens[rid]))
            if rid in num_tokens
            else request
        )
        for rid, request in requests.items()
    }
