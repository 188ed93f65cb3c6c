"""One layer of a request's batch compared by value on a pool thread, piece by piece:
both sides' rows read where they lie in the dumps' mappings by the C extension, else
decoded into the thread's buffers and compared there (``kvaudit.numeric`` schedules
requests, layers and threads; docs/numeric.md)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from ..core.elements import work_dtype
from .budget import DEFAULT_BUDGET, NumericBudget
from .mapped_rows import MappedRows
from .model import Tolerance
from .native import add_raw_batch, native_module, raw_dtype, reads
from .reads import LayerValues, RowFiles, WorkerRows, decode_layer
from .value_errors import LayerErrors, add_batch, scratch

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor


def layer_plan(
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

    def __init__(self, threads: int = 1, budget: NumericBudget = DEFAULT_BUDGET) -> None:
        self._local = threading.local()
        self._opened: list[RowFiles] = []
        self._lock = threading.Lock()
        self.budget = budget
        """The comparison's sizes, which every thread's work follows."""
        self.places = MappedRows(max(1, budget.mapped_bytes // threads))
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


def compare_layer(
    errors: LayerErrors,
    pieces: Sequence[Piece],
    name: str,
    layers: tuple[LayerValues, LayerValues],
    tolerance: Tolerance,
    layer_tokens: tuple[np.ndarray, int],
    thread_files: ThreadFiles,
    chunk: int,
    layer_ratios: np.ndarray | None = None,
) -> int:
    """One layer's batch, piece by piece: both sides' rows read where they lie in the
    dumps' mappings (``chunk`` tokens at a time, their pages released on a budget), else
    decoded into this thread's buffers (small enough to stay in the cache while
    compared), and added to its errors and its row of token bins ``layer_tokens =
    (values, positions per bin)`` (and ``layer_ratios``, where given, the same bins of
    the tolerance ratio); returns the bytes read. Where rows were staged, the
    workers' mapped pages are dropped after."""
    read = 0
    row, width = layer_tokens
    native = native_module()
    if native is not None and not reads(native, *(layer.dtype for layer in layers)):
        native = None
    files = thread_files.mine()
    staged = False
    for lo, hi, plans in pieces:
        bins = np.arange(lo, hi) // width
        ratios = np.empty(hi - lo)
        if native is not None:
            stack = ([plans[0]], [plans[1]])
            found = thread_files.places.add(
                native, errors, (lo, hi, stack), name, layers, tolerance, chunk, ratios
            )
            if found is not None:
                token_row, spanned = found
                read += spanned
                np.fmax.at(row, bins, token_row)
                if layer_ratios is not None:
                    np.fmax.at(layer_ratios, bins, ratios)
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
        token_row = _add_piece(
            native,
            errors,
            lo,
            values,
            layers,
            tolerance,
            thread_files.budget.chunk_elements,
            ratios,
        )
        np.fmax.at(row, bins, token_row)
        if layer_ratios is not None:
            np.fmax.at(layer_ratios, bins, ratios)
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
    tolerance: Tolerance,
    chunk_elements: int,
    token_ratio: np.ndarray | None = None,
) -> np.ndarray:
    """Add a piece of a layer's batch to its errors: both sides' element bits in the C
    extension (``native``), else their decoded values in numpy (one float type for
    both, ``chunk_elements`` at a time); returns its token row and fills ``token_ratio``
    (``add_batch``)."""
    (p, held_p), (c, held_c) = values
    held = held_p & held_c
    if native is not None:
        left, right = ((layer.dtype, layer.head_size, layer.scales) for layer in layers)
        return add_raw_batch(
            native, errors, lo, (p, c), held, (left, right), tolerance, token_ratio
        )
    if p.dtype != c.dtype:
        p, c = p.astype(np.float64), c.astype(np.float64)
    return add_batch(errors, lo, p, c, held, tolerance, chunk_elements, token_ratio)


def piece_tokens(
    unit: int,
    layers: Mapping[str, LayerValues],
    common: Sequence[str],
    mapped: bool,
    budget: NumericBudget,
) -> int:
    """Tokens per piece: a multiple of ``unit``, about the budget's piece elements per
    side for the path that compares (numpy, the C extension, or the C extension reading
    both sides' rows in place: ``mapped``)."""
    per_token = max((layers[name].heads * layers[name].elements for name in common), default=1)
    elements = budget.piece_elements_for(native_module() is not None, mapped)
    return max(unit, elements // max(per_token, 1) // unit * unit)


def chunk_tokens(unit: int, budget: NumericBudget) -> int:
    """Tokens per block of rows read in place, for a block unit of ``unit`` tokens."""
    return min(unit, budget.chunk_tokens)
