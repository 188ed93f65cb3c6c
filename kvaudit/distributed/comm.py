"""The process group of a spread command and the collectives it needs, on bytes only.

Every message is JSON text or a dump file's bytes in a uint8 tensor: nothing is pickled.
The process group is gloo's, on the CPU; a command that computes on CUDA adds an NCCL group
for its data (``Comm.compute_on``). Collectives run under the process group's timeout
(``KVAUDIT_DIST_TIMEOUT`` seconds, default 600), so a lost or stuck process makes the
others fail with exit status 2 instead of waiting for ever; the backend's own text of the
failure is shown only with ``kvaudit --debug``.

Local work that may fail runs through ``Comm.outcomes``: every process learns of a failure
on any of them and raises the same one-line error, naming its rank. A process that ends
its command (``Comm.settle``) sends its exit status in the same exchange: the others, at
their next exchange or at their own end, all end with the status of the lowest rank that
ended (rank 0's when all end together).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import KvauditError
from ..core.exit_status import ExitStatus
from ..sources.raw import one_line
from . import Settled

TIMEOUT_ENV = "KVAUDIT_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 600.0


@dataclass(frozen=True)
class Place:
    """Where this process is: its global rank, the world size, its rank on its node and
    its node's rank (torchrun's ``GROUP_RANK``)."""

    rank: int
    world: int
    local_rank: int
    node_rank: int


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise KvauditError(f"{name} is not set; run the command with torchrun")
        return default
    try:
        return int(value)
    except ValueError:
        raise KvauditError(f"{name}={value!r}: expected an integer") from None


def place_from_env() -> Place:
    """This process's place, from the variables torchrun sets.

    Raises:
        KvauditError: A variable missing or not an integer.

    """
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", 0)
    per_node = _env_int("LOCAL_WORLD_SIZE", world)
    node_rank = _env_int("GROUP_RANK", rank // max(per_node, 1))
    return Place(rank, world, local_rank, node_rank)


def timeout_seconds() -> float:
    """The collectives' timeout: ``KVAUDIT_DIST_TIMEOUT`` seconds, else 600.

    Raises:
        KvauditError: A value that is not a positive number.

    """
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise KvauditError(f"{TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return value


class Comm:
    """This process's part in the process group: byte collectives with rank 0, and local
    work whose failure every process learns of.

    ``debug``: whether a failed collective's line carries the backend's own text;
    ``group``: the NCCL group of a command that computes on CUDA (None: the gloo group);
    ``ended``: whether no exchange may follow (the processes settled, or one failed).
    """

    def __init__(self, place: Place, timeout: float, debug: bool = False) -> None:
        self.place = place
        self.timeout = timeout
        self.debug = debug
        self.device = torch.device("cpu")
        self.group: dist.ProcessGroup | None = None
        self.device_chosen = False
        self.ended = False

    @classmethod
    def start(cls, debug: bool = False) -> Comm:
        """Join the gloo process group torchrun's variables describe, on the CPU.

        Raises:
            KvauditError: Bad variables, or the others not found within the timeout.

        """
        comm = cls(place_from_env(), timeout_seconds(), debug)
        with comm.guard("joining the process group"):
            dist.init_process_group(
                "gloo",
                rank=comm.place.rank,
                world_size=comm.place.world,
                timeout=timedelta(seconds=comm.timeout),
            )
        return comm

    def compute_on(self, use_cuda: bool) -> None:
        """Exchange the command's data on this process's GPU (``LOCAL_RANK``) through an
        NCCL group when ``use_cuda``, else on the CPU through gloo; the first call decides.

        Raises:
            KvauditError: On every process, when the processes do not all compute on the
                same kind of device.

        """
        if self.device_chosen:
            return
        self.device_chosen = True
        kinds = self.outcomes(lambda: "cuda" if use_cuda else "cpu")
        for rank, kind in enumerate(kinds):
            if kind != kinds[0]:
                raise KvauditError(
                    f"rank {rank} computes on {kind}, rank 0 on {kinds[0]}: give every "
                    "process the same --device, or the same GPUs"
                )
        if not use_cuda:
            return
        device = torch.device("cuda", self.place.local_rank % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
        with self.guard("starting NCCL"):
            self.group = dist.new_group(backend="nccl", timeout=timedelta(seconds=self.timeout))
        self.device = device

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Report a failed or timed-out collective as one line naming this rank and the
        cause, with the backend's own text only under ``--debug``."""
        try:
            yield
        except KvauditError:
            raise
        except Exception as error:  # the backends raise several types (timeouts, resets)
            self.ended = True
            detail = f" ({one_line(error)})" if self.debug else ""
            raise KvauditError(
                f"rank {self.place.rank}: {what} failed: another process was lost or did not "
                f"answer within {self.timeout:g} s{detail}"
            ) from None

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every process's ``data``, in rank order, on every process."""
        world = self.place.world
        with self.guard("exchanging results"):
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            sizes = [torch.zeros_like(size) for _ in range(world)]
            dist.all_gather(sizes, size, group=self.group)
            longest = max(int(item.item()) for item in sizes)
            padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=self.device)
            if data:
                padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            gathered = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(gathered, padded, group=self.group)
        return [
            bytes(item[: int(n.item())].cpu().numpy().tobytes()) for item, n in zip(gathered, sizes)
        ]

    def send_bytes(self, data: bytes, dst: int) -> None:
        """Send ``data`` to process ``dst`` (which calls ``recv_bytes``)."""
        with self.guard(f"sending blocks to rank {dst}"):
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            dist.send(size, dst, group=self.group)
            if data:
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
                dist.send(payload, dst, group=self.group)

    def recv_bytes(self, src: int) -> bytes:
        """The bytes process ``src`` sends with ``send_bytes``."""
        with self.guard(f"receiving blocks from rank {src}"):
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.recv(size, src, group=self.group)
            if not int(size.item()):
                return b""
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
            dist.recv(payload, src, group=self.group)
        return payload.cpu().numpy().tobytes()

    def outcomes(self, work: Callable[[], Any]) -> list[Any]:
        """Every process's result of its own ``work()`` (JSON values), in rank order.

        Raises:
            KvauditError: On every process, when ``work`` failed on any: the first failing
                rank's error, naming that rank.
            Settled: When another process ended its command instead.

        """
        try:
            message: dict[str, Any] = {"ok": work()}
        except KvauditError as error:
            message = {"error": str(error)}
        except OSError as error:
            where = f"{error.filename}: " if error.filename else ""
            message = {"error": f"{where}{error.strerror or one_line(error)}"}
        gathered = self._exchange(message)
        if any("end" in item for item in gathered):
            self.ended = True
            raise Settled(*self._verdict(gathered))
        for rank, item in enumerate(gathered):
            if "error" in item:
                raise KvauditError(f"rank {rank}: {item['error']}")
        return [item["ok"] for item in gathered]

    def settle(self, status: int, line: str | None) -> tuple[int, str | None]:
        """This process's end: its exit status and error line (None: none) sent to the
        others; the status every process ends with and what more to print (None: nothing).

        The status is that of the lowest rank that ended (rank 0's when all end together,
        ``Settled`` for those that were not ending). A process that ended with 0 or 1 while
        others still ran took another path through the command: all end with status 2. No
        exchange is tried after a failed one.
        """
        if self.ended:
            return status, None
        self.ended = True
        try:
            gathered = self._exchange({"end": status, "line": line})
        except KvauditError as error:
            return ExitStatus.BAD_INPUT, f"kvaudit: error: {error}"
        return self._verdict(gathered)

    def _exchange(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """Every process's JSON ``message``, in rank order."""
        return [json.loads(data) for data in self.all_gather_bytes(json.dumps(message).encode())]

    def _verdict(self, gathered: list[dict[str, Any]]) -> tuple[int, str | None]:
        """The status of an exchange where some processes ended, and the line this process
        prints besides its own (None: nothing)."""
        ending = [rank for rank, item in enumerate(gathered) if "end" in item]
        first = ending[0]
        status, line = int(gathered[first]["end"]), gathered[first]["line"]
        if len(ending) < len(gathered) and status < ExitStatus.BAD_INPUT:
            return ExitStatus.BAD_INPUT, (
                f"kvaudit: error: rank {first} ended its command while the others still ran "
                "it: every process must run the same kvaudit command and version"
            )
        if first == self.place.rank or line is None:
            return status, None
        head = "kvaudit: error: " if line.startswith("kvaudit: error: ") else "kvaudit: "
        return status, f"{head}rank {first}: {line.removeprefix(head)}"


_CURRENT: list[Comm] = []
_TRIED: list[bool] = []


def join(debug: bool = False) -> Comm:
    """This process's ``Comm``, started on first use (``debug``: whether a failed
    collective's line carries the backend's text).

    Raises:
        KvauditError: Joining failed (it is not tried again).

    """
    if not _CURRENT:
        if _TRIED:
            raise KvauditError("this process could not join the process group")
        _TRIED.append(True)
        _CURRENT.append(Comm.start(debug))
    return _CURRENT[0]


def joined() -> Comm | None:
    """This process's ``Comm``; None before it joined or when joining failed."""
    return _CURRENT[0] if _CURRENT else None


def tried() -> bool:
    """Whether this process tried to join the process group."""
    return bool(_TRIED)


def leave() -> None:
    """Leave the process group, if this process joined it."""
    while _CURRENT:
        _CURRENT.pop().close()
