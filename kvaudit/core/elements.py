"""Element values from their bytes, in numpy only: bf16, fp16, fp32, fp64, fp8 e4m3fn and
e5m2 (through exact 256-entry tables) and integers, for comparing caches by value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .dtypes import DType, dtype_name, dtype_size

if TYPE_CHECKING:
    import torch


def _fp8_table(exponent_bits: int, mantissa_bits: int, *, has_inf: bool) -> np.ndarray:
    """The float32 value of each of the 256 codes of an fp8 format with IEEE-like
    subnormals; ``has_inf``: the all-ones exponent holds infinities and NaNs (e5m2), else
    only the all-ones code of each sign is NaN (e4m3fn)."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = codes & ((1 << mantissa_bits) - 1)
    bias = (1 << (exponent_bits - 1)) - 1
    scale = float(1 << mantissa_bits)
    normal = (1.0 + mantissa / scale) * np.exp2(exponent.astype(np.float64) - bias)
    subnormal = (mantissa / scale) * 2.0 ** (1 - bias)
    values = sign * np.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << exponent_bits) - 1
    if has_inf:
        values[top & (mantissa == 0)] = sign[top & (mantissa == 0)] * np.inf
        values[top & (mantissa != 0)] = np.nan
    else:
        values[top & (mantissa == (1 << mantissa_bits) - 1)] = np.nan
    return values.astype(np.float32)


FP8_E4M3FN = _fp8_table(4, 3, has_inf=False)
"""float32 value of every fp8 e4m3fn code (no infinities; 0x7f and 0xff are NaN)."""
FP8_E5M2 = _fp8_table(5, 2, has_inf=True)
"""float32 value of every fp8 e5m2 code (IEEE-like: infinities and NaNs)."""

_TABLES = {"float8_e4m3fn": FP8_E4M3FN, "float8_e5m2": FP8_E5M2}
_WIDE = ("float32", "float64", "int32", "int64", "uint32", "uint64")
_INTEGERS = {
    "uint8": np.uint8,
    "int8": np.int8,
    "uint16": np.uint16,
    "int16": np.int16,
    "uint32": np.uint32,
    "int32": np.int32,
    "uint64": np.uint64,
    "int64": np.int64,
    "bool": np.uint8,
}


def work_dtype(*dtypes: DType | torch.dtype) -> type[np.floating]:
    """The float type values are compared in: float32 holds every value of 16-bit and
    8-bit dtypes exactly; wider dtypes need float64."""
    return np.float64 if any(dtype_name(d) in _WIDE for d in dtypes) else np.float32


def decode(raw: np.ndarray, dtype: DType | torch.dtype, out: np.ndarray) -> None:
    """Write the values of elements given as their little-endian bytes (uint8, last axis
    a whole number of elements) into ``out`` (a float array, any strides, whose last axis
    is the elements).

    Raises:
        ValueError: A dtype that has no values to compare (complex and others).

    """
    name = dtype_name(dtype)
    if name in _TABLES:
        out[...] = _TABLES[name][raw]
        return
    if name == "bfloat16" and out.dtype == np.float32:
        # A bf16 is the high half of the float32 of the same value: widened, then shifted
        # in place (faster than one shift that casts on the way).
        bits = out.view(np.uint32)
        np.copyto(bits, raw.view(np.uint16))
        np.left_shift(bits, 16, out=bits)
        return
    if name == "bfloat16":
        high = raw.view(np.uint16).astype(np.uint32) << 16
        out[...] = high.view(np.float32)
        return
    if name in ("float16", "float32", "float64"):
        out[...] = raw.view(np.dtype(name).newbyteorder("<"))
        return
    if name in _INTEGERS:
        out[...] = raw.view(_INTEGERS[name])
        return
    raise ValueError(f"cannot compare {name} elements by value")


def copy_bits(raw: np.ndarray, dtype: DType | torch.dtype, out: np.ndarray) -> None:
    """Copy elements given as their little-endian bytes (uint8, last axis a whole number
    of elements of ``dtype``) into ``out``, an unsigned array of their size: the bits
    unchanged, for ``kvaudit._native._element_errors`` to decode."""
    if out.dtype.itemsize != dtype_size(dtype):
        raise ValueError(f"{dtype_name(dtype)} elements do not fit {out.dtype} bits")
    np.copyto(out, raw.view(out.dtype.newbyteorder("<")))
