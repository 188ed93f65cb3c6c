"""The kernel backend registry: names, ``auto`` resolution, lazy imports, one protocol."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import numpy as np
import pytest
import torch

from kvaudit.checksum.kernels import (
    BackendChoice,
    BackendName,
    Launch,
    LaunchPart,
    backend_names,
    resolve_backend,
)


def test_registered_names_are_the_literal_types() -> None:
    assert list(backend_names()) == list(get_args(BackendName))
    assert set(get_args(BackendChoice)) == {"auto", *get_args(BackendName)}


@pytest.mark.parametrize(
    ("choice", "device", "expected"),
    [
        ("auto", "cpu", "numpy"),
        ("auto", "cuda", "triton"),
        ("auto", "mps", "torch"),
        ("torch", "cuda", "torch"),
        ("triton", "cpu", "triton"),
    ],
)
def test_resolve_backend(choice: str, device: str, expected: str) -> None:
    assert resolve_backend(choice, device).name == expected


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(
        ValueError, match="unknown backend 'cupy', expected one of auto, numpy, torch"
    ):
        resolve_backend("cupy", "cpu")


def test_plans_import_no_backend_until_used() -> None:
    """A backend's module (and Triton) is imported only when a launch of it is made."""
    code = (
        "import sys, kvaudit.checksum.plans\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "assert 'kvaudit.checksum.kernels.triton_kernel' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", list(get_args(BackendName)))
def test_every_backend_makes_a_launch(name: str) -> None:
    pieces = torch.zeros((3, 1, 2, 4, 2), dtype=torch.int64)
    launch = resolve_backend(name, "cpu").launch([LaunchPart(pieces, 0, 0, 0, 2)])
    assert isinstance(launch, Launch)


def test_torch_launch_adds_the_contract_value() -> None:
    """One nonzero piece x = 3 at head 1, token 1, piece 0 of block 1: j = (4 + 1) * 4 + 2,
    factor 2 * (2 + 1) + 1 = 7, so 7 * 3 * (2 * 22 + 1) = 945 lands in column 1."""
    pieces = torch.zeros((2, 1, 2, 2, 2), dtype=torch.int64)
    pieces[1, 0, 1, 1, 0] = 3
    launch = resolve_backend("torch", "cpu").launch([LaunchPart(pieces, 2, 1, 2, 4)])
    out = torch.full((3, 2), 5, dtype=torch.int64)
    rows = torch.tensor([1, 1, 0])
    launch.accumulate(rows, torch.tensor([4, 4, 4]), torch.tensor([2, 1, 2]), out)
    assert out.tolist() == [[5, 950], [5, 5], [5, 5]]


def test_numpy_launch_adds_the_contract_value() -> None:
    """The same single piece as above through the numpy backend, given numpy arrays."""
    pieces = np.zeros((2, 1, 2, 2, 2), dtype=np.int64)
    pieces[1, 0, 1, 1, 0] = 3
    launch = resolve_backend("numpy", "cpu").launch([LaunchPart(pieces, 2, 1, 2, 4)])
    out = np.full((3, 2), 5, dtype=np.int64)
    rows = np.array([1, 1, 0])
    launch.accumulate(rows, np.array([4, 4, 4]), np.array([2, 1, 2]), out)
    assert out.tolist() == [[5, 950], [5, 5], [5, 5]]


def test_numpy_backend_imports_no_torch() -> None:
    """Checksumming numpy views on the CPU path never imports torch."""
    code = (
        "import sys, numpy as np\n"
        "from kvaudit.checksum.kernels import LaunchPart, resolve_backend\n"
        "pieces = np.ones((4, 2, 3, 4, 2), dtype=np.int64)\n"
        "launch = resolve_backend('auto', 'cpu').launch([LaunchPart(pieces, 0, 0, 0, 2)])\n"
        "out = np.zeros((2, 1), dtype=np.int64)\n"
        "launch.accumulate(np.array([3, 1]), np.array([0, 16]), np.array([8, 5]), out)\n"
        "assert out.any()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
