"""The C loop's fast path (``kvaudit/_native/_row_sums.c``, ``row_sum_words``): contiguous
8-byte pieces, a multiple of 4 a cell, which every 16-bit or 8-bit KV cache of whole
32-byte rows takes. Against the plain numpy reference of the kernel contract
(tests/helpers/kernel_cases.py), on every way the path splits its work: chunks of 4, 2
and 1 tokens (every count from 0 to a whole row), one run of all heads (heads contiguous)
or one run per head (head-major and strided heads), tiles of heads and of pieces (more
than 1024 words a token), kernel blocks, unaligned views, values near the wrap-around,
and cells of 4 to 1028 pieces. Where the extension did not build, these tests skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.cpu_launch import numpy_launch
from helpers.kernel_cases import Case, Entry, H, reference
from helpers.native_builds import built, skip_unless_built

from kvaudit.checksum.kernels import LaunchPart, numpy_cpu
from kvaudit.core import native

NATIVE = built(numpy_cpu.NATIVE)
needs_native = skip_unless_built(NATIVE, numpy_cpu.NATIVE, "the numpy code runs instead")


def words_case(
    *,
    heads: int,
    pieces: int,
    tokens: int = 16,
    kernel_blocks: int = 1,
    layout: str = "NTHC",
    offset_words: int = 0,
    extremes: bool = False,
    seed: int = 0,
) -> Case:
    """A view of int64 pieces in ``layout`` (NTHC: a token's heads one after the other;
    HND: a head's tokens one after the other; gapped: NTHC with a cell's gap after each
    token's heads; K: the first halves of cells twice as long, so that heads lie two
    cells apart) starting ``offset_words`` past its allocation, and rows that cover every
    valid token count from 0 to a whole row, block after block."""
    g = torch.Generator().manual_seed(seed)
    blocks = 3
    cells = heads + 1 if layout == "gapped" else heads
    count = blocks * kernel_blocks * tokens * cells * pieces * (2 if layout == "K" else 1)
    if extremes:
        values = torch.tensor([2**63 - 1, -(2**63), -1, 2**63 - 3, 1], dtype=torch.int64)
        flat = values[torch.randint(0, len(values), (count + offset_words,), generator=g)]
    else:
        flat = torch.randint(-(2**63), 2**63 - 1, (count + offset_words,), generator=g)
    data = flat[offset_words:]
    if layout == "HND":
        view = data.view(blocks, kernel_blocks, heads, tokens, pieces)
    elif layout == "gapped":
        cut = data.view(blocks, kernel_blocks, tokens, cells, pieces)[:, :, :, :heads]
        view = cut.permute(0, 1, 3, 2, 4)
    elif layout == "K":
        halves = data.view(blocks, kernel_blocks, tokens, heads, 2 * pieces)
        view = halves[..., :pieces].permute(0, 1, 3, 2, 4)
    else:
        view = data.view(blocks, kernel_blocks, tokens, heads, pieces).permute(0, 1, 3, 2, 4)
    per_row = kernel_blocks * tokens
    block_ids = [row % blocks for row in range(per_row + 1)]
    valid = list(range(per_row + 1))
    first = [(1 << 61) + 977 * row if extremes else 16 * row + 3 for row in range(per_row + 1)]
    start = torch.randint(-(2**62), 2**62, (per_row + 1, 1), generator=g).tolist()
    entries = [Entry(view, 21 * H + 60_000, 0, 5, pieces + 12)]
    return Case(view, entries, block_ids, first, valid, start, aligned=False, keep=[flat])


def in_fast_path(case: Case) -> bool:
    """Whether the C loop takes its fast path for the case's view."""
    view = case.entries[0].view
    return view.element_size() == 8 and view.stride(4) == 1 and view.shape[4] % 4 == 0


CELLS = [4, 8, 12, 16, 20, 28, 32, 36, 64, 144]


@needs_native
@pytest.mark.parametrize("pieces", CELLS)
@pytest.mark.parametrize("layout", ["NTHC", "HND", "gapped", "K"])
def test_fast_path_matches_reference(layout: str, pieces: int) -> None:
    case = words_case(heads=4, pieces=pieces, layout=layout, seed=pieces)
    assert in_fast_path(case)
    assert numpy_launch(case, native_loop=True) == reference(case)


@needs_native
@pytest.mark.parametrize(
    ("heads", "pieces", "layout"),
    [
        (40, 32, "NTHC"),  # 1280 words a token: tiles of 32 heads and of 8
        (33, 32, "HND"),
        (2, 1028, "NTHC"),  # a tile of one head's first 1024 pieces, then 4 more
        (1, 2052, "HND"),
        (8, 128, "NTHC"),  # one tile of exactly 1024 words
    ],
)
def test_fast_path_tiles_match_reference(heads: int, pieces: int, layout: str) -> None:
    case = words_case(heads=heads, pieces=pieces, tokens=5, layout=layout, seed=heads)
    assert numpy_launch(case, native_loop=True) == reference(case)


@needs_native
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("kernel_blocks", [1, 2, 3])
def test_fast_path_kernel_blocks_and_token_chunks(kernel_blocks: int, tokens: int) -> None:
    """Counts that end within any kernel block, after any chunk of 4, 2 or 1 tokens."""
    case = words_case(heads=2, pieces=8, tokens=tokens, kernel_blocks=kernel_blocks, seed=tokens)
    assert numpy_launch(case, native_loop=True) == reference(case)


@needs_native
@pytest.mark.parametrize("offset_words", [1, 3])
def test_fast_path_unaligned_views(offset_words: int) -> None:
    case = words_case(heads=4, pieces=32, layout="NTHC", offset_words=offset_words)
    assert numpy_launch(case, native_loop=True) == reference(case)


@needs_native
@pytest.mark.parametrize("offset_bytes", [2, 4])
def test_fast_path_reads_views_off_the_word_boundary(offset_bytes: int) -> None:
    """A view ``offset_bytes`` past an 8-byte boundary (a dump's tensor may start at any
    byte): read where it lies, it sums as its aligned copy does in the reference."""
    g = np.random.default_rng(offset_bytes)
    shape = (3, 2, 4, 5, 16)
    raw = g.integers(0, 256, int(np.prod(shape)) * 8 + offset_bytes, dtype=np.uint8)
    view = raw[offset_bytes:].view(np.int64).reshape(shape)
    assert view.ctypes.data % 8 and view.strides[4] == 8
    copy = torch.from_numpy(view.copy())
    block_ids = [0, 1, 2, 1, 0, 2, 1]
    valid = [10, 9, 5, 4, 3, 1, 0]
    first = [0, 7, 1 << 40, 2, 99, 5, 1]
    case = Case(
        copy,
        [Entry(copy, 5 * H + 1, 0, 3, 20)],
        block_ids,
        first,
        valid,
        [[0] for _ in block_ids],
        aligned=False,
        keep=[copy],
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(native.ENVIRONMENT, "1")
        launch = numpy_cpu.NumpyLaunch([LaunchPart(view, 5 * H + 1, 0, 3, 20)])
    assert launch.parts[0].native is not None
    out = np.zeros((len(block_ids), 1), dtype=np.int64)
    launch.accumulate(
        np.array(block_ids, dtype=np.int64),
        np.array(first, dtype=np.int64),
        np.array(valid, dtype=np.int64),
        out,
    )
    assert out.view(np.uint64).tolist() == reference(case)


@needs_native
@pytest.mark.parametrize("pieces", [16, 32])
def test_fast_path_near_the_wrap_around(pieces: int) -> None:
    case = words_case(heads=8, pieces=pieces, extremes=True, seed=pieces)
    assert numpy_launch(case, native_loop=True) == reference(case)


@needs_native
@pytest.mark.parametrize("pieces", [4, 32, 36])
def test_fast_path_matches_numpy_code(pieces: int) -> None:
    """The fast path and the numpy code (``KVAUDIT_NATIVE=0``) agree bit for bit."""
    case = words_case(heads=5, pieces=pieces, kernel_blocks=2, layout="NTHC", seed=7)
    assert numpy_launch(case, native_loop=True) == numpy_launch(case, native_loop=False)
