"""The numpy CPU path (``kvaudit/checksum/kernels/numpy_cpu.py``) against the plain numpy reference
of the kernel contract that the Triton kernel is held to (tests/checksum/test_triton_kernel.py):
every layout case, rows in chunks of every size, consecutive rows read in place and
scattered rows gathered, rows cut short mixed with full ones in one chunk. These run the
numpy code (as ``KVAUDIT_NATIVE=0`` does); the C loop has tests/checksum/test_native_kernel.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.cpu_launch import in_order, numpy_launch
from helpers.kernel_cases import CASES, reference

from kvaudit.checksum.kernels import numpy_cpu

# Rows per chunk: the default (from CHUNK_BYTES), one, and three (so that chunks end
# inside runs of consecutive rows and hold rows of several counts).
CHUNK_ROWS = {"default": None, "one_row": 1, "three_rows": 3}


@pytest.fixture(params=list(CHUNK_ROWS))
def chunk_rows(request: pytest.FixtureRequest) -> int | None:
    """Each chunk size in turn."""
    return CHUNK_ROWS[request.param]


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_numpy_launch_matches_reference(name: str, big: bool, chunk_rows: int | None) -> None:
    case = CASES[name]("cpu", big)
    assert numpy_launch(case, chunk_rows) == reference(case)


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_numpy_launch_in_order_matches_reference(
    name: str, big: bool, chunk_rows: int | None
) -> None:
    """Blocks read in place as long runs, cut rows inside the runs."""
    case = in_order(CASES[name]("cpu", big), seed=len(name))
    assert numpy_launch(case, chunk_rows) == reference(case)


def test_cases_read_rows_in_place_and_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-order cases take the in-place path and the gathered one, and chunks hold rows
    of several counts: what the tests above rely on to cover both."""
    seen = {"view": 0, "gather": 0, "mixed counts": 0}
    lock = threading.Lock()  # the spies run on the pool's threads
    rows = numpy_cpu.NumpyPart._rows
    sums = numpy_cpu.NumpyPart.numpy_row_sums

    def spy_rows(self: numpy_cpu.NumpyPart, block_ids: np.ndarray) -> np.ndarray:
        x = rows(self, block_ids)
        kind = "view" if np.shares_memory(x, self.blocks) else "gather"
        with lock:
            seen[kind] += 1
        return x

    def spy_sums(
        self: numpy_cpu.NumpyPart, block_ids: np.ndarray, first: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        mixed = len(np.unique(counts)) > 1
        with lock:
            seen["mixed counts"] += mixed
        return sums(self, block_ids, first, counts)

    monkeypatch.setattr(numpy_cpu.NumpyPart, "_rows", spy_rows)
    monkeypatch.setattr(numpy_cpu.NumpyPart, "numpy_row_sums", spy_sums)
    numpy_launch(in_order(CASES["nthc_two_layers"]("cpu", True), seed=1), chunk_rows=3)
    assert all(seen.values()), seen


def test_pool_returns_in_order_and_raises_the_first_error() -> None:
    """The chunks' pool: results in the items' order whatever thread ends first, the
    first item's error (in order) raised in the caller, and the pool usable after it."""
    pool = numpy_cpu.shared_pool()
    threads = set()

    def slow_first(item: int) -> int:
        threads.add(threading.current_thread().name)
        if item == 0:
            threading.Event().wait(0.05)
        return item * item

    assert pool.map(slow_first, range(40)) == [item * item for item in range(40)]
    assert all(name.startswith("kvaudit-numpy") for name in threads)

    def failing(item: int) -> int:
        if item in (5, 9):
            raise ValueError(f"item {item}")
        return item

    with pytest.raises(ValueError, match="item 5"):
        pool.map(failing, range(12))
    assert pool.map(failing, range(4)) == [0, 1, 2, 3]
    assert pool.map(failing, []) == []
