"""The few array operations the views and plans need, on numpy arrays and torch tensors
alike, without importing torch: a dump's rows are numpy views of its file on the CPU path,
live caches are torch tensors.

Strides are in elements, as torch gives them. A numpy array here holds a cache's bytes as
unsigned-agnostic integers of the element's size (a dump's bfloat16 tensor is an int16
array); only torch tensors carry the cache's own dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import numpy as np
from numpy.lib.stride_tricks import as_strided as _np_as_strided

from .dtypes import DType

if TYPE_CHECKING:
    import torch

Array: TypeAlias = "torch.Tensor | np.ndarray"
"""A numpy array or a torch tensor."""

_NUMPY_INTEGERS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def is_numpy(x: object) -> bool:
    """Whether ``x`` is a numpy array (else a torch tensor)."""
    return isinstance(x, np.ndarray)


def integer_array(x: np.ndarray) -> np.ndarray:
    """The same bytes as integers of the element's size (a view)."""
    return x.view(_NUMPY_INTEGERS[x.dtype.itemsize])


def element_size(x: Array) -> int:
    return x.dtype.itemsize if is_numpy(x) else x.element_size()


def strides(x: Array) -> tuple[int, ...]:
    """Strides in elements."""
    if is_numpy(x):
        size = x.dtype.itemsize
        return tuple(stride // size for stride in x.strides)
    return tuple(x.stride())


def data_ptr(x: Array) -> int:
    """The address of the first element."""
    return int(x.__array_interface__["data"][0]) if is_numpy(x) else x.data_ptr()


def device_type(x: Array) -> str:
    """``cpu`` for numpy arrays, else the tensor's device type."""
    return "cpu" if is_numpy(x) else x.device.type


def matches_dtype(x: Array, dtype: DType) -> bool:
    """Whether ``x`` can hold elements of ``dtype``: a tensor of that dtype, or a numpy
    array of integers of its size."""
    if is_numpy(x):
        return x.dtype.itemsize == dtype.itemsize
    return x.dtype == dtype


def as_strided(x: Array, shape: tuple[int, ...], element_strides: tuple[int, ...]) -> Array:
    """A view of ``x``'s first element with this shape and element strides."""
    if is_numpy(x):
        size = x.dtype.itemsize
        return _np_as_strided(
            x, shape, tuple(stride * size for stride in element_strides), writeable=False
        )
    return x.as_strided(shape, element_strides, x.storage_offset())


def host_array(x: Array) -> np.ndarray:
    """``x`` as a C-contiguous numpy array on the host: a numpy array as it is where it is
    contiguous (else a copy), a tensor copied to the host."""
    if is_numpy(x):
        return np.ascontiguousarray(x)
    return x.contiguous().cpu().numpy()


def permute(x: Array, order: list[int] | tuple[int, ...]) -> Array:
    return x.transpose(order) if is_numpy(x) else x.permute(*order)


def unsqueeze(x: Array, axis: int) -> Array:
    return np.expand_dims(x, axis) if is_numpy(x) else x.unsqueeze(axis)


def movedim(x: Array, source: int, destination: int) -> Array:
    return np.moveaxis(x, source, destination) if is_numpy(x) else x.movedim(source, destination)


def unflatten(x: Array, axis: int, sizes: tuple[int, ...]) -> Array:
    """Axis ``axis`` split into ``sizes`` (a view, never a copy)."""
    if not is_numpy(x):
        return x.unflatten(axis, sizes)
    shape, element_strides = list(x.shape), list(strides(x))
    inner = element_strides[axis]
    split = []
    for size in reversed(sizes):
        split.insert(0, inner)
        inner *= size
    shape[axis : axis + 1] = sizes
    element_strides[axis : axis + 1] = split
    return as_strided(x, tuple(shape), tuple(element_strides))


def reinterpret(x: Array, size: int) -> Array:
    """The last axis's bytes read as integers of ``size`` bytes (a view).

    Raises:
        RuntimeError: The last axis is not contiguous or not a whole number of such
            integers (a numpy array may start at any byte; a tensor must be aligned).

    """
    if not is_numpy(x):
        import torch

        integers = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return x.view(torch.uint8).view(integers[size])
    itemsize = x.dtype.itemsize
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] != itemsize:
        raise RuntimeError("the last axis is not contiguous")
    row_bytes = x.shape[-1] * itemsize if x.ndim else itemsize
    if row_bytes % size:
        raise RuntimeError(f"not a whole number of {size}-byte integers")
    if any(stride % size for n, stride in zip(x.shape[:-1], x.strides[:-1]) if n > 1):
        raise RuntimeError(f"strides not aligned to {size} bytes")
    if x.ndim == 0:
        x = x.reshape(1)
    if x.shape[-1] == 1 and x.strides[-1] != itemsize:
        x = as_strided(x, x.shape, (*strides(x)[:-1], 1))
    return x.view(np.uint8).view(_NUMPY_INTEGERS[size])
