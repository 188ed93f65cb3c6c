"""The strong lane on the GPU: one Triton launch per layout adds each block's residues
modulo ``P = 2**64 - 59`` (docs/checksum.md, "The strong lane"), optionally fused with the
seed lane's sums in the same pass over the KV.

Per row ``i``, entry ``e`` (a part: its first slice ``s0``, column and piece offset ``k0``),
kernel block ``k``, head ``h``, token ``t`` (``u = k * T + t``, counted while
``u < valid_tokens[i]``) the cell row's stored pieces ``x_0 .. x_{n-1}`` add::

    (sum_p x_p * 2**(64 p)) * head_weight[e, h] * token_weight[(first_tokens[i] + u) mod 4096]

into ``out[i, column[e]]`` modulo P, with ``head_weight[e, h] = 2**(64 E(s0 + h, 0, k0))``
and ``token_weight[t'] = 2**(64 * 2**20 * t')`` (kvaudit/checksum/strong.py). The tiling is
the seed kernel's (kvaudit/checksum/kernels/triton_tiling.py), so both lanes read the same
tiles: with ``SEED`` the kernel also adds the seed lane's weighted sums into that lane's
output, one read of the KV for both.

Exactness without 128-bit integers: every product is of two 32-bit limbs (below 2**64,
kept as int64 bits); each element's product halves fold into two numbers below 2**40
(``2**64 = 59 mod P``), so a tile's two row sums stay below 2**52 (2**60 for 2-byte pieces).
A row's sums fold to a value below 2**64 congruent to the row's number (:func:`_fold`); two
limb multiplications apply the row's weight. Rows add into two int64 slots per output cell
(sums of the residues' low and high 32-bit halves, so that atomics stay exact in any
order), which :func:`_finish_kernel` folds into residues on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

from ...core.errors import KvauditError
from ...core.scheme import STRONG_PRIME, STRONG_TOKEN_PLACES, strong_weight
from ..strong import head_weights, token_weights
from . import LaunchPart
from .triton_kernel import TABLE_FIELDS, entry_table, load_tile, seed_terms
from .triton_tiling import MAX_GRID_YZ, kernel_arguments, launch_config, layout_is_aligned

if TYPE_CHECKING:
    from ..plans import GroupPlan

_SOURCE = "triton strong kernel"
_PIECE_DTYPES = (torch.int64, torch.int32, torch.int16)
_FINISH_BLOCK = 1024
"""Output cells one program of the finishing kernel folds."""


@triton.jit
def _fold(c0, c1, c2, c3):
    """``(lo, hi)``, 32-bit limbs of a value below 2**64 congruent modulo P to
    ``c0 + c1 * 2**32 + c2 * 2**64 + c3 * 2**96`` (each ``c`` below 2**56)."""
    mask = 0xFFFFFFFF
    # 2**64 = 59 and 2**96 = 59 * 2**32 (mod P).
    a = c0 + 59 * c2
    b = c1 + 59 * c3
    # b * 2**32 = (b mod 2**32) * 2**32 + 59 * (b >> 32).
    a = a + 59 * (b >> 32)
    carry_word = (b & mask) + (a >> 32)  # below 2**32 + 2**27
    low = (a & mask) + 59 * (carry_word >> 32)  # a carry past 2**64 is worth 59
    # When carry_word passed 2**32 its low part is below 2**27, so the last carry fits.
    return low & mask, (carry_word & mask) + (low >> 32)


@triton.jit
def _mul_mod(lo, hi, w):
    """32-bit limbs of a value congruent to ``(lo + hi * 2**32) * w`` modulo P, for limbs
    ``lo``, ``hi`` below 2**32 and ``w`` an int64's bits (its unsigned value)."""
    mask = 0xFFFFFFFF
    w_lo = w & mask
    w_hi = (w >> 32) & mask
    # Each product is below 2**64: int64 arithmetic wraps, the halves are read by masks.
    ll = lo * w_lo
    lh = lo * w_hi
    hl = hi * w_lo
    hh = hi * w_hi
    c0 = ll & mask
    c1 = ((ll >> 32) & mask) + (lh & mask) + (hl & mask)
    c2 = ((lh >> 32) & mask) + ((hl >> 32) & mask) + (hh & mask)
    c3 = (hh >> 32) & mask
    return _fold(c0, c1, c2, c3)


@triton.jit
def _strong_kernel(
    template_ptr,
    table_ptr,
    head_weights_ptr,
    piece_weights_ptr,
    token_weights_ptr,
    block_ids_ptr,
    first_tokens_ptr,
    valid_tokens_ptr,
    limbs_ptr,
    seed_ptr,
    num_columns,
    stride_block,
    stride_kernel_block,
    stride_head,
    stride_token,
    stride_piece,
    KERNEL_BLOCKS: tl.constexpr,
    HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    PIECES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PIECE_TILES: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    EVEN_PIECES: tl.constexpr,
    PIECE_BITS: tl.constexpr,
    VEC: tl.constexpr,
    FIELDS: tl.constexpr,
    TOKEN_PLACES: tl.constexpr,
    SEED: tl.constexpr,
):
    """One program: one row, one table entry, one chunk of that entry's tiles (the seed
    kernel's tiling); adds the strong lane's limb sums, and with ``SEED`` the seed lane."""
    row = tl.program_id(0)
    entry = tl.program_id(1)
    chunk = tl.program_id(2)
    valid = tl.load(valid_tokens_ptr + row)
    if valid <= 0:
        return
    first = tl.load(first_tokens_ptr + row)
    block = tl.load(block_ids_ptr + row)
    fields = table_ptr + entry.to(tl.int64) * FIELDS
    element_offset = tl.load(fields)
    first_slice = tl.load(fields + 1)
    column = tl.load(fields + 2)
    piece_offset = tl.load(fields + 3)
    cell_pieces = tl.load(fields + 4)
    if VEC > 1:
        # As in the seed kernel: offsets in 16-byte units so that loads are 16 bytes wide.
        base = element_offset // VEC + block * stride_block
    else:
        base = element_offset + block * stride_block
    mask = 0xFFFFFFFF
    acc_lo = tl.zeros([BLOCK_R], dtype=tl.int64)
    acc_hi = tl.zeros([BLOCK_R], dtype=tl.int64)
    seed_acc = tl.zeros([BLOCK_R], dtype=tl.int64)
    for step in range(TILES_PER_PROGRAM):
        tile = chunk * TILES_PER_PROGRAM + step
        x, p, h, u, _ = load_tile(
            template_ptr, base, tile, valid, stride_kernel_block, stride_head, stride_token,
            stride_piece, KERNEL_BLOCKS, HEADS, TOKENS, PIECES, BLOCK_R, BLOCK_P, PIECE_TILES,
            HEADS_FASTEST, EVEN_PIECES, PIECE_BITS, VEC,
        )  # fmt: skip
        if SEED:
            seed_acc += seed_terms(x, p, h, u, first, first_slice, cell_pieces, piece_offset)
        # The pieces' places 2**(64 p): padded to the piece tiles, so never masked.
        w = tl.load(piece_weights_ptr + p)[None, :]
        w_lo = w & mask
        w_hi = (w >> 32) & mask
        # Each element's four 32-bit product limbs fold at once into two (2**64 = 59 and
        # 2**96 = 59 * 2**32 mod P): ``a + b * 2**32`` with a below 2**40 and b below 2**38,
        # so that a tile needs two row sums, not four.
        if PIECE_BITS == 16:
            # x below 2**16: each product below 2**48, a tile's sum below 2**60.
            a = x * w_lo
            b = x * w_hi
        elif PIECE_BITS == 32:
            ll = x * w_lo
            lh = x * w_hi
            a = (ll & mask) + 59 * ((lh >> 32) & mask)
            b = ((ll >> 32) & mask) + (lh & mask)
        else:
            x_lo = x & mask
            x_hi = (x >> 32) & mask
            ll = x_lo * w_lo
            lh = x_lo * w_hi
            hl = x_hi * w_lo
            hh = x_hi * w_hi
            a = (ll & mask) + 59 * (((lh >> 32) & mask) + ((hl >> 32) & mask) + (hh & mask))
            b = ((ll >> 32) & mask) + (lh & mask) + (hl & mask) + 59 * ((hh >> 32) & mask)
        zero = tl.zeros([BLOCK_R], dtype=tl.int64)
        c0 = tl.sum(a, axis=1)
        c1 = tl.sum(b, axis=1)
        c2 = zero
        c3 = zero
        lo, hi = _fold(c0, c1, c2, c3)
        # The row's weight: its head's (with the part's slice and piece offset), then its
        # token place's. A dead row is zero and stays zero.
        head_weight = tl.load(head_weights_ptr + entry.to(tl.int64) * HEADS + h)
        if KERNEL_BLOCKS * TOKENS > 1:
            token_weight = tl.load(token_weights_ptr + (first + u) % TOKEN_PLACES)
            lo, hi = _mul_mod(lo, hi, head_weight)
            lo, hi = _mul_mod(lo, hi, token_weight)
        else:
            lo, hi = _mul_mod(lo, hi, head_weight)
        acc_lo += lo
        acc_hi += hi
    cell = limbs_ptr + (row.to(tl.int64) * num_columns + column) * 2
    if KERNEL_BLOCKS * TOKENS == 1:
        # One token a block (a state's rows): every row of the program has the same token
        # place, so its weight applies once, to the program's folded total, not per row.
        low_sum, high_sum = _fold(tl.sum(acc_lo, axis=0), tl.sum(acc_hi, axis=0), 0, 0)
        token_weight = tl.load(token_weights_ptr + first % TOKEN_PLACES)
        low_sum, high_sum = _mul_mod(low_sum, high_sum, token_weight)
        tl.atomic_add(cell, low_sum, sem="relaxed")
        tl.atomic_add(cell + 1, high_sum, sem="relaxed")
    else:
        tl.atomic_add(cell, tl.sum(acc_lo, axis=0), sem="relaxed")
        tl.atomic_add(cell + 1, tl.sum(acc_hi, axis=0), sem="relaxed")
    if SEED:
        total = tl.sum(seed_acc, axis=0)
        tl.atomic_add(seed_ptr + row.to(tl.int64) * num_columns + column, total, sem="relaxed")


@triton.jit
def _finish_kernel(limbs_ptr, out_ptr, cells, BLOCK: tl.constexpr):
    """Folds each output cell's two limb sums (each below 2**56) into its residue modulo P
    (int64 bits)."""
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = index < cells
    low_sum = tl.load(limbs_ptr + 2 * index, mask=inside, other=0)
    high_sum = tl.load(limbs_ptr + 2 * index + 1, mask=inside, other=0)
    zero = tl.zeros([BLOCK], dtype=tl.int64)
    lo, hi = _fold(low_sum, high_sum, zero, zero)
    # lo + hi * 2**32 is below 2**64; it is P or more only when hi is all ones and lo is at
    # least 2**32 - 59, and then it is P + (lo - (2**32 - 59)).
    over = (hi == 0xFFFFFFFF) & (lo >= 0xFFFFFFFF - 58)
    lo = tl.where(over, lo - (0xFFFFFFFF - 58), lo)
    hi = tl.where(over, 0, hi)
    tl.store(out_ptr + index, lo | (hi << 32), mask=inside)


_INTERPRETED = type(_strong_kernel).__name__ == "InterpretedFunction"


@cache
def _token_weights(device: str) -> torch.Tensor:
    """The token places' weights (int64 bits) on ``device``, once per device."""
    return torch.from_numpy(token_weights().copy()).to(device)


def _piece_weights(count: int, device: torch.device) -> torch.Tensor:
    """``2**(64 p)`` modulo P for ``p < count`` (int64 bits) on ``device``."""
    values = [1]
    for _ in range(count - 1):
        values.append(values[-1] * strong_weight(1) % STRONG_PRIME)
    return torch.from_numpy(np.array(values, dtype=np.uint64).view(np.int64)).to(device)


@dataclass
class StrongLaunch:
    """Parts that share one layout, with the tables the strong kernel reads: the seed
    kernel's entry table, each entry's head weights and the pieces' places."""

    template: torch.Tensor
    table: torch.Tensor
    head_weights: torch.Tensor
    piece_weights: torch.Tensor
    aligned: bool

    @classmethod
    def of(cls, parts: list[LaunchPart]) -> StrongLaunch:
        """The launch of ``parts`` (same dtype, shape, strides and device)."""
        template = parts[0].pieces
        if template.dim() != 5 or template.dtype not in _PIECE_DTYPES:
            raise KvauditError(
                "template must be a 5-d int64, int32 or int16 view "
                f"[blocks, kernel_blocks, heads, tokens, pieces], got {template.dtype} "
                f"of shape {tuple(template.shape)}",
                source=_SOURCE,
            )
        if template.device.type != "cuda" and not _INTERPRETED:
            raise KvauditError(
                f"tensors on {template.device} need CUDA "
                "(or TRITON_INTERPRET=1 set before importing triton)",
                source=_SOURCE,
            )
        if len(parts) > MAX_GRID_YZ:
            raise KvauditError(
                f"{len(parts)} table entries exceed one launch's {MAX_GRID_YZ}", source=_SOURCE
            )
        heads = template.shape[2]
        weights = np.stack(
            [head_weights(part.first_slice, heads, part.piece_offset) for part in parts]
        )
        aligned = template.stride(-1) == 1 and all(
            part.pieces.data_ptr() % 16 == 0 for part in parts
        )
        shape, strides = tuple(template.shape), tuple(template.stride())
        itemsize = template.element_size()
        aligned = aligned and layout_is_aligned(shape, strides, itemsize, template.data_ptr())
        config = launch_config(shape, strides, itemsize, aligned)
        return cls(
            template,
            entry_table(parts),
            torch.from_numpy(weights).to(template.device),
            _piece_weights(config.piece_tiles * config.block_pieces, template.device),
            aligned,
        )

    def accumulate(
        self,
        block_ids: torch.Tensor,
        first_tokens: torch.Tensor,
        valid_tokens: torch.Tensor,
        limbs: torch.Tensor,
        seed_out: torch.Tensor | None = None,
    ) -> None:
        """Add the parts' strong limb sums of the rows into ``limbs`` ``[rows, columns,
        2]``, and with ``seed_out`` ``[rows, columns]`` the seed lane's sums into it."""
        shape = tuple(self.template.shape)
        if any(s == 0 for s in shape[1:]) or not block_ids.shape[0]:
            return
        strides = tuple(self.template.stride())
        itemsize = self.template.element_size()
        config = launch_config(shape, strides, itemsize, self.aligned)
        stride_args, constants = kernel_arguments(shape, strides, itemsize, config)
        _strong_kernel[(block_ids.shape[0], self.table.shape[0], config.chunks)](
            self.template,
            self.table,
            self.head_weights,
            self.piece_weights,
            _token_weights(str(self.template.device)),
            block_ids,
            first_tokens,
            valid_tokens,
            limbs,
            limbs if seed_out is None else seed_out,
            limbs.shape[1],
            *stride_args,
            **constants,
            FIELDS=TABLE_FIELDS,
            TOKEN_PLACES=STRONG_TOKEN_PLACES,
            SEED=seed_out is not None,
            num_warps=config.num_warps,
            num_stages=1,
        )


def finish(limbs: torch.Tensor) -> torch.Tensor:
    """The residues (int64 bits) of limb sums ``[rows, columns, 2]``, on their device."""
    out = torch.empty(limbs.shape[:2], dtype=torch.int64, device=limbs.device)
    cells = out.numel()
    if cells:
        _finish_kernel[(triton.cdiv(cells, _FINISH_BLOCK),)](limbs, out, cells, BLOCK=_FINISH_BLOCK)
    return out


def strong_launches(parts: list[LaunchPart]) -> list[StrongLaunch]:
    """One launch per layout of ``parts`` (dtype, shape, strides, element alignment)."""
    layouts: dict[tuple, list[LaunchPart]] = {}
    for part in parts:
        pieces = part.pieces
        key = (
            str(pieces.dtype),
            str(pieces.device),
            tuple(pieces.shape),
            tuple(pieces.stride()),
            pieces.data_ptr() % pieces.element_size(),
        )
        layouts.setdefault(key, []).append(part)
    return [StrongLaunch.of(group) for group in layouts.values()]


def _on_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rows as a contiguous int64 tensor on ``device`` (from pinned memory on a GPU)."""
    tensor = values if isinstance(values, torch.Tensor) else torch.from_numpy(values)
    tensor = tensor.to(torch.int64).contiguous()
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def strong_sums(
    plan: GroupPlan,
    block_ids: np.ndarray | torch.Tensor,
    first_tokens: np.ndarray | torch.Tensor,
    valid_tokens: np.ndarray | torch.Tensor,
    seed_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The strong lane's ``[rows, replica keys]`` residues of the rows (int64 bits of the
    uint64 residues), computed on the plan's device and not waited for.

    On a GPU the result is a pinned host tensor whose copy is queued on the current
    stream: read it after that stream synchronizes (the checksummer's event does). On the
    CPU (the interpreter) it is ready.

    Args:
        plan: The group's plan (its parts; the launches are built once and kept on it).
        block_ids: The rows' block ids (int64, numpy or torch).
        first_tokens: Each row's first token position.
        valid_tokens: Each row's valid token count.
        seed_out: A ``[rows, replica keys]`` int64 tensor on the plan's device into which
            the same pass adds the seed lane's sums (the fused launch), or None.

    Returns:
        The residues modulo ``2**64 - 59``, one column per replica key.

    Raises:
        KvauditError: A part's view or device the kernel cannot read.

    """
    if plan.strong_launches is None:
        plan.strong_launches = strong_launches(plan.parts)
    launches: list[StrongLaunch] = plan.strong_launches
    rows, columns = len(block_ids), len(plan.replica_keys)
    device = launches[0].template.device if launches else torch.device("cpu")
    limbs = torch.zeros((rows, columns, 2), dtype=torch.int64, device=device)
    if rows and launches:
        ids = _on_device(block_ids, device)
        first = _on_device(first_tokens, device)
        valid = _on_device(valid_tokens, device)
        for launch in launches:
            launch.accumulate(ids, first, valid, limbs, seed_out)
    residues = finish(limbs)
    if device.type != "cuda":
        return residues
    host = torch.empty(residues.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(residues, non_blocking=True)
    return host


def warm_up(plan: GroupPlan, fused: bool = False) -> None:
    """Compiles the plan's strong kernels now (one row with no valid tokens adds nothing)."""
    zero = np.zeros(1, dtype=np.int64)
    seed_out = None
    if fused and plan.parts:
        device = plan.parts[0].pieces.device
        seed_out = torch.zeros((1, len(plan.replica_keys)), dtype=torch.int64, device=device)
    strong_sums(plan, zero, zero, zero, seed_out)
