"""Dtype names: safetensors names, torch names and the description's aliases, to ``DType``.

Names are matched case-insensitively, and a leading ``torch.`` is ignored, so ``BF16``,
``bf16``, ``bfloat16`` and ``torch.bfloat16`` all name bfloat16. A ``DType`` needs no
torch: commands that only read descriptions and dumps never import it. It compares equal
to the ``torch.dtype`` of the same name, and ``torch_dtype`` gives that dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class DType:
    """An element type: its torch name (without ``torch.``), size and safetensors name."""

    name: str
    itemsize: int
    safetensors_name: str
    is_floating_point: bool

    def __str__(self) -> str:
        # torch's spelling, which group fingerprints hash (docs/checksum.md).
        return f"torch.{self.name}"

    def __repr__(self) -> str:
        return str(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return other.name == self.name
        if type(other).__module__ == "torch" and type(other).__name__ == "dtype":
            return str(other) == str(self)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)


def _dtype(name: str, itemsize: int, safetensors_name: str, floating: bool) -> DType:
    return DType(name, itemsize, safetensors_name, floating)


BOOL = _dtype("bool", 1, "BOOL", False)
UINT8 = _dtype("uint8", 1, "U8", False)
INT8 = _dtype("int8", 1, "I8", False)
UINT16 = _dtype("uint16", 2, "U16", False)
INT16 = _dtype("int16", 2, "I16", False)
UINT32 = _dtype("uint32", 4, "U32", False)
INT32 = _dtype("int32", 4, "I32", False)
UINT64 = _dtype("uint64", 8, "U64", False)
INT64 = _dtype("int64", 8, "I64", False)
FLOAT8_E4M3FN = _dtype("float8_e4m3fn", 1, "F8_E4M3", True)
FLOAT8_E5M2 = _dtype("float8_e5m2", 1, "F8_E5M2", True)
FLOAT16 = _dtype("float16", 2, "F16", True)
BFLOAT16 = _dtype("bfloat16", 2, "BF16", True)
FLOAT32 = _dtype("float32", 4, "F32", True)
FLOAT64 = _dtype("float64", 8, "F64", True)

_ALL = (
    BOOL,
    UINT8,
    INT8,
    UINT16,
    INT16,
    UINT32,
    INT32,
    UINT64,
    INT64,
    FLOAT8_E4M3FN,
    FLOAT8_E5M2,
    FLOAT16,
    BFLOAT16,
    FLOAT32,
    FLOAT64,
)

# Torch's other names for the same dtypes, and the shorthands the description accepts.
_ALIASES: dict[str, DType] = {
    "half": FLOAT16,
    "float": FLOAT32,
    "double": FLOAT64,
    "short": INT16,
    "int": INT32,
    "long": INT64,
    "fp8_e4m3": FLOAT8_E4M3FN,
    "fp8_e4m3fn": FLOAT8_E4M3FN,
    "fp8_e5m2": FLOAT8_E5M2,
    "fp16": FLOAT16,
    "bf16": BFLOAT16,
    "fp32": FLOAT32,
    "fp64": FLOAT64,
}


def dtype_name(dtype: DType | torch.dtype) -> str:
    """The torch name of a dtype without the ``torch.`` prefix (``float8_e4m3fn``)."""
    return str(dtype).removeprefix("torch.")


def _build_names() -> dict[str, DType]:
    names: dict[str, DType] = {}
    for dtype in _ALL:
        names[dtype.name] = dtype
        names[dtype.safetensors_name.lower()] = dtype
    names.update(_ALIASES)
    return names


_NAMES = _build_names()


def parse_dtype(name: str) -> DType:
    """The ``DType`` a safetensors name, torch name or alias names (any case).

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


def as_dtype(dtype: DType | torch.dtype) -> DType:
    """The ``DType`` of a ``DType`` or ``torch.dtype``.

    Raises:
        ValueError: kvaudit does not know the dtype.

    """
    return dtype if isinstance(dtype, DType) else parse_dtype(str(dtype))


def safetensors_dtype_name(dtype: DType | torch.dtype) -> str:
    """The safetensors header name of a dtype (``BF16``, ``F8_E4M3``, ``U8``).

    Raises:
        ValueError: safetensors has no name for the dtype.

    """
    try:
        return as_dtype(dtype).safetensors_name
    except ValueError:
        raise ValueError(f"dtype {dtype_name(dtype)} has no safetensors name") from None


def dtype_size(dtype: DType | torch.dtype) -> int:
    """Bytes per element of a dtype."""
    return dtype.itemsize


def torch_dtype(dtype: DType | torch.dtype) -> torch.dtype:
    """The ``torch.dtype`` of a dtype (imports torch)."""
    import torch

    result: Any = getattr(torch, dtype_name(dtype))
    return result
