"""Dtype names: safetensors names, torch names and the description's aliases, to ``torch.dtype``.

Names are matched case-insensitively, and a leading ``torch.`` is ignored, so ``BF16``,
``bf16``, ``bfloat16`` and ``torch.bfloat16`` all name ``torch.bfloat16``.
"""

from __future__ import annotations

import torch

# The safetensors header's dtype names, as safetensors writes them.
_SAFETENSORS_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}

# Torch's other names for the same dtypes, and the shorthands the description accepts.
_ALIASES: dict[str, torch.dtype] = {
    "half": torch.float16,
    "float": torch.float32,
    "double": torch.float64,
    "short": torch.int16,
    "int": torch.int32,
    "long": torch.int64,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The torch name of a dtype without the ``torch.`` prefix (``float8_e4m3fn``)."""
    return str(dtype).removeprefix("torch.")


def _build_names() -> dict[str, torch.dtype]:
    names: dict[str, torch.dtype] = {}
    for dtype, safetensors_name in _SAFETENSORS_NAMES.items():
        names[dtype_name(dtype)] = dtype
        names[safetensors_name.lower()] = dtype
    names.update(_ALIASES)
    return names


_NAMES = _build_names()


def parse_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` a safetensors name, torch name or alias names (any case).

    Raises:
        ValueError: The name is not a dtype kvaudit knows.

    """
    if not isinstance(name, str):
        raise ValueError(f"expected a dtype name, got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    dtype = _NAMES.get(key)
    if dtype is None:
        raise ValueError(
            f"unknown dtype {name!r}: expected a torch name (bfloat16, float16, float32, "
            "float8_e4m3fn, float8_e5m2, uint8, int8, ...), a safetensors name (BF16, F16, "
            "F32, F8_E4M3, U8, ...) or fp8_e4m3, fp8_e5m2, fp16, bf16, fp32"
        )
    return dtype


def safetensors_dtype_name(dtype: torch.dtype) -> str:
    """The safetensors header name of a dtype (``BF16``, ``F8_E4M3``, ``U8``).

    Raises:
        ValueError: safetensors has no name for the dtype.

    """
    try:
        return _SAFETENSORS_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype_name(dtype)} has no safetensors name") from None


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of a dtype."""
    return dtype.itemsize
