"""The kernel backends that compute checksums from piece views, behind one launch protocol.

A backend is registered once, by name, with the module and class of its launch; plans ask
:func:`backend_launch` for a launch of parts that share one layout and never name a backend
themselves. The backend's module is imported only when it is used, so a backend's
dependencies (torch, Triton) are not needed by the others: the numpy backend never imports
torch.

Adding a backend: a module in this package with a class that takes ``list[LaunchPart]``
and implements :class:`Launch`, plus one :func:`register` call below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, get_args, runtime_checkable

if TYPE_CHECKING:
    from ...core.arrays import Array

BackendName = Literal["numpy", "torch", "triton"]
"""A registered backend."""

BackendChoice = Literal["auto", BackendName]
"""What a caller may ask for: a backend, or ``auto`` (the one that suits the device)."""


@dataclass(frozen=True)
class LaunchPart:
    """One piece view ``[blocks, kernel_blocks, heads, tokens, pieces]`` to add into output
    ``column``, numbered from ``first_slice`` (its first head's slice), ``piece_offset``
    (its first piece within the cell) and ``cell_pieces`` (the cell's pieces)."""

    pieces: Array
    first_slice: int
    column: int
    piece_offset: int
    cell_pieces: int


@runtime_checkable
class Launch(Protocol):
    """Parts that share one layout (dtype, shape, strides, device), added into their columns
    together: what every backend's launch class provides."""

    def accumulate(
        self,
        block_ids: Array,
        first_tokens: Array,
        valid_tokens: Array,
        out: Array,
    ) -> None:
        """Add every part's weighted sums of the rows into its column of ``out``
        ``[rows, columns]`` int64 (mod 2**64), on the parts' device: numpy arrays for a
        backend whose ``uses_torch`` is False, torch tensors otherwise."""

    def warm_up(self, num_columns: int) -> None:
        """Prepare now what the first ``accumulate`` would (compile, allocate)."""


LaunchFactory = Callable[[list[LaunchPart]], Launch]


@dataclass(frozen=True)
class Backend:
    """A registered backend: where its launch class lives and the device types for which
    ``auto`` picks it."""

    name: BackendName
    module: str
    launch_class: str
    auto_devices: tuple[str, ...]
    uses_torch: bool = True

    def launch(self, parts: list[LaunchPart]) -> Launch:
        """A launch of ``parts`` on this backend (imports its module on first use)."""
        factory: LaunchFactory = getattr(importlib.import_module(self.module), self.launch_class)
        return factory(parts)


_REGISTRY: dict[str, Backend] = {}
_FALLBACK: BackendName = "torch"
"""What ``auto`` picks on a device type no backend claims."""


def register(backend: Backend) -> None:
    """Adds a backend to the registry (its name must be one of ``BackendName``)."""
    if backend.name not in get_args(BackendName):
        raise ValueError(f"backend {backend.name!r} is not a BackendName")
    _REGISTRY[backend.name] = backend


register(Backend("numpy", f"{__name__}.numpy_cpu", "NumpyLaunch", ("cpu",), uses_torch=False))
register(Backend("torch", f"{__name__}.torch_cpu", "TorchLaunch", auto_devices=()))
register(Backend("triton", f"{__name__}.triton_kernel", "TritonLaunch", auto_devices=("cuda",)))


def backend_names() -> Sequence[str]:
    """The registered backends' names, in registration order."""
    return list(_REGISTRY)


def resolve_backend(choice: str, device_type: str) -> Backend:
    """The backend ``choice`` names, or for ``auto`` the one that claims ``device_type``
    (the Triton kernel on CUDA, numpy on the CPU, the torch path elsewhere).

    Raises:
        ValueError: ``choice`` is neither ``auto`` nor a registered backend.

    """
    if choice == "auto":
        for backend in _REGISTRY.values():
            if device_type in backend.auto_devices:
                return backend
        return _REGISTRY[_FALLBACK]
    if choice not in _REGISTRY:
        expected = ", ".join(["auto", *_REGISTRY])
        raise ValueError(f"unknown backend {choice!r}, expected one of {expected}")
    return _REGISTRY[choice]
