"""The numpy backend's launch run on a kernel case (tests/helpers/kernel_cases.py) by either of
its paths, the C loop or numpy, and the in-order variant of a case; shared by
tests/checksum/test_numpy_kernel.py and tests/checksum/test_native_kernel.py."""

from __future__ import annotations

import os
from dataclasses import replace
from unittest import mock

import numpy as np
import torch

from helpers.kernel_cases import MASK64, Case
from kvaudit.checksum.kernels import LaunchPart, numpy_cpu
from kvaudit.core import native


def numpy_launch(
    case: Case, chunk_rows: int | None = None, *, native_loop: bool = False
) -> list[list[int]]:
    """The numpy launch's result for a case, as unsigned 64-bit integers, by the C loop
    (``native_loop``; it must have built) or by numpy; ``chunk_rows`` replaces the parts'
    own chunk size."""
    launch = cpu_launch(case, native_loop=native_loop)
    for part in launch.parts:
        part.chunk_rows = chunk_rows or part.chunk_rows
    out = np.array([[v & MASK64 for v in row] for row in case.out_start], dtype=np.uint64)
    out = out.view(np.int64)
    launch.accumulate(
        np.array(case.block_ids, dtype=np.int64),
        np.array(case.first_tokens, dtype=np.int64),
        np.array(case.valid_tokens, dtype=np.int64),
        out,
    )
    return [[value & MASK64 for value in row] for row in out.tolist()]


def cpu_launch(case: Case, *, native_loop: bool) -> numpy_cpu.NumpyLaunch:
    """The numpy backend's launch of a case's entries, made with the C loop or without
    it (``KVAUDIT_NATIVE=0``), as a run under that setting makes it."""
    parts = [
        LaunchPart(
            entry.view.numpy(),
            entry.first_slice,
            entry.column,
            entry.piece_offset,
            entry.cell_pieces,
        )
        for entry in case.entries
    ]
    setting = {native.ENVIRONMENT: "1" if native_loop else "0"}
    with mock.patch.dict(os.environ, setting):
        launch = numpy_cpu.NumpyLaunch(parts)
    for part in launch.parts:
        assert (part.native is not None) == native_loop, "the C loop did not load"
    return launch


def in_order(case: Case, seed: int) -> Case:
    """The case over every block in order, except one left out (so the rows around it are
    gathered), with random valid tokens (full, cut short and zero) and first tokens."""
    blocks, *_, tokens, _ = case.template.shape
    rows_per_block = case.template.shape[1] * tokens
    g = torch.Generator().manual_seed(seed)
    block_ids = [block for block in range(blocks) if block != blocks // 2 or blocks < 3]
    count = len(block_ids)
    valid = torch.randint(0, rows_per_block + 1, (count,), generator=g).tolist()
    valid[: count // 2] = [rows_per_block] * (count // 2)  # a run of full rows
    valid[-1] = max(1, rows_per_block - 1)
    first = torch.randint(0, 1 << 30, (count,), generator=g).tolist()
    columns = len(case.out_start[0])
    start = torch.randint(-(2**62), 2**62, (count, columns), generator=g).tolist()
    return replace(
        case,
        block_ids=block_ids,
        first_tokens=first,
        valid_tokens=valid,
        out_start=start,
        expected=None,
    )
