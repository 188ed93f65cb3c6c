"""The CPU path with numpy: the checksum of block rows read in place (a dump's mapped
file, a live CPU tensor's memory), in bounded memory, on every core, without torch.

A piece's weight ``m_h * (2 * ((first + u) * P + off + p) + 1)`` splits into a part that
depends on the head and piece and one that grows with the token (docs/checksum.md):

    row sum = sum over (h, p) of  Y[h, p] * m_h * (2 * (off + p) + 1)
            + sum over h of       2 * P * m_h * (first * Y[h] + Z[h])

with ``Y[h, p]`` the sum of a piece over the block's tokens, ``Z[h, p]`` the same sum with
each token ``u`` counted ``u`` times, and ``Y[h]``, ``Z[h]`` their sums over pieces. One pass
over each token's ``[heads, pieces]`` slice builds both with additions only: a running sum
``Y`` and the sum of the running sums, which counts token ``u`` ``U - u`` times. The
weights only meet the ``U`` times smaller ``Y`` and ``Z``. numpy's int64 arithmetic wraps
modulo 2**64, which gives the uint64 bits, and releases the GIL, so chunks of rows run on
a small thread pool.

Where the C extension ``kvaudit._native._row_sums`` built (``setup.py``), each chunk's row
sums come from its loop instead: the same sums, in one pass over the row with the running
sums in L1, the GIL released. ``KVAUDIT_NATIVE=0`` runs the numpy code (kvaudit.core.native).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable
from queue import SimpleQueue
from typing import Any, TypeVar

import numpy as np

from ...core.arrays import Array, is_numpy
from ...core.interrupts import deferred_interrupts
from ...core.native import extension
from . import LaunchPart

_T = TypeVar("_T")
_R = TypeVar("_R")

CHUNK_BYTES = 4 << 20
"""Bytes of rows one task reads: small enough that its running sums stay in cache, large
enough that each numpy call covers many rows."""

NATIVE_CHUNK_BYTES = 16 << 20
"""The same for the C loop, whose running sums stay in cache whatever the chunk: only
large enough that the calls' own cost is small, small enough that every thread gets one."""

NATIVE = "kvaudit._native._row_sums"
"""The C extension with the row sums' loop."""

THREADS = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
"""Threads that reduce chunks at once."""

_UNSIGNED = {2: np.uint16, 4: np.uint32}


class _Pool:
    """Daemon threads that run the calls of :meth:`map`. Not concurrent.futures: its
    import brings logging, and its threads are joined at exit, both start-up and exit time
    of a CLI run."""

    def __init__(self, threads: int) -> None:
        self._calls: SimpleQueue[Callable[[], None]] = SimpleQueue()
        for number in range(threads):
            name = f"kvaudit-numpy_{number}"
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            self._calls.get()()

    def map(self, function: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
        """``function`` of each item, on the threads, in the items' order; the first
        item's error (in order) is raised once all calls have ended."""
        todo = list(items)
        if not todo:
            return []
        results: list[Any] = [None] * len(todo)
        errors: list[BaseException | None] = [None] * len(todo)
        left = [len(todo)]
        lock = threading.Lock()
        # Plain locks and flags, not Events: an interruption raised inside Event.wait can
        # leave its condition's lock held, and the wait below would then never end.
        ended = threading.Lock()
        ended.acquire()
        cancelled = [False]

        def call(index: int) -> None:
            try:
                if not cancelled[0]:
                    results[index] = function(todo[index])
            except BaseException as error:  # raised by map, in the caller's thread
                errors[index] = error
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    ended.release()

        # The command's interruptions wait for the calls to end (a batch's time).
        with deferred_interrupts():
            for index in range(len(todo)):
                self._calls.put(functools.partial(call, index))
            try:
                ended.acquire()
            except BaseException:
                # Interrupted (Python's own Ctrl-C handler): the calls not started are
                # skipped, and the running ones end before the caller unwinds, so that none
                # reads memory being released.
                cancelled[0] = True
                if left[0]:  # else the interruption came after every call ended
                    _acquire_through_interruptions(ended)
                raise
        for error in errors:
            if error is not None:
                raise error
        return results


def _acquire_through_interruptions(lock: threading.Lock) -> None:
    """Acquire ``lock``, however many more interruptions arrive meanwhile."""
    while True:
        try:
            lock.acquire()
            return
        except BaseException:  # the caller raises the first interruption
            continue


_POOL: _Pool | None = None


def shared_pool() -> _Pool:
    global _POOL
    if _POOL is None:
        _POOL = _Pool(THREADS)
    return _POOL


def as_numpy(pieces: Array) -> np.ndarray:
    """A piece view as a numpy array sharing its memory (a CPU tensor converts in place)."""
    if is_numpy(pieces):
        return pieces
    if pieces.device.type != "cpu":
        raise ValueError(f"the numpy backend reads CPU memory, not {pieces.device.type}")
    return pieces.detach().numpy()


class NumpyPart:
    """One piece view ``[blocks, kernel_blocks, heads, tokens, pieces]`` prepared for the
    numpy path: 2- and 4-byte pieces read unsigned, its weights and its column."""

    def __init__(self, part: LaunchPart) -> None:
        pieces = as_numpy(part.pieces)
        unsigned = _UNSIGNED.get(pieces.dtype.itemsize)
        self.blocks = pieces.view(unsigned) if unsigned is not None else pieces
        _, kernel_blocks, heads, tokens, num_pieces = pieces.shape
        self.tokens = tokens
        self.tokens_per_row = kernel_blocks * tokens
        self.column = part.column
        self.native = extension(NATIVE)
        row_bytes = kernel_blocks * heads * tokens * num_pieces * pieces.dtype.itemsize
        chunk_bytes = CHUNK_BYTES if self.native is None else NATIVE_CHUNK_BYTES
        self.chunk_rows = max(1, chunk_bytes // max(row_bytes, 1))
        factors = 2 * (np.arange(heads, dtype=np.int64) + part.first_slice) + 1  # m_h
        offsets = 2 * (part.piece_offset + np.arange(num_pieces, dtype=np.int64)) + 1
        # Weights of Y, [heads * pieces]; of first * Y[h] + Z[h], [heads].
        self.piece_weights = (factors[:, None] * offsets[None, :]).reshape(-1)
        self.head_weights = 2 * part.cell_pieces * factors

    def chunks(self, rows: np.ndarray) -> list[np.ndarray]:
        """``rows`` (indices of the launch's rows) in chunks of ``chunk_rows``."""
        return [
            rows[start : start + self.chunk_rows] for start in range(0, len(rows), self.chunk_rows)
        ]

    def row_sums(self, block_ids: np.ndarray, first: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The weighted sums of the rows of ``block_ids`` over their first ``counts``
        tokens (each at least 1 and at most ``tokens_per_row``), int64: by the C loop
        where it is loaded, else by numpy."""
        if self.native is None:
            return self.numpy_row_sums(block_ids, first, counts)
        return self.native_row_sums(block_ids, first, counts)

    def native_row_sums(
        self, block_ids: np.ndarray, first: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        """:meth:`row_sums` by the C loop, which reads each block where it lies (it checks
        that every block id and count falls within the view; ValueError or IndexError)."""
        assert self.native is not None
        sums = np.empty(len(block_ids), dtype=np.int64)
        self.native.row_sums(
            self.blocks,
            np.ascontiguousarray(block_ids, dtype=np.int64),
            np.ascontiguousarray(first, dtype=np.int64),
            np.ascontiguousarray(counts, dtype=np.int64),
            self.piece_weights,
            self.head_weights,
            sums,
        )
        return sums

    def numpy_row_sums(
        self, block_ids: np.ndarray, first: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        """:meth:`row_sums` by numpy (the path without the C extension)."""
        x = self._rows(block_ids)
        tokens = self.tokens
        top = int(counts.max())
        total = x[:, 0, :, 0, :].astype(np.int64)  # Y so far: [rows, heads, pieces]
        counted = total.copy()  # each token u counted (tokens so far) - u times
        # Rows cut short (a request's last block) keep their sums as of their count.
        short: dict[int, np.ndarray] = {}
        if int(counts.min()) < top:
            # A set, not np.unique: that imports numpy.ma, ~10 ms of a CLI run's start-up.
            cut = set(counts[counts < top].tolist())
            short = {c: np.flatnonzero(counts == c) for c in sorted(cut)}
        kept_total = np.empty_like(total) if short else total
        kept_counted = np.empty_like(counted) if short else counted
        for u in range(1, top):
            done = short.get(u)
            if done is not None:
                kept_total[done] = total[done]
                kept_counted[done] = counted[done]
            kernel_block, token = divmod(u, tokens)
            np.add(total, x[:, kernel_block, :, token, :], out=total)
            np.add(counted, total, out=counted)
        if short:
            full = counts == top
            kept_total[full] = total[full]
            kept_counted[full] = counted[full]
        rows = len(x)
        # Z = sum of u * x_u = count * Y - (sum of the running sums)
        weighted = np.multiply(kept_total, counts[:, None, None])
        np.subtract(weighted, kept_counted, out=weighted)
        sums = kept_total.reshape(rows, -1) @ self.piece_weights
        per_head = first[:, None] * kept_total.sum(axis=2) + weighted.sum(axis=2)
        sums += per_head @ self.head_weights
        return sums

    def _rows(self, block_ids: np.ndarray) -> np.ndarray:
        """The rows of these blocks: a view when they are consecutive, else a gather."""
        first = int(block_ids[0])
        last = int(block_ids[-1])
        if last - first + 1 == len(block_ids) and (
            len(block_ids) < 3 or bool((np.diff(block_ids) == 1).all())
        ):
            return self.blocks[first : last + 1]
        return self.blocks[block_ids]


class NumpyLaunch:
    """Parts that share one layout, adding into their columns (the numpy backend's
    :class:`~kvaudit.checksum.kernels.Launch`); inputs and output are numpy arrays."""

    def __init__(self, parts: list[LaunchPart]) -> None:
        self.parts = [NumpyPart(part) for part in parts]

    def warm_up(self, num_columns: int = 0) -> None:
        """Nothing to prepare: the path allocates only per chunk."""

    def accumulate(
        self,
        block_ids: np.ndarray,
        first_tokens: np.ndarray,
        valid_tokens: np.ndarray,
        out: np.ndarray,
    ) -> None:
        """Add every part's weighted sums of the rows into its column of ``out``
        ``[rows, columns]``."""
        tasks = [
            (part, chunk)
            for part in self.parts
            for chunk in part.chunks(np.flatnonzero(valid_tokens > 0))
        ]

        def run(task: tuple[NumpyPart, np.ndarray]) -> np.ndarray:
            part, index = task
            counts = np.minimum(valid_tokens[index], part.tokens_per_row)
            return part.row_sums(block_ids[index], first_tokens[index], counts)

        results = shared_pool().map(run, tasks) if len(tasks) > 1 else map(run, tasks)
        for (part, index), sums in zip(tasks, results, strict=True):
            out[index, part.column] += sums
