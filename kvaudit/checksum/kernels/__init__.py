"""The kernel backends that compute checksums from piece views, behind one launch protocol.

A backend is registered once, by name, with a factory of its launch; plans ask
:func:`resolve_backend` for the backend (``auto`` or the caller's choice) and never name
one themselves. The built-in backends' modules are imported only when they are used, so a
backend's dependencies (torch, Triton) are not needed by the others: the numpy backend never
imports torch.

Adding a backend: a class (or any callable) that takes ``list[LaunchPart]`` and returns a
:class:`Launch`, and one :func:`register_backend` call, here for a built-in one or in the
caller's own code for another.

Example:
    A backend that counts its launches and leaves the sums to the numpy one:

    >>> from kvaudit.checksum.kernels import (
    ...     register_backend, resolve_backend, unregister_backend)
    >>> made = []
    >>> def counting(parts):
    ...     made.append(len(parts))
    ...     return resolve_backend("numpy", "cpu").launch(parts)
    >>> backend = register_backend("counting", counting, uses_torch=False)
    >>> resolve_backend("counting", "cpu").name
    'counting'
    >>> unregister_backend("counting")
    >>> resolve_backend("counting", "cpu")
    Traceback (most recent call last):
    ...
    ValueError: unknown backend 'counting', expected one of auto, numpy, torch, triton
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ...core.arrays import Array

BackendName = str
"""A registered backend's name (``backend_names()`` lists them)."""

BackendChoice = str
"""What a caller may ask for: a registered backend, or ``auto`` (the one that suits the
device)."""


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
    """A registered backend: its launch factory, the device types for which ``auto`` picks
    it, and whether its launches take torch tensors (numpy arrays otherwise)."""

    name: BackendName
    factory: LaunchFactory
    auto_devices: tuple[str, ...] = ()
    uses_torch: bool = True

    def launch(self, parts: list[LaunchPart]) -> Launch:
        """A launch of ``parts`` on this backend."""
        return self.factory(parts)


def _lazy(module: str, launch_class: str) -> LaunchFactory:
    """A factory of a built-in launch class that imports its module on first use (so that
    the numpy backend never imports torch, nor plans Triton)."""

    def factory(parts: list[LaunchPart]) -> Launch:
        launch: LaunchFactory = getattr(importlib.import_module(module), launch_class)
        return launch(parts)

    return factory


_REGISTRY: dict[str, Backend] = {}
_FALLBACK: BackendName = "torch"
"""What ``auto`` picks on a device type no backend claims."""


def register_backend(
    name: str,
    factory: LaunchFactory,
    *,
    auto_devices: Sequence[str] = (),
    uses_torch: bool = True,
) -> Backend:
    """Register a kernel backend under ``name``, for ``Checksummer(backend=name)`` and the
    other places that take a backend.

    Args:
        name: The backend's name; not ``auto``, nor one already registered.
        factory: Makes a :class:`Launch` of parts that share one layout (a launch class).
        auto_devices: The device types (``cuda``, ``cpu``...) for which ``auto`` picks this
            backend, unless a backend registered earlier claims them.
        uses_torch: Whether the launches take torch tensors (numpy arrays otherwise: the
            CPU views of dumps are then read without torch).

    Returns:
        The registered backend.

    Raises:
        ValueError: An empty name, ``auto``, or a name already registered.

    """
    if not name or name == "auto":
        raise ValueError(f"a backend cannot be named {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"backend {name!r} is already registered")
    backend = Backend(name, factory, tuple(auto_devices), uses_torch)
    _REGISTRY[name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend from the registry (one that a test or plugin registered).

    Args:
        name: A registered backend's name.

    Raises:
        ValueError: No backend of that name is registered, or it is the fallback of
            ``auto`` (``torch``).

    """
    if name == _FALLBACK or name not in _REGISTRY:
        raise ValueError(f"backend {name!r} cannot be unregistered")
    del _REGISTRY[name]


register_backend(
    "numpy", _lazy(f"{__name__}.numpy_cpu", "NumpyLaunch"), auto_devices=("cpu",), uses_torch=False
)
register_backend("torch", _lazy(f"{__name__}.torch_cpu", "TorchLaunch"))
register_backend(
    "triton", _lazy(f"{__name__}.triton_kernel", "TritonLaunch"), auto_devices=("cuda",)
)


def backend_names() -> Sequence[str]:
    """The registered backends' names, in registration order."""
    return list(_REGISTRY)


def resolve_backend(choice: str, device_type: str) -> Backend:
    """The backend ``choice`` names, or for ``auto`` the one that claims ``device_type``
    (the Triton kernel on CUDA, numpy on the CPU, the torch path elsewhere).

    Args:
        choice: ``auto`` or a registered backend's name.
        device_type: The device type of the views (``cpu``, ``cuda``...).

    Returns:
        The backend.

    Raises:
        ValueError: ``choice`` is neither ``auto`` nor a registered backend (one line that
            lists the registered ones).

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
