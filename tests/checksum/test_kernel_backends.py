"""The kernel backend registry: names, ``auto`` resolution, lazy imports, one protocol, and
backends registered from outside the package."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvaudit import Checksummer
from kvaudit.checksum.kernels import (
    Launch,
    LaunchPart,
    backend_names,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from kvaudit.description import parse_description
from kvaudit.views.inputs import RequestBlocks

BUILT_IN = ["numpy", "torch", "triton"]


def test_the_built_in_backends_are_registered() -> None:
    assert list(backend_names()) == BUILT_IN


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
        ValueError, match=r"^unknown backend 'cupy', expected one of auto, numpy, torch, triton$"
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


@pytest.mark.parametrize("name", BUILT_IN)
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


def _description() -> dict:
    """One bf16 layer in NHTC, 4 blocks of 2 tokens, 2 heads of 8 elements."""
    return {
        "kvaudit": 1,
        "num_blocks": 4,
        "groups": [
            {
                "spec": {
                    "type": "full_attention",
                    "block_size": 2,
                    "num_kv_heads": 2,
                    "head_size": 8,
                    "dtype": "bfloat16",
                    "layout": "NHTC",
                },
                "layers": ["model.layers.0.self_attn.attn"],
            }
        ],
    }


class _Shifted:
    """A launch that adds the numpy backend's sums plus ``shift`` into every row: what a
    registered backend returns is what the checksummer reports."""

    def __init__(self, parts: list[LaunchPart], shift: int, launches: list[int]) -> None:
        self.inner = resolve_backend("numpy", "cpu").launch(parts)
        self.shift = shift
        launches.append(len(parts))

    def accumulate(
        self, block_ids: np.ndarray, first_tokens: np.ndarray, valid: np.ndarray, out: np.ndarray
    ) -> None:
        self.inner.accumulate(block_ids, first_tokens, valid, out)
        out += self.shift

    def warm_up(self, num_columns: int) -> None:
        self.inner.warm_up(num_columns)


@pytest.fixture
def shifted() -> Iterator[list[int]]:
    """A backend ``shifted`` registered for one test; yields the launches it made."""
    launches: list[int] = []
    register_backend("shifted", lambda parts: _Shifted(parts, 1000, launches), uses_torch=False)
    yield launches
    unregister_backend("shifted")


def _seed_lane(backend: str) -> list[int]:
    cache = torch.arange(4 * 2 * 2 * 16, dtype=torch.int16).view(torch.bfloat16)
    summer = Checksummer(
        parse_description(_description(), "test"),
        {"model.layers.0.self_attn.attn": cache.reshape(4, 2, 2, 16)},
        backend=backend,
        strong_lane=False,
    )
    record = summer.checksum({"r": RequestBlocks(4, {0: (0, [3, 1])})})
    return [int(value) for value in record.requests["r"].groups[0].values[:, 0]]


def test_a_registered_backend_serves_the_checksummer(shifted: list[int]) -> None:
    assert "shifted" in backend_names()
    assert shifted == []
    assert isinstance(resolve_backend("shifted", "cpu").launch([]), Launch)
    reference = _seed_lane("numpy")
    assert reference[0] != reference[1]
    assert _seed_lane("shifted") == [value + 1000 for value in reference]
    assert shifted[-1] == 1


def test_a_registered_backend_is_listed_in_the_unknown_name_error(shifted: list[int]) -> None:
    with pytest.raises(ValueError, match=r"expected one of auto, numpy, torch, triton, shifted$"):
        resolve_backend("cupy", "cpu")


@pytest.mark.parametrize("name", ["", "auto", "numpy"])
def test_a_backend_name_must_be_new(name: str) -> None:
    with pytest.raises(ValueError, match=repr(name)):
        register_backend(name, resolve_backend("numpy", "cpu").launch)


def test_the_fallback_backend_stays_registered() -> None:
    with pytest.raises(ValueError, match="'torch' cannot be unregistered"):
        unregister_backend("torch")
    assert "torch" in backend_names()
