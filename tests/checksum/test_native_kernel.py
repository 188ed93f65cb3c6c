"""The C loop of the numpy backend (``kvaudit/_native/_row_sums.c``): against the plain
numpy reference of the kernel contract for every layout case (tests/helpers/kernel_cases.py), tiles
of heads and pieces, rows cut short, gathered and consecutive blocks; bit-identical to the
numpy code on random views of every piece size and memory order (hypothesis); checked
bounds; many threads at once, the GIL released. Where the extension did not build, these
tests skip (the numpy code then runs everywhere), unless ``KVAUDIT_REQUIRE_NATIVE=1``."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
from helpers.cpu_launch import cpu_launch, in_order, numpy_launch
from helpers.kernel_cases import CASES, Case, Entry, random_rows, reference
from helpers.native_builds import assert_built_where_required, built, skip_unless_built
from hypothesis import given, settings
from hypothesis import strategies as st

from kvaudit.checksum.kernels import LaunchPart, numpy_cpu
from kvaudit.core import native

NATIVE = built(numpy_cpu.NATIVE)
needs_native = skip_unless_built(NATIVE, numpy_cpu.NATIVE, "the numpy code runs instead")


def test_the_extension_built_where_required() -> None:
    assert_built_where_required(NATIVE, numpy_cpu.NATIVE)


@needs_native
@pytest.mark.parametrize("chunk_rows", [None, 1, 3], ids=["default", "one_row", "three_rows"])
@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_c_loop_matches_reference(name: str, big: bool, chunk_rows: int | None) -> None:
    case = CASES[name]("cpu", big)
    assert numpy_launch(case, chunk_rows, native_loop=True) == reference(case)


@needs_native
@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_c_loop_in_order_matches_reference(name: str, big: bool) -> None:
    """Long runs of consecutive blocks, rows cut short and empty ones among them."""
    case = in_order(CASES[name]("cpu", big), seed=len(name))
    assert numpy_launch(case, native_loop=True) == reference(case)


def tiled_case(heads: int, pieces: int, itemsize: int, seed: int) -> Case:
    """A head-major view of more heads times pieces than one tile of the C loop holds
    (2048 words): tiles of several heads, or of one head's pieces, with a remainder."""
    g = torch.Generator().manual_seed(seed)
    dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    info = torch.iinfo(dtype)
    blocks, tokens = 4, 3
    cache = torch.randint(info.min, info.max, (blocks, heads, tokens, pieces), generator=g)
    cache = cache.to(dtype).unsqueeze(1)
    entries = [Entry(cache, 17 * 65536 + 3, 0, 5, pieces + 9)]
    rows = random_rows(g, 6, blocks, tokens, 1)
    return Case(cache, entries, *rows, aligned=False, keep=[cache])


@needs_native
@pytest.mark.parametrize(
    ("heads", "pieces", "itemsize"),
    [(40, 64, 8), (3, 2500, 8), (70, 33, 2), (2, 4099, 4), (2049, 1, 8)],
)
def test_c_loop_tiles_match_reference(heads: int, pieces: int, itemsize: int) -> None:
    case = tiled_case(heads, pieces, itemsize, seed=heads + pieces)
    assert numpy_launch(case, native_loop=True) == reference(case)


@st.composite
def random_views(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A piece view of random shape, piece size, memory order of its four inner axes,
    steps (reversed, every other) and offset within its allocation, and random rows of
    it: block ids (repeated, in any order), first tokens up to 2**62, valid tokens from
    zero to a whole row."""
    shape = [draw(st.integers(1, 5)), *(draw(st.integers(1, 4)) for _ in range(4))]
    itemsize = draw(st.sampled_from([2, 4, 8]))
    order = [0, *draw(st.permutations([1, 2, 3, 4]))]
    steps = [draw(st.sampled_from([1, 2, -1])) for _ in range(5)]
    offset = draw(st.sampled_from([0, 2, 4, 6]))  # bytes
    seed = draw(st.integers(0, 2**32 - 1))
    stored = [shape[axis] * abs(steps[axis]) for axis in order]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, int(np.prod(stored)) * itemsize + offset, dtype=np.uint8)
    flat = raw[offset:].view(f"<i{itemsize}")  # signed, as the plans give them
    allocation = flat.reshape(stored).transpose(np.argsort(order))
    view = allocation[tuple(slice(None, None, step) for step in steps)]
    blocks, kernel_blocks, _, tokens, _ = view.shape
    rows = draw(st.integers(1, 12))
    block_ids = rng.integers(0, blocks, rows)
    first = rng.integers(0, 2**62, rows)
    valid = rng.integers(0, kernel_blocks * tokens + 1, rows)
    return view, block_ids, first, valid


def launch_both(
    view: np.ndarray, block_ids: np.ndarray, first: np.ndarray, valid: np.ndarray
) -> list[list[int]]:
    """The numpy backend's sums of the rows by the C loop and by the numpy code, as rows
    of two unsigned values each."""
    outs = []
    for native_loop in (True, False):
        parts = [LaunchPart(view, 5 * 65536 + 2, column=0, piece_offset=1, cell_pieces=9)]
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(native.ENVIRONMENT, "1" if native_loop else "0")
            launch = numpy_cpu.NumpyLaunch(parts)
        assert (launch.parts[0].native is not None) == native_loop
        out = np.zeros((len(block_ids), 1), dtype=np.int64)
        launch.accumulate(block_ids, first, valid, out)
        outs.append(out.view(np.uint64)[:, 0].tolist())
    return [list(pair) for pair in zip(*outs, strict=True)]


@needs_native
@settings(max_examples=150, deadline=None)
@given(random_views())
def test_c_loop_matches_numpy_code_on_random_views(
    drawn: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> None:
    for c_loop, numpy_code in launch_both(*drawn):
        assert c_loop == numpy_code


@needs_native
def test_random_views_cover_what_the_c_loop_tells_apart() -> None:
    """The strategy above draws every piece size, strided and reversed pieces, and views
    that do not start at an element boundary of 8 bytes: its cases are not all alike."""
    seen: set[str] = set()

    @settings(max_examples=150, deadline=None)
    @given(random_views())
    def collect(drawn: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
        view = drawn[0]
        seen.add(f"{view.itemsize} bytes")
        seen.add("contiguous pieces" if view.strides[4] == view.itemsize else "strided pieces")
        if view.strides[4] < 0:
            seen.add("reversed pieces")
        if view.ctypes.data % 8:
            seen.add("unaligned")

    collect()
    expected = {"2 bytes", "4 bytes", "8 bytes", "contiguous pieces", "strided pieces"}
    assert {*expected, "reversed pieces", "unaligned"} <= seen


def direct_arguments(
    blocks: int = 3,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Valid arguments of ``row_sums`` over a ``[blocks, 1, 2, 4, 3]`` int64 view."""
    view = np.arange(blocks * 24, dtype=np.int64).reshape(blocks, 1, 2, 4, 3)
    rows = np.arange(blocks, dtype=np.int64)
    return (
        view,
        rows,
        rows * 4,
        np.full(blocks, 4, dtype=np.int64),
        np.ones(6, dtype=np.int64),
        np.ones(2, dtype=np.int64),
        np.zeros(blocks, dtype=np.int64),
    )


@needs_native
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({1: np.array([0, 3, 1])}, IndexError, "block id 3 is outside the view's 3 blocks"),
        ({1: np.array([0, -1, 1])}, IndexError, "block id -1 is outside"),
        ({3: np.array([4, 5, 4])}, ValueError, "5 valid tokens in a row of 4"),
        ({3: np.array([4, -1, 4])}, ValueError, "-1 valid tokens"),
        ({0: np.zeros((3, 1, 2, 4), np.int64)}, ValueError, "pieces must be a 5-D array"),
        ({0: np.zeros((3, 1, 2, 4, 3), np.float64)}, ValueError, "pieces must be a 5-D array"),
        ({0: np.zeros((3, 1, 2, 4, 3), np.uint8)}, ValueError, "pieces must be a 5-D array"),
        ({4: np.ones(5, np.int64)}, ValueError, "piece_weights holds 5 values, expected 6"),
        ({5: np.ones(3, np.int64)}, ValueError, "head_weights holds 3 values, expected 2"),
        ({2: np.zeros(2, np.int64)}, ValueError, "first_tokens holds 2 values, expected 3"),
        ({1: np.arange(6, dtype=np.int64)[::2]}, ValueError, "block_ids must be a contiguous"),
        ({6: np.zeros(3, np.int32)}, ValueError, "sums must be a contiguous 1-D int64"),
        ({6: np.zeros(3, np.int64)[:0:1]}, ValueError, "sums holds 0 values, expected 3"),
    ],
)
def test_c_loop_checks_its_arguments(change: dict, error: type, message: str) -> None:
    """A wrong block id or count never reads outside the view: the call refuses it before
    reading, as it refuses arrays of other shapes or types."""
    assert NATIVE is not None
    arguments = list(direct_arguments())
    for index, value in change.items():
        arguments[index] = value
    with pytest.raises(error, match=message):
        NATIVE.row_sums(*arguments)


@needs_native
def test_c_loop_writes_only_into_writable_sums() -> None:
    assert NATIVE is not None
    arguments = list(direct_arguments())
    arguments[6].flags.writeable = False
    with pytest.raises((BufferError, TypeError, ValueError)):
        NATIVE.row_sums(*arguments)
    with pytest.raises(TypeError, match="7 arguments"):
        NATIVE.row_sums(*arguments[:6])


@needs_native
def test_c_loop_reads_a_read_only_mapping(tmp_path: os.PathLike) -> None:
    """A dump's mapping is read-only: the C loop reads it as numpy does."""
    case = CASES["nthc_two_layers"]("cpu", False)
    path = os.path.join(tmp_path, "pieces.bin")
    case.template.contiguous().numpy().tofile(path)
    mapped = np.memmap(path, dtype=np.int64, mode="r", shape=tuple(case.template.shape))
    assert not mapped.flags.writeable
    rows = np.array(case.block_ids, dtype=np.int64)
    first = np.array(case.first_tokens, dtype=np.int64)
    valid = np.array(case.valid_tokens, dtype=np.int64)
    assert launch_both(np.asarray(mapped), rows, first, valid) == launch_both(
        case.template.contiguous().numpy(), rows, first, valid
    )


@needs_native
def test_many_threads_at_once_match_one() -> None:
    """Sixteen threads calling the C loop on one view at once (the GIL released, so they
    overlap) each get the sums one call alone gets."""
    assert NATIVE is not None
    case = CASES["planes_per_block"]("cpu", True)
    launch = cpu_launch(case, native_loop=True)
    part = launch.parts[0]
    g = np.random.default_rng(3)
    blocks = part.blocks.shape[0]
    tasks = [
        (g.integers(0, blocks, 200), g.integers(0, 2**40, 200), g.integers(0, 17, 200))
        for _ in range(16)
    ]
    alone = [part.native_row_sums(*task) for task in tasks]
    together: list[np.ndarray | None] = [None] * len(tasks)
    start = threading.Barrier(len(tasks))

    def run(index: int) -> None:
        start.wait()
        together[index] = part.native_row_sums(*tasks[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(tasks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for mine, one in zip(together, alone, strict=True):
        assert mine is not None and mine.tolist() == one.tolist()


@needs_native
def test_c_loop_releases_the_gil() -> None:
    """While one long call runs (about 1.6 GB read from cache), this thread runs Python."""
    assert NATIVE is not None
    view = np.random.default_rng(0).integers(0, 2**62, (64, 2, 8, 16, 64))
    rows = np.tile(np.arange(64, dtype=np.int64), 200)
    arguments = (
        view,
        rows,
        np.zeros(len(rows), dtype=np.int64),
        np.full(len(rows), 32, dtype=np.int64),
        np.ones(8 * 64, dtype=np.int64),
        np.ones(8, dtype=np.int64),
        np.zeros(len(rows), dtype=np.int64),
    )
    running = threading.Event()
    ended = threading.Event()

    def call() -> None:
        running.set()
        NATIVE.row_sums(*arguments)
        ended.set()

    thread = threading.Thread(target=call)
    thread.start()
    running.wait()
    steps = 0
    while not ended.is_set():
        steps += 1
        threading.Event().wait(0.001)
    thread.join()
    # Holding the GIL, the call would let this loop run once at most.
    assert steps >= 5


def test_kvaudit_native_0_runs_the_numpy_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVAUDIT_NATIVE=0`` makes the backend's parts run numpy; unset, the C loop where
    it built."""
    parts = [LaunchPart(np.zeros((2, 1, 1, 2, 2), dtype=np.int64), 0, 0, 0, 2)]
    monkeypatch.setenv(native.ENVIRONMENT, "0")
    assert numpy_cpu.NumpyLaunch(parts).parts[0].native is None
    monkeypatch.delenv(native.ENVIRONMENT)
    assert numpy_cpu.NumpyLaunch(parts).parts[0].native is NATIVE
