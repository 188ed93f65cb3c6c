"""Comparing two sides' raw KV by value: per request, layer and head, how large the
errors are and where (docs/numeric.md).

``numeric_diff`` reads a producer's and a consumer's ``RawWorker``s (dumps or live
tensors, any TP sizes, layouts and block ids) batch by batch over the tokens both hold,
each layer of a batch on a thread, piece by piece: every element decoded in its layer's
dtype times the layer's scale and accumulated, in one pass by the C extension where it is
built (``kvaudit.native_errors``), else in numpy (``kvaudit.elements``,
``kvaudit.element_errors``), per (layer, global head): the largest absolute and relative
errors, the RMS error, the elements over ``atol + rtol * |producer|``, the NaN or Inf on
one side only and the worst token positions; per layer and token bin, the largest
relative error.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from .compare.numeric import GroupNumeric, NumericReport, RequestNumeric
from .element_errors import LayerErrors, add_batch, scratch
from .elements import work_dtype
from .mapped_rows import MappedRows
from .native_errors import add_raw_batch, native_module, raw_dtype, reads
from .sources.raw import RawWorker
from .value_reads import (
    LayerValues,
    RowFiles,
    SideWorker,
    WorkerRows,
    attention_views,
    batch_tokens,
    block_unit,
    decode_layer,
    plan_rows,
    side_layers,
    side_workers,
)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

MAX_BINS = 256
"""At most this many token bins per layer in the layers x tokens picture."""
THREADS = 4
"""At most this many threads read the sides and compare layers."""
BATCH_BYTES = 8 << 20
"""About how many raw bytes each side reads per batch (memory stays bounded)."""
PIECE_ELEMENTS = 1 << 18
"""About how many elements of a side one layer decodes at once (compared in cache-sized
chunks of heads: ``kvaudit.element_errors.CHUNK_ELEMENTS``)."""
NATIVE_PIECE_ELEMENTS = 1 << 20
"""The same where the C extension compares (one pass over a piece: larger pieces, fewer
steps in Python; 2 MiB of bf16 bits a side)."""
MAPPED_PIECE_ELEMENTS = 1 << 22
"""The same where it reads both sides' dumps in place (nothing staged: only 16 bytes of
location per row and side are held; a piece is then usually a whole batch)."""
CHUNK_TOKENS = 256
"""Rows read in place go a block of tokens (at most this many) at a time
(kvaudit/_mapped_rows.h)."""
MAPPED_BYTES = 256 << 20
"""About how many bytes of the dumps' mapped pages the threads reading rows in place hold
at most, together: each releases the 2 MiB regions it read once they reach its share (a
chunk's regions more at most), and at the end of each piece."""


def _layer_plan(
    producer: Mapping[str, LayerValues], consumer: Mapping[str, LayerValues]
) -> tuple[list[str], list[str]]:
    """The layers both sides hold alike (by layer number and name), and why the others
    are not compared."""
    names = sorted(
        set(producer) | set(consumer), key=lambda n: ((producer.get(n) or consumer[n]).number, n)
    )
    common, reasons = [], []
    for name in names:
        left, right = producer.get(name), consumer.get(name)
        if left is None or right is None:
            side = "producer" if left is None else "consumer"
            reasons.append(f"layer {name} is not on the {side}")
        elif (left.heads, left.elements) != (right.heads, right.elements):
            reasons.append(
                f"layer {name}: {left.heads} heads x {left.elements} elements on the producer, "
                f"{right.heads} x {right.elements} on the consumer"
            )
        else:
            common.append(name)
    return common, reasons


class ThreadFiles:
    """Each pool thread's ``RowFiles`` for a whole comparison (a dump's files opened and
    its rows' layout found once, not per layer batch), all closed at its end (``with``)."""

    def __init__(self, threads: int = 1) -> None:
        self._local = threading.local()
        self._opened: list[RowFiles] = []
        self._lock = threading.Lock()
        self.places = MappedRows(max(1, MAPPED_BYTES // threads))
        """Where dumps' rows lie in their mappings (shared: one dict, set once a part), and
        each of the ``threads``' share of mapped pages."""

    def __enter__(self) -> ThreadFiles:
        return self

    def __exit__(self, *_: object) -> None:
        for files in self._opened:
            files.__exit__()
        self._opened.clear()

    def mine(self) -> RowFiles:
        """This thread's ``RowFiles``."""
        files: RowFiles | None = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = RowFiles()
            with self._lock:
                self._opened.append(files)
        return files


Threads = tuple["ThreadPoolExecutor", ThreadFiles]
"""The pool that compares layers, and its threads' dump files."""


Piece = tuple[int, int, tuple[list[WorkerRows], list[WorkerRows]]]
"""Request positions ``lo .. hi - 1`` and the rows of each side that hold them."""


def _compare_layer(
    errors: LayerErrors,
    pieces: Sequence[Piece],
    name: str,
    layers: tuple[LayerValues, LayerValues],
    tolerance: tuple[float, float],
    layer_tokens: tuple[np.ndarray, int],
    thread_files: ThreadFiles,
    chunk: int,
) -> int:
    """One layer's batch, piece by piece: both sides' rows read where they lie in the
    dumps' mappings (``chunk`` tokens at a time, their pages released on a budget), else
    decoded into this thread's buffers (small enough to stay in the cache while
    compared), and added to its errors and its row of token bins ``layer_tokens =
    (values, positions per bin)``; returns the bytes read. Where rows were staged, the
    workers' mapped pages are dropped after."""
    read = 0
    row, width = layer_tokens
    native = native_module()
    if native is not None and not reads(native, *(layer.dtype for layer in layers)):
        native = None
    files = thread_files.mine()
    staged = False
    for lo, hi, plans in pieces:
        if native is not None:
            found = thread_files.places.add(
                native, errors, (lo, hi, plans), name, layers, (tolerance, chunk)
            )
            if found is not None:
                token_row, spanned = found
                read += spanned
                np.fmax.at(row, np.arange(lo, hi) // width, token_row)
                continue
        staged = True
        values = []
        for key, plan, layer in zip("pc", plans, layers):
            shape = (layer.heads, hi - lo, layer.elements)
            kind = work_dtype(layer.dtype) if native is None else raw_dtype(layer.dtype)
            buffer = scratch(key, kind, shape)
            held = np.zeros(shape[:2], dtype=bool)
            read += decode_layer(plan, name, layer, (buffer, held), files, raw=native is not None)
            values.append((buffer, held))
        token_row = _add_piece(native, errors, lo, values, layers, tolerance)
        np.fmax.at(row, np.arange(lo, hi) // width, token_row)
    if not staged:
        return read  # the C extension released the mapped pages it read
    # Rows far apart map a large folio of file pages each: dropped at once (another
    # thread's rows of the same files are read again from the page cache if needed).
    workers = {
        id(item.worker): item.worker for *_, plans in pieces for plan in plans for item in plan
    }
    for worker in workers.values():
        worker.drop_pages()
    return read


def _add_piece(
    native: ModuleType | None,
    errors: LayerErrors,
    lo: int,
    values: list[tuple[np.ndarray, np.ndarray]],
    layers: tuple[LayerValues, LayerValues],
    tolerance: tuple[float, float],
) -> np.ndarray:
    """Add a piece of a layer's batch to its errors: both sides' element bits in the C
    extension (``native``), else their decoded values in numpy (one float type for
    both); returns its token row (``add_batch``)."""
    (p, held_p), (c, held_c) = values
    held = held_p & held_c
    if native is not None:
        left, right = ((layer.dtype, layer.head_size, layer.scales) for layer in layers)
        return add_raw_batch(native, errors, lo, (p, c), held, (left, right), tolerance)
    if p.dtype != c.dtype:
        p, c = p.astype(np.float64), c.astype(np.float64)
    return add_batch(errors, lo, p, c, held, tolerance)


def _piece_tokens(
    unit: int, layers: Mapping[str, LayerValues], common: Sequence[str], mapped: bool
) -> int:
    """Tokens per piece: a multiple of ``unit``, about ``PIECE_ELEMENTS`` per side
    (``NATIVE_PIECE_ELEMENTS`` where the C extension is there, ``MAPPED_PIECE_ELEMENTS``
    where it reads both sides' rows in place: ``mapped``)."""
    per_token = max((layers[name].heads * layers[name].elements for name in common), default=1)
    elements = PIECE_ELEMENTS if native_module() is None else NATIVE_PIECE_ELEMENTS
    if mapped and native_module() is not None:
        elements = MAPPED_PIECE_ELEMENTS
    return max(unit, elements // max(per_token, 1) // unit * unit)


def _compare_group(
    sides: tuple[list[SideWorker], list[SideWorker]],
    request_id: str,
    group_id: int,
    num_tokens: int,
    tolerance: tuple[float, float],
    progress: Callable[[int], None] | None,
    batch_bytes: int,
    threads: Threads,
) -> tuple[GroupNumeric | None, list[str]]:
    """One request's group compared by value, and why parts of it are not compared: the
    layers of each batch read and compared on the pool's threads (numpy releases the GIL),
    the sides' mapped pages dropped after each."""
    producer, consumer = sides
    for side, label in ((producer, "producer"), (consumer, "consumer")):
        if not side:
            return None, [f"no {label} worker holds this group and covers it"]
    layers = (side_layers(producer), side_layers(consumer))
    common, reasons = _layer_plan(*layers)
    info = layers[0]
    heads = max((info[name].heads for name in common), default=0)
    width = max(1, -(-num_tokens // MAX_BINS))
    layer_tokens = np.full((len(common), -(-num_tokens // width)), np.nan)
    errors = {name: LayerErrors(info[name].heads) for name in common}
    unit = block_unit(sides)
    mapped = all(getattr(worker, "maps", None) for side in sides for worker, _, _ in side)
    piece = _piece_tokens(unit, info, common, mapped)
    step = max(piece, batch_tokens(sides, batch_bytes) // piece * piece)
    chosen = (attention_views(producer), attention_views(consumer))
    request = (request_id, group_id)
    for lo in range(0, num_tokens, step):
        hi = min(num_tokens, lo + step)
        pieces = [
            (
                start,
                min(hi, start + piece),
                (
                    plan_rows(producer, chosen[0], request, start, min(hi, start + piece)),
                    plan_rows(consumer, chosen[1], request, start, min(hi, start + piece)),
                ),
            )
            for start in range(lo, hi, piece)
        ]
        jobs = [
            threads[0].submit(
                _compare_layer,
                errors[name],
                pieces,
                name,
                (layers[0][name], layers[1][name]),
                tolerance,
                (layer_tokens[index], width),
                threads[1],
                min(unit, CHUNK_TOKENS),
            )
            for index, name in enumerate(common)
        ]
        read = sum(job.result() for job in jobs)
        if progress is not None:
            progress(read)
    flat = [
        item
        for name in common
        for item in errors[name].slices(name, info[name].number, info[name].elements)
    ]
    reasons += [
        f"layer {item.layer} head {item.head}: no token held on both sides"
        for item in flat
        if not item.tokens and num_tokens
    ]
    return GroupNumeric(group_id, common, heads, flat, width, layer_tokens), reasons


def numeric_diff(
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    request_ids: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    batch_bytes: int = BATCH_BYTES,
) -> NumericReport:
    """The producer's raw KV compared with the consumer's by value, request by request
    over the first ``num_tokens[id]`` tokens (those both hold), batch by batch.

    An element fails when ``|consumer - producer| > atol + rtol * |producer|`` or when a
    NaN or Inf is on one side only. Requests one side lacks, layers one side lacks (or
    holds in another shape) and heads no token of which both sides hold are listed as
    not compared; Mamba state layers are compared by checksum only.
    """
    from concurrent.futures import ThreadPoolExecutor  # only when comparing (start-up)

    report = NumericReport(atol, rtol)
    threads = min(THREADS, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool, ThreadFiles(threads) as files:
        _compare_requests(
            report,
            producer,
            consumer,
            num_tokens,
            request_ids,
            progress,
            batch_bytes,
            (pool, files),
        )
    return report


def _compare_requests(
    report: NumericReport,
    producer: Sequence[RawWorker],
    consumer: Sequence[RawWorker],
    num_tokens: Mapping[str, int],
    request_ids: Sequence[str] | None,
    progress: Callable[[int], None] | None,
    batch_bytes: int,
    threads: Threads,
) -> None:
    """Fill the report request by request."""
    atol, rtol = report.atol, report.rtol
    held = [{rid for worker in side for rid in worker.requests} for side in (producer, consumer)]
    ids = sorted(held[0] | held[1]) if request_ids is None else list(request_ids)
    for rid in ids:
        if rid not in held[1]:
            report.only_producer.append(rid)
            continue
        if rid not in held[0]:
            report.only_consumer.append(rid)
            continue
        count = num_tokens.get(rid, 0)
        result = RequestNumeric(rid, count)
        group_ids = sorted(
            {gid for side in (producer, consumer) for w in side for gid in _groups(w, rid)}
        )
        for gid in group_ids:
            sides = (side_workers(producer, rid, gid), side_workers(consumer, rid, gid))
            group, reasons = _compare_group(
                sides, rid, gid, count, (atol, rtol), progress, batch_bytes, threads
            )
            report.not_compared.extend((rid, gid, reason) for reason in reasons)
            if group is not None:
                result.groups[gid] = group
        report.requests[rid] = result


def _groups(worker: RawWorker, request_id: str) -> list[int]:
    """The groups a worker lists blocks of for a request."""
    request = worker.requests.get(request_id)
    return [] if request is None else list(request.groups)
