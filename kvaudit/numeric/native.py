"""One layer's batch compared by the C extension ``kvaudit._native._element_errors``: both sides'
raw element bits decoded, scaled and reduced in one pass (docs/numeric.md), then added to
the layer's ``LayerErrors``. The figures are those of ``kvaudit.numeric.value_errors``'s numpy
path (the sums of squares in float64 throughout), which runs instead where the extension
is not built, a dtype is not one it reads, or ``KVAUDIT_NATIVE=0``."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from ..core.dtypes import DType, dtype_name
from .model import Tolerance
from .value_errors import LayerErrors

SCALES = tuple[float | None, float | None]
"""A side's K and V scales (None: none)."""
PARTS = tuple[tuple[int, int], ...]
"""The parts a side's rows are read in: each one's first element and element count."""


def native_module() -> ModuleType | None:
    """The C extension, or None where it is not built or ``KVAUDIT_NATIVE=0``."""
    from ..core import native  # only when comparing by value: other commands load no extension

    return native.extension("kvaudit._native._element_errors")


def reads(module: ModuleType, *dtypes: DType) -> bool:
    """Whether the extension reads elements of every one of these dtypes."""
    return all(dtype_name(dtype) in module.KINDS for dtype in dtypes)


def raw_dtype(dtype: DType) -> type[np.unsignedinteger]:
    """The unsigned integer type a dtype's elements are carried in, bits unchanged."""
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]


def add_raw_batch(
    module: ModuleType,
    errors: LayerErrors,
    lo: int,
    bits: tuple[np.ndarray, np.ndarray],
    held: np.ndarray,
    sides: tuple[tuple[DType, int, SCALES], tuple[DType, int, SCALES]],
    tolerance: Tolerance,
    token_ratio: np.ndarray | None = None,
) -> np.ndarray:
    """Add one layer's batch (the producer's and consumer's element bits ``[heads, tokens,
    elements]`` from request position ``lo``, compared where ``held``; each side's
    ``(dtype, head_size, (k_scale, v_scale))``) to its errors, as ``element_errors.add_batch``
    does; returns per token the largest over heads of ``max |c - p| / max |p|`` (NaN where
    no head compared it) and fills ``token_ratio`` (where given, float64 ``[tokens]``)
    with the largest tolerance ratio, as ``add_batch`` does."""
    heads, tokens, elements = bits[0].shape
    token_row = np.empty(tokens)
    ratios = np.empty(tokens) if token_ratio is None else token_ratio
    module.compare(
        bits[0],
        bits[1],
        held.view(np.uint8),
        (heads, tokens, elements),
        *(_side(*side) for side in sides),
        tolerance.pair(),
        lo,
        *errors.outputs(),
        token_row,
        errors.max_ratio,
        ratios,
    )
    return token_row


def _side(dtype: DType, head_size: int, scales: SCALES) -> tuple[str, int, float, float]:
    """A side as the extension takes it: its dtype's name, head size and both scales (1.0
    for none: multiplying by 1 changes no value)."""
    k_scale, v_scale = (1.0 if scale is None else float(scale) for scale in scales)
    return dtype_name(dtype), head_size, k_scale, v_scale


def add_mapped_batch(
    module: ModuleType,
    errors: LayerErrors,
    lo: int,
    maps: list[object],
    located: tuple[tuple[np.ndarray, PARTS], tuple[np.ndarray, PARTS]],
    held: np.ndarray,
    sides: tuple[tuple[DType, int, SCALES], tuple[DType, int, SCALES]],
    tolerance: Tolerance,
    order: tuple[int, int, bool] = (0, 0, False),
    by_head: bool = False,
    token_ratio: np.ndarray | None = None,
) -> np.ndarray:
    """``add_raw_batch`` with both sides' rows read where they lie in the dumps' mappings
    ``maps`` (their buffers): each side's ``(where, parts)`` as ``kvaudit.numeric.mapped_rows``
    locates them, ``held`` ``[heads, tokens]`` the rows both hold. ``order = (chunk,
    release, heads_inner)``: the rows go ``chunk`` tokens at a time (0: all at once),
    token by token within a chunk where ``heads_inner`` (else head by head); the 2 MiB
    regions of the maps holding rows read are released (``MADV_DONTNEED``) once they
    reach ``release`` bytes, checked after each chunk, and at the end (0: never; ``maps``
    must be file mappings where not 0). ``by_head``: the token row is one per head,
    ``[heads, tokens]`` (for heads of several requests compared at once). ``token_ratio``
    (where given, float64 of the token row's shape) is filled with the largest tolerance
    ratio, as ``add_batch`` does.

    Raises:
        ValueError: A held row's part lies outside its mapping (a wrong layout).

    """
    heads, tokens = held.shape
    elements = sum(width for _, width in located[0][1])
    token_row = np.empty((heads, tokens) if by_head else tokens)  # 1 head: the same bytes
    ratios = np.empty(token_row.shape) if token_ratio is None else token_ratio
    module.compare_mapped(
        maps,
        located[0][0],
        located[1][0],
        held.view(np.uint8),
        (heads, tokens, elements),
        *((*_side(*side), parts) for side, (_, parts) in zip(sides, located)),
        tolerance.pair(),
        lo,
        order,
        *errors.outputs(),
        token_row,
        errors.max_ratio,
        ratios,
    )
    return token_row
