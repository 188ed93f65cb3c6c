"""The C comparison reading rows where they lie (``compare_mapped``,
``kvaudit/_mapped_rows.h``): rows scattered over several buffers in one or two parts give
the same figures, bit for bit, as the same rows staged in ``[heads, tokens, elements]``
order (``compare``), whatever the dtypes, scales, chunks and visiting order; rows not held
are never read; locations outside their mapping, parts that do not tile a row and
wrongly sized locations are refused with a ValueError before anything is read; a file
mapping's pages read are released by the end of a call (its RSS falls) and read again
after, and during a call once they reach the release budget (the peak RSS says so).
Skipped where the extension did not build, unless ``KVAUDIT_REQUIRE_NATIVE=1``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.native_builds import built, skip_unless_built

from kvaudit.core.dtypes import parse_dtype, torch_dtype
from kvaudit.core.mapping import FileMap
from kvaudit.numeric.model import Tolerance
from kvaudit.numeric.native import PARTS, SCALES, add_mapped_batch, add_raw_batch
from kvaudit.numeric.value_errors import LayerErrors

NAME = "kvaudit._native._element_errors"
NATIVE = built(NAME)
pytestmark = skip_unless_built(NATIVE, NAME, "diff --numeric reads rows in Python instead")
HEADS, TOKENS, ELEMENTS, HEAD_SIZE = 3, 11, 12, 5


def to_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float values as the raw bits of ``dtype`` (an unsigned integer array), by torch."""
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    raw = tensor.to(torch_dtype(parse_dtype(dtype))).view(torch.uint8).numpy()
    size = parse_dtype(dtype).itemsize
    kind = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    return raw.view(kind).reshape(values.shape)


def scattered(
    bits: np.ndarray, parts: PARTS, maps: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], np.ndarray]:
    """Every row's parts copied to a slot of its own, in random order, in one of ``maps``
    buffers (with a byte of padding between slots); returns the buffers and the
    locations ``[parts, heads, tokens, 2]``."""
    heads, tokens, _ = bits.shape
    size = bits.itemsize
    slot = max(width for _, width in parts) * size + 1
    count = len(parts) * heads * tokens
    per_map = -(-count // maps)
    buffers = [np.zeros(per_map * slot + 3, dtype=np.uint8) for _ in range(maps)]
    where = np.zeros((len(parts), heads, tokens, 2), dtype=np.int64)
    order = rng.permutation(count)
    raw = bits.view(np.uint8).reshape(heads, tokens, -1)
    for index, (e, h, t) in enumerate(np.ndindex(len(parts), heads, tokens)):
        start, width = parts[e]
        place = int(order[index])
        buffer, offset = place % maps, place // maps * slot + 1
        buffers[buffer][offset : offset + width * size] = raw[
            h, t, start * size : (start + width) * size
        ]
        where[e, h, t] = (buffer, offset)
    return buffers, where


def both_ways(
    values: tuple[np.ndarray, np.ndarray],
    dtypes: tuple[str, str],
    scales: tuple[SCALES, SCALES],
    parts: tuple[PARTS, PARTS],
    order: tuple[int, int, bool],
    seed: int,
) -> None:
    """The batch staged and scattered: every figure the same bits."""
    rng = np.random.default_rng(seed)
    bits = tuple(to_bits(v, d) for v, d in zip(values, dtypes))
    held = rng.random((HEADS, TOKENS)) > 0.2
    sides = tuple((parse_dtype(d), HEAD_SIZE, s) for d, s in zip(dtypes, scales))
    staged, mapped = LayerErrors(HEADS), LayerErrors(HEADS)
    want = add_raw_batch(NATIVE, staged, 7, bits, held, sides, Tolerance(0.01, 0.05))  # type: ignore[arg-type]
    p_maps, p_where = scattered(bits[0], parts[0], 2, rng)
    c_maps, c_where = scattered(bits[1], parts[1], 3, rng)
    c_where[..., 0] += len(p_maps)
    located = ((p_where, parts[0]), (c_where, parts[1]))
    got = add_mapped_batch(
        NATIVE,
        mapped,
        7,
        [*p_maps, *c_maps],
        located,
        held,
        sides,
        Tolerance(0.01, 0.05),
        order,  # type: ignore[arg-type]
    )
    np.testing.assert_array_equal(got, want)
    for name in ("figures", "counts", "worst_error", "worst_position"):
        np.testing.assert_array_equal(getattr(mapped, name), getattr(staged, name))
    assert staged.counts[0].sum() == held.sum()


WHOLE: PARTS = ((0, ELEMENTS),)
K_AND_V: PARTS = ((0, HEAD_SIZE), (HEAD_SIZE, ELEMENTS - HEAD_SIZE))


@pytest.mark.parametrize(
    "dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
)
@pytest.mark.parametrize("parts", [(WHOLE, WHOLE), (K_AND_V, WHOLE), (K_AND_V, K_AND_V)])
@pytest.mark.parametrize("order", [(0, 0, False), (4, 0, True), (1, 0, False), (3, 0, True)])
def test_rows_in_place_equal_rows_staged(
    dtype: str, parts: tuple[PARTS, PARTS], order: tuple[int, int, bool]
) -> None:
    rng = np.random.default_rng(len(dtype) + order[0])
    p = rng.normal(0, 2, (HEADS, TOKENS, ELEMENTS))
    c = p * (1 + rng.normal(0, 0.03, p.shape))
    c[1, 4, 2] = np.nan  # one side only: the element-by-element way
    both_ways((p, c), (dtype, dtype), ((None, None), (None, None)), parts, order, seed=3)


def test_fp8_with_scales_against_bf16_in_place() -> None:
    rng = np.random.default_rng(9)
    p = rng.normal(0, 2, (HEADS, TOKENS, ELEMENTS))
    c = p / 0.5
    scales: tuple[SCALES, SCALES] = ((None, None), (0.5, 0.25))
    for dtypes in (("bfloat16", "float8_e4m3fn"), ("float8_e5m2", "float32")):
        both_ways((p, c), dtypes, scales, (WHOLE, K_AND_V), (2, 0, True), seed=4)


def located_call(
    maps: list[np.ndarray],
    where: np.ndarray,
    held: np.ndarray,
    parts: PARTS = WHOLE,
    c_parts: PARTS | None = None,
) -> None:
    """compare_mapped of bf16 rows, both sides at ``where`` (the consumer's rows in
    ``c_parts`` where given, else in ``parts`` too)."""
    errors = LayerErrors(HEADS)
    side = (parse_dtype("bfloat16"), HEAD_SIZE, (None, None))
    located = ((where, parts), (where, parts if c_parts is None else c_parts))
    sides = (side, side)
    add_mapped_batch(NATIVE, errors, 0, maps, located, held, sides, Tolerance())  # type: ignore[arg-type]


def test_locations_outside_their_mapping_are_refused() -> None:
    maps = [np.zeros(4096, dtype=np.uint8), np.zeros(100, dtype=np.uint8)]
    held = np.ones((HEADS, TOKENS), dtype=bool)
    where = np.zeros((1, HEADS, TOKENS, 2), dtype=np.int64)
    located_call(maps, where, held)  # every row at the start of the first map: fine
    bad = {
        "past the end": (0, 4096 - 2 * ELEMENTS + 1),
        "negative": (0, -1),
        "a short map": (1, 100 - 2 * ELEMENTS + 2),
        "no such map": (2, 0),
        "a negative map": (-1, 0),
    }
    for where_to in bad.values():
        wrong = where.copy()
        wrong[0, 2, 7] = where_to
        with pytest.raises(ValueError, match=r"head 2 token 7: part 0 .* lies outside"):
            located_call(maps, wrong, held)
        not_held = held.copy()
        not_held[2, 7] = False
        located_call(maps, wrong, not_held)  # a row not held is never read


def test_bad_parts_and_locations_are_refused() -> None:
    maps = [np.zeros(4096, dtype=np.uint8)]
    held = np.ones((HEADS, TOKENS), dtype=bool)
    where = np.zeros((2, HEADS, TOKENS, 2), dtype=np.int64)
    for parts in (
        ((0, 4), (5, ELEMENTS - 5)),
        ((4, 8), (0, 4)),
        ((0, 0), (0, 12)),
    ):
        with pytest.raises(ValueError, match="tile"):
            located_call(maps, where, held, parts)
    with pytest.raises(ValueError, match="tile"):
        located_call(maps, where, held, K_AND_V, ((0, 4), (4, 4)))  # 8 elements, not 12
    with pytest.raises(ValueError, match="holds"):
        located_call(maps, where, held, WHOLE)  # two parts' locations for one
    with pytest.raises(ValueError, match="holds"):
        located_call(maps, where[:, :, :-1].copy(), held, K_AND_V)


def mapping_rss(address: int) -> int:
    """The resident kB of this process's mapping that starts at ``address``."""
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        lines = smaps.read().splitlines()
    start = f"{address:x}-"
    for index, line in enumerate(lines):
        if line.startswith(start):
            rss = next(entry for entry in lines[index + 1 :] if entry.startswith("Rss:"))
            return int(rss.split()[1])
    raise AssertionError("no such mapping")


def spread_rows(
    tmp_path: Path, rows: int, row_bytes: int, spacing: int
) -> tuple[FileMap, np.ndarray, np.ndarray]:
    """A file of one head's ``rows`` bf16 rows of ``row_bytes``, row t at byte
    ``t * spacing`` (the rest a hole, holding no page cache), mapped; the rows' bits and
    their locations ``[1, 1, rows, 2]``."""
    rng = np.random.default_rng(rows)
    bits = to_bits(rng.normal(0, 1, (1, rows, row_bytes // 2)), "bfloat16")
    path = tmp_path / "rows.bin"
    where = np.zeros((1, 1, rows, 2), dtype=np.int64)
    with open(path, "wb") as file:
        for t in range(rows):
            file.seek(t * spacing)
            file.write(bits[0, t].tobytes())
            where[0, 0, t] = (0, t * spacing)
        file.truncate(rows * spacing)
    return FileMap(str(path)), bits, where


def compare_spread(
    mapped: FileMap, bits: np.ndarray, where: np.ndarray, release: int
) -> LayerErrors:
    """One call comparing the spread rows with themselves, a token per chunk."""
    _, rows, elements = bits.shape
    errors = LayerErrors(1)
    side = (parse_dtype("bfloat16"), elements // 2, (None, None))
    got = add_mapped_batch(
        NATIVE, errors, 0, [mapped.buffer], ((where, ((0, elements),)), (where, ((0, elements),))),
        np.ones((1, rows), dtype=bool), (side, side), Tolerance(), (1, release, False),  # type: ignore[arg-type]
    )  # fmt: skip
    np.testing.assert_array_equal(got, np.zeros(rows))
    return errors


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps")
@pytest.mark.parametrize("release", [1, 3 << 20, 1 << 40])
def test_a_file_mappings_pages_are_released_by_the_end_of_a_call(
    tmp_path: Path, release: int
) -> None:
    """Whatever the budget, no page of the rows read is left resident after the call,
    and the pages released are read again by the next call, to the same figures."""
    mapped, bits, where = spread_rows(tmp_path, 6, 64 << 10, 2 << 20)
    staged = LayerErrors(1)
    side = (parse_dtype("bfloat16"), bits.shape[2] // 2, (None, None))
    held = np.ones((1, bits.shape[1]), dtype=bool)
    add_raw_batch(NATIVE, staged, 0, (bits, bits), held, (side, side), Tolerance())  # type: ignore[arg-type]
    for _ in range(2):
        errors = compare_spread(mapped, bits, where, release)
        assert mapping_rss(mapped.address) == 0
        for name in ("figures", "counts", "worst_error", "worst_position"):
            np.testing.assert_array_equal(getattr(errors, name), getattr(staged, name))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps")
def test_without_a_budget_the_pages_read_stay_resident(tmp_path: Path) -> None:
    mapped, bits, where = spread_rows(tmp_path, 6, 64 << 10, 2 << 20)
    compare_spread(mapped, bits, where, 0)
    assert mapping_rss(mapped.address) >= 6 * 64


def peak_growth_kib(call: Callable[[], object]) -> int:
    """How far this process's peak RSS rose above its RSS during ``call`` (kB): the peak
    is reset first (``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")
    before = status_kib("VmRSS")
    if status_kib("VmHWM") > before + 1024:
        pytest.skip("this kernel does not reset the peak RSS (clear_refs 5)")
    call()
    return status_kib("VmHWM") - before


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in kB."""
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="no peak RSS reset (clear_refs)"
)
def test_the_budget_bounds_the_pages_a_call_holds(tmp_path: Path) -> None:
    """32 rows of 256 KiB, each in a 2 MiB region of its own: with a budget of one region
    the call holds about one row's pages at a time, without a budget all 8 MiB (the peak
    RSS during the call says so)."""
    mapped, bits, where = spread_rows(tmp_path, 32, 256 << 10, 2 << 20)
    compare_spread(mapped, bits, where, 1)  # the rows in the page cache, the code warm
    bounded = min(
        peak_growth_kib(lambda: compare_spread(mapped, bits, where, 2 << 20)) for _ in range(3)
    )
    unbounded = peak_growth_kib(lambda: compare_spread(mapped, bits, where, 1 << 40))
    assert unbounded >= 28 * 256  # about 32 rows (VmRSS before is less exact)
    assert bounded <= 4 * 256, (bounded, unbounded)


def compare_heads(
    mapped: FileMap, bits: np.ndarray, where: np.ndarray, release: int, by_head: bool
) -> None:
    """One call comparing the spread rows with themselves as one token of as many heads
    (as several requests' heads are compared at once), head by head."""
    _, rows, elements = bits.shape
    heads_where = np.ascontiguousarray(where.transpose(0, 2, 1, 3))  # [1, rows, 1, 2]
    side = (parse_dtype("bfloat16"), elements // 2, (None, None))
    whole = ((0, elements),)
    got = add_mapped_batch(
        NATIVE, LayerErrors(rows), 0, [mapped.buffer], ((heads_where, whole), (heads_where, whole)),
        np.ones((rows, 1), dtype=bool), (side, side), Tolerance(), (1, release, False),  # type: ignore[arg-type]
        by_head=by_head,
    )  # fmt: skip
    np.testing.assert_array_equal(got, np.zeros((rows, 1) if by_head else 1))


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="no peak RSS reset (clear_refs)"
)
def test_heads_of_several_requests_are_released_head_by_head(tmp_path: Path) -> None:
    """32 heads of one token, each row in a 2 MiB region of its own (as 32 requests'
    rows lie): with token rows per head the budget is checked after each head, so the
    call holds about one row at a time; with one token row, after the whole chunk."""
    mapped, bits, where = spread_rows(tmp_path, 32, 256 << 10, 2 << 20)
    compare_heads(mapped, bits, where, 1, True)  # the rows in the page cache, the code warm
    by_head = min(
        peak_growth_kib(lambda: compare_heads(mapped, bits, where, 2 << 20, True)) for _ in range(3)
    )
    by_chunk = peak_growth_kib(lambda: compare_heads(mapped, bits, where, 2 << 20, False))
    assert by_chunk >= 28 * 256
    assert by_head <= 4 * 256, (by_head, by_chunk)


def test_token_rows_per_head(tmp_path: Path) -> None:
    """With ``by_head`` each head's token row is the one a call holding only that head
    gives (NaN where it holds no row), and their largest is the one token row."""
    rng = np.random.default_rng(8)
    p = rng.normal(0, 1, (HEADS, TOKENS, ELEMENTS))
    c = p + rng.normal(0, 0.1, p.shape)
    bits = (to_bits(p, "bfloat16"), to_bits(c, "bfloat16"))
    maps_p, where_p = scattered(bits[0], WHOLE, 1, rng)
    maps_c, where_c = scattered(bits[1], WHOLE, 1, rng)
    where_c[..., 0] += 1
    held = rng.random((HEADS, TOKENS)) > 0.3
    side = (parse_dtype("bfloat16"), HEAD_SIZE, (None, None))

    def call(mask: np.ndarray, by_head: bool) -> np.ndarray:
        return add_mapped_batch(
            NATIVE, LayerErrors(HEADS), 0, [*maps_p, *maps_c], ((where_p, WHOLE), (where_c, WHOLE)),
            mask, (side, side), Tolerance(0.0, 0.05), (4, 0, False), by_head=by_head,  # type: ignore[arg-type]
        )  # fmt: skip

    rows = call(held, True)
    assert rows.shape == (HEADS, TOKENS)
    for head in range(HEADS):
        alone = held & (np.arange(HEADS) == head)[:, None]
        np.testing.assert_array_equal(rows[head], call(alone, False))
    np.testing.assert_array_equal(np.fmax.reduce(rows, axis=0), call(held, False))
