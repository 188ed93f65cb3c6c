"""The safetensors file format, strictly: the header parsed with every check a reader
needs, the file memory-mapped and its tensors viewed in place (no copy); and the writing
underneath a dump: header bytes, tensors end to end and aligned, an atomic write synced
to disk. Nothing here knows what a dump holds.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from ..core.arrays import integer_array
from ..core.dtypes import DType, dtype_size, parse_dtype, safetensors_dtype_name, torch_dtype
from ..core.files import atomic_path, check_input
from ..core.mapping import FileMap
from ..core.validation import (
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    DuplicateKeyError,
    check_plain,
    fail,
    is_int,
    short,
    short_text,
    unique_keys,
)

if TYPE_CHECKING:
    import torch

PAD_PREFIX = "kvaudit/pad/"
"""Names of the U8 filler tensors that earlier kvaudit writers put between tensors to
align them (readers skip them)."""

ALIGNMENT = 64
_LENGTH = struct.Struct("<Q")
_INT64_LIMIT = 1 << 63


# Reading.


@dataclass(frozen=True)
class Entry:
    """A tensor of a safetensors file: its dtype, shape and absolute byte range."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass
class Header:
    """A safetensors file's tensors and string metadata."""

    tensors: dict[str, Entry]
    metadata: dict[str, str]


def safetensors_files(folder: str) -> list[str]:
    """The folder's ``*.safetensors`` files, sorted by name.

    Raises:
        KvauditError: The folder cannot be listed, or one of them is not a regular file (a
            FIFO or a device would block the reader).

    """
    try:
        names = sorted(os.listdir(folder))
    except OSError as error:
        fail(folder, f"cannot list: {error.strerror}")
    paths = [os.path.join(folder, name) for name in names if name.endswith(".safetensors")]
    files = [path for path in paths if not os.path.isdir(path)]
    for path in files:
        check_input(path)
    return files


def read_header(path: str) -> Header:
    """Parse a safetensors header and check that every tensor's bytes lie in the file."""
    check_input(path)  # a FIFO or a device would block or never end
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(8)
            if len(head) < 8:
                fail(path, f"not a safetensors file: {size} bytes, less than the 8-byte length")
            (length,) = _LENGTH.unpack(head)
            if length > MAX_HEADER_BYTES:
                fail(
                    path,
                    f"not a safetensors file: its header length is {length} bytes, more than "
                    f"the {MAX_HEADER_BYTES} safetensors reads",
                )
            if length > size - 8:
                fail(
                    path,
                    f"not a safetensors file or truncated: its header length is {length} "
                    f"bytes, only {size - 8} follow",
                )
            raw = file.read(length)
    except FileNotFoundError:
        fail(path, "no such file")
    except IsADirectoryError:
        fail(path, "is a directory, expected a safetensors file")
    except OSError as error:
        fail(path, f"cannot read: {error.strerror}")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except DuplicateKeyError as error:
        fail(path, f"invalid safetensors header: key {short(error.key)} appears twice")
    except (UnicodeDecodeError, json.JSONDecodeError):
        fail(path, "not a safetensors file: its header is not JSON")
    except ValueError as error:  # an integer of more digits than Python converts
        fail(path, f"invalid safetensors header: {short_text(str(error))}")
    except RecursionError:
        fail(path, f"safetensors header: nested more than {MAX_DEPTH} levels deep")
    check_plain(header, path, "safetensors header")
    if not isinstance(header, dict):
        fail(path, "not a safetensors file: its header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        fail(path, "invalid safetensors header: __metadata__ must map strings to strings")
    data_start = 8 + length
    entries = {
        name: _header_entry(path, name, info, data_start, size) for name, info in header.items()
    }
    ranges = sorted(entries.values(), key=lambda entry: (entry.start, entry.nbytes))
    end = _covered_end(path, ranges, data_start)
    if size > end:
        fail(path, f"not a safetensors file: {size - end} bytes follow its last tensor")
    return Header(entries, metadata)


def _covered_end(path: str, ranges: list[Entry], data_start: int) -> int:
    """Where the tensors end; refuse tensors that overlap, or leave bytes between them or
    before the first (safetensors lays its tensors end to end from the header on)."""
    end, last = data_start, ""
    for entry in ranges:
        if entry.start < end:  # never the first: offsets are not negative
            fail(path, f"invalid safetensors header: tensors {last} and {entry.name} overlap")
        if entry.start > end:
            fail(
                path,
                f"invalid safetensors header: bytes {end - data_start} to "
                f"{entry.start - data_start - 1} of the data, before tensor {entry.name}, "
                "belong to no tensor",
            )
        end, last = entry.start + entry.nbytes, entry.name
    return end


def _header_entry(path: str, name: str, info: object, data_start: int, size: int) -> Entry:
    where = f"invalid safetensors header: tensor {name}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        fail(path, f"{where}: expected dtype, shape and data_offsets")
    type_name = info["dtype"]
    try:
        dtype = parse_dtype(type_name)
        if safetensors_dtype_name(dtype) != type_name:
            raise ValueError
    except ValueError:
        fail(path, f"{where}: unknown dtype {short(type_name)}")
    shape = info["shape"]
    if not isinstance(shape, list) or not all(is_int(n) and 0 <= n < _INT64_LIMIT for n in shape):
        fail(path, f"{where}: shape {short(shape)} is not a list of sizes")
    offsets = info["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(n) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        fail(path, f"{where}: data_offsets {short(offsets)} is not [begin, end]")
    if math.prod(n for n in shape if n) * dtype_size(dtype) >= _INT64_LIMIT:
        fail(path, f"{where}: shape {short(shape)} is too large")
    nbytes = math.prod(shape) * dtype_size(dtype)
    if offsets[1] - offsets[0] != nbytes:
        fail(
            path,
            f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, its "
            f"shape and dtype need {nbytes}",
        )
    if data_start + offsets[1] > size:
        fail(
            path,
            f"truncated: tensor {name} ends at byte {data_start + offsets[1]}, the file has "
            f"{size} bytes",
        )
    return Entry(name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def map_file(path: str) -> FileMap:
    """The whole file mapped read-only, holding no file descriptor where the platform
    allows."""
    try:
        return FileMap(path)
    except OSError as error:
        fail(path, f"cannot map: {error.strerror}")


def array_view(mapped: FileMap, entry: Entry) -> np.ndarray:
    """A read-only numpy array over a mapped file's bytes (no copy): the tensor's shape,
    its elements as integers of their size (``kvaudit.core.arrays``)."""
    if entry.nbytes == 0:
        raw = np.zeros(0, dtype=np.uint8)
    else:
        raw = np.frombuffer(mapped.buffer, dtype=np.uint8, count=entry.nbytes, offset=entry.start)
        raw.flags.writeable = False  # the pages are mapped read-only
    return integer_array(raw.view(f"u{entry.dtype.itemsize}")).reshape(entry.shape)


def tensor_of(array: np.ndarray, dtype: DType) -> torch.Tensor:
    """A torch tensor of ``dtype`` over an ``array_view`` (no copy; imports torch)."""
    import torch

    with warnings.catch_warnings():
        # The mapping is read-only and torch has no read-only tensors; nothing writes it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(torch_dtype(dtype))


def tensor_view(mapped: FileMap, entry: Entry) -> torch.Tensor:
    """A tensor over a mapped file's bytes (no copy)."""
    return tensor_of(array_view(mapped, entry), entry.dtype)


def tensor_nbytes(tensor: torch.Tensor | np.ndarray) -> int:
    return int(tensor.nbytes)


def as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the element's size (a view): copies and gathers then
    work for every dtype on every device (fp8 included)."""
    import torch

    integers = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(integers[tensor.element_size()])


# Writing.


@dataclass
class Output:
    """One tensor of a dump being written: its header entry and how to write its bytes."""

    name: str
    dtype: DType | torch.dtype
    shape: tuple[int, ...]
    write: Callable[[BinaryIO], None]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


def write_bytes(data: bytes) -> Callable[[BinaryIO], None]:
    return lambda file: file.write(data)


def end_to_end(outputs: list[Output]) -> list[tuple[Output, int]]:
    """The outputs with their data offsets, end to end as safetensors lays them, those
    whose sizes are the larger multiples of 64, 32, 16 ... bytes first (in their own order
    within each): then every tensor whose size is a multiple of 8 bytes starts 8-byte
    aligned, and one of 64 bytes 64-byte aligned, with no filler tensor."""

    def alignment(output: Output) -> int:
        size = output.nbytes
        return ALIGNMENT if size % ALIGNMENT == 0 else size & -size

    placed = []
    offset = 0
    for output in sorted(outputs, key=alignment, reverse=True):
        placed.append((output, offset))
        offset += output.nbytes
    return placed


def header_bytes(metadata: Mapping[str, str], placed: list[tuple[Output, int]]) -> bytes:
    """The JSON header, padded with spaces so that the data starts 64-byte aligned."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    for output, offset in placed:
        header[output.name] = {
            "dtype": safetensors_dtype_name(output.dtype),
            "shape": list(output.shape),
            "data_offsets": [offset, offset + output.nbytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    pad = -(8 + len(text)) % ALIGNMENT
    return text + b" " * pad


def write_atomically(target: str, header: bytes, placed: list[tuple[Output, int]]) -> None:
    """Write a safetensors file (header, then each output at its offset) whole or not at all."""
    with atomic_path(target) as temporary, open(temporary, "xb") as file:
        write_safetensors(file, header, placed)


def write_safetensors(file: BinaryIO, header: bytes, placed: list[tuple[Output, int]]) -> None:
    """Write a safetensors file's bytes (header, then each output at its offset) into an
    open file, from its current position."""
    begin = file.tell()
    file.write(_LENGTH.pack(len(header)))
    file.write(header)
    data_start = begin + 8 + len(header)
    for output, offset in placed:
        output.write(file)
        if file.tell() != data_start + offset + output.nbytes:
            raise RuntimeError(f"tensor {output.name} wrote the wrong number of bytes")
