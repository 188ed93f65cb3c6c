"""The process group of a spread command and the collectives it needs, on bytes only.

Every message is JSON text or a dump file's bytes in a uint8 tensor: nothing is pickled.
Collectives run under the process group's timeout (``KVAUDIT_DIST_TIMEOUT`` seconds,
default 600), so a lost or stuck process makes the others fail with exit status 2 instead
of waiting for ever. Local work that may fail runs through ``Comm.outcomes``: every process
learns of a failure on any of them and raises the same one-line error, naming its rank.
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

from ..errors import KvauditError
from ..sources.raw import one_line

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
    work whose failure every process learns of."""

    def __init__(self, place: Place, device: torch.device, timeout: float) -> None:
        self.place = place
        self.device = device
        self.timeout = timeout

    @classmethod
    def start(cls, use_cuda: bool) -> Comm:
        """Join the process group torchrun's variables describe: NCCL on this process's
        GPU (``LOCAL_RANK``) when ``use_cuda``, else gloo on the CPU.

        Raises:
            KvauditError: Bad variables, or the others not found within the timeout.

        """
        place = place_from_env()
        timeout = timeout_seconds()
        if use_cuda:
            device = torch.device("cuda", place.local_rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        comm = cls(place, device, timeout)
        with comm.guard("joining the process group"):
            dist.init_process_group(
                "nccl" if use_cuda else "gloo",
                rank=place.rank,
                world_size=place.world,
                timeout=timedelta(seconds=timeout),
            )
        return comm

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Report a failed or timed-out collective as one line naming this rank."""
        try:
            yield
        except KvauditError:
            raise
        except Exception as error:  # the backends raise several types (timeouts, resets)
            raise KvauditError(
                f"rank {self.place.rank}: {what} failed: another process was lost or did not "
                f"answer within {self.timeout:g} s ({one_line(error)})"
            ) from None

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every process's ``data``, in rank order, on every process."""
        world = self.place.world
        with self.guard("exchanging results"):
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            sizes = [torch.zeros_like(size) for _ in range(world)]
            dist.all_gather(sizes, size)
            longest = max(int(item.item()) for item in sizes)
            padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=self.device)
            if data:
                padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            gathered = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(gathered, padded)
        return [
            bytes(item[: int(n.item())].cpu().numpy().tobytes()) for item, n in zip(gathered, sizes)
        ]

    def send_bytes(self, data: bytes, dst: int) -> None:
        """Send ``data`` to process ``dst`` (which calls ``recv_bytes``)."""
        with self.guard(f"sending blocks to rank {dst}"):
            dist.send(torch.tensor([len(data)], dtype=torch.int64, device=self.device), dst)
            if data:
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
                dist.send(payload, dst)

    def recv_bytes(self, src: int) -> bytes:
        """The bytes process ``src`` sends with ``send_bytes``."""
        with self.guard(f"receiving blocks from rank {src}"):
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            dist.recv(size, src)
            if not int(size.item()):
                return b""
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
            dist.recv(payload, src)
        return payload.cpu().numpy().tobytes()

    def outcomes(self, work: Callable[[], Any]) -> list[Any]:
        """Every process's result of its own ``work()`` (JSON values), in rank order.

        Raises:
            KvauditError: On every process, when ``work`` failed on any: the first failing
                rank's error, naming that rank.

        """
        try:
            message: dict[str, Any] = {"ok": work()}
        except KvauditError as error:
            message = {"error": str(error)}
        except OSError as error:
            where = f"{error.filename}: " if error.filename else ""
            message = {"error": f"{where}{error.strerror or one_line(error)}"}
        gathered = self.all_gather_bytes(json.dumps(message).encode())
        results = []
        for rank, data in enumerate(gathered):
            item = json.loads(data)
            if "error" in item:
                raise KvauditError(f"rank {rank}: {item['error']}")
            results.append(item["ok"])
        return results


_CURRENT: list[Comm] = []


def join(use_cuda: bool) -> Comm:
    """This process's ``Comm``, started on first use."""
    if not _CURRENT:
        _CURRENT.append(Comm.start(use_cuda))
    return _CURRENT[0]


def leave() -> None:
    """Leave the process group, if this process joined it."""
    while _CURRENT:
        _CURRENT.pop().close()
