"""What a dump is: the names of its format (version, metadata keys, the stored-checksums
tensor) and the dataclasses of an opened dump, its requests and a set of dumps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..core.arrays import data_ptr, element_size, strides
from ..core.dtypes import DType
from ..core.errors import KvauditError
from ..core.mapping import FileMap
from ..description import CacheDescription
from ..records import WorkerInfo
from ..views import GroupViews, LayerTensor, build_group_views
from .layers import layer_parts
from .safetensors_io import as_integers, tensor_nbytes, tensor_of

if TYPE_CHECKING:
    import torch

FORMAT = "1"
"""The dump format version a dump's ``kvaudit.format`` gives."""

STORED_CHECKSUMS = "kvaudit/stored_checksums"
"""The optional int64 tensor of each dumped row's stored checksum."""

COPY_BYTES = 64 << 20
"""Bytes per copy when writing a dump."""

META_FORMAT = "kvaudit.format"
META_WORKER = "kvaudit.worker"
META_CACHE = "kvaudit.cache"
META_REQUESTS = "kvaudit.requests"
META_BLOCKS = "kvaudit.blocks"
META_KEYS = (META_FORMAT, META_WORKER, META_CACHE, META_REQUESTS, META_BLOCKS)


class TorchViews(Mapping[str, "LayerTensor"]):
    """A dump's layer arrays as torch tensors of their dtypes, each made on first use:
    torch is imported only when a tensor is asked for, not to list or size them."""

    def __init__(self, arrays: Mapping[str, LayerTensor], dtypes: Mapping[str, DType]) -> None:
        self._arrays = arrays
        self._dtypes = dtypes
        self._tensors: dict[str, LayerTensor] = {}

    def __getitem__(self, name: str) -> LayerTensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            array, dtype = self._arrays[name], self._dtypes[name]
            if isinstance(array, tuple):
                tensor = (tensor_of(array[0], dtype), tensor_of(array[1], dtype))
            else:
                tensor = tensor_of(array, dtype)
            self._tensors[name] = tensor
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


@dataclass
class DumpRequest:
    """One request as a dump lists it: its token count, blocks, hashes and wire bytes.

    ``groups`` maps a group id to the position of the first listed block and the ENGINE
    block ids of consecutive positions; ``block_hashes`` holds the hashes of the leading
    listed blocks and ``received`` the producer's wire bytes, if given.
    """

    num_tokens: int
    groups: dict[int, tuple[int, list[int]]]
    block_hashes: dict[int, list[bytes]] = field(default_factory=dict)
    received: bytes | None = None


class RowSpace:
    """One block space's dumped rows: how many, and the engine block each row holds (row
    ``i`` is block ``block_ids[i]``, or block ``i`` when ``block_ids`` is None)."""

    def __init__(self, num_rows: int, block_ids: list[int] | None) -> None:
        self.num_rows = num_rows
        self.block_ids = block_ids
        self._rows: dict[int, int] | None = None
        if block_ids is not None:
            self._rows = {block_id: row for row, block_id in enumerate(block_ids)}

    def holds(self, block_id: int) -> bool:
        """Whether the space has a row of this engine block."""
        if self._rows is not None:
            return block_id in self._rows
        return 0 <= block_id < self.num_rows

    def row(self, block_id: int) -> int:
        """The row of a block the space holds (``holds`` says whether it does)."""
        return self._rows[block_id] if self._rows is not None else block_id

    def block_of(self, row: int) -> int:
        """The engine block a row holds."""
        return self.block_ids[row] if self.block_ids is not None else row


@dataclass
class Dump:
    """One worker's dump, opened and checked, its tensors memory-mapped (read-only).

    ``tensors`` holds each layer's cache (K and V tensors for layouts that keep them
    apart) whose ``N`` axis (state layers: first axis) is the dumped rows' kernel blocks;
    row ``i`` is engine block ``block_ids[i]``, or block ``i`` when ``block_ids`` is None
    (the whole cache). Where the dump lists blocks per group (``kvaudit.blocks`` an
    object: groups with block spaces of their own), ``num_rows`` and ``block_ids`` are per
    group id and each group's layers hold that group's rows; ``space(group_id)`` gives
    any group's rows either way. The tensors view the file's pages: never write to them.
    ``arrays`` holds the same bytes as numpy arrays of integers of the element's size
    (``kvaudit.core.arrays``): what the CPU path reads without importing torch.
    """

    path: str
    worker: WorkerInfo
    description: CacheDescription
    tensors: dict[str, LayerTensor]
    num_rows: int | dict[int, int]
    block_ids: list[int] | dict[int, list[int] | None] | None
    requests: dict[str, DumpRequest]
    stored_checksums: np.ndarray | None = None
    # The file mappings the tensors view (kept open as long as the dump is).
    maps: list[FileMap] = field(default_factory=list, repr=False, compare=False)
    arrays: dict[str, LayerTensor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.arrays is None:
            self.arrays = {name: _arrays_of(tensor) for name, tensor in self.tensors.items()}
        self.spaces: dict[int, RowSpace] = {}
        if isinstance(self.num_rows, dict):
            assert isinstance(self.block_ids, dict)
            for group_id, rows in self.num_rows.items():
                self.spaces[group_id] = RowSpace(rows, self.block_ids.get(group_id))
        else:
            assert not isinstance(self.block_ids, dict)
            # One space for every group: the same object, so that batches read each row
            # of every layer once.
            shared = RowSpace(self.num_rows, self.block_ids)
            self.spaces = {group.id: shared for group in self.description.groups}

    @property
    def name(self) -> str:
        """The dump in messages: its path."""
        return self.path

    @property
    def per_group(self) -> bool:
        """Whether the dump's groups have rows of their own (``kvaudit.blocks`` per group)."""
        return isinstance(self.num_rows, dict)

    def space(self, group_id: int | None = None) -> RowSpace:
        """The rows a group's layers hold; with no group, the one space every group
        shares.

        Raises:
            KvauditError: The description has no such group, or no group is named where
                the dump's groups have rows of their own.

        """
        if group_id is None:
            if self.per_group:
                raise KvauditError(
                    "the dump lists its blocks per group: a block id needs its group",
                    source=self.path,
                )
            return next(iter(self.spaces.values()))
        space = self.spaces.get(group_id)
        if space is None:
            raise KvauditError(f"the dump has no group {group_id}", source=self.path)
        return space

    def holds(self, block_id: int, group_id: int | None = None) -> bool:
        """Whether the dump holds a row of this engine block (of the group's space)."""
        return self.space(group_id).holds(block_id)

    def row_of(self, block_id: int, group_id: int | None = None) -> int:
        """The row (of the group's layers) that holds an engine block.

        Raises:
            KvauditError: The dump does not hold the block, or no group is named where
                the dump's groups have rows of their own.

        """
        space = self.space(group_id)
        if not space.holds(block_id):
            raise KvauditError(
                f"the dump does not hold block {block_id} of group {group_id}"
                if self.per_group
                else f"the dump does not hold block {block_id}",
                source=self.path,
            )
        return space.row(block_id)

    def rows_description(self) -> CacheDescription:
        """The description with the dump's rows as its whole cache (each group's rows its
        block space), for writing the dump's rows as a dump of their own."""
        if isinstance(self.num_rows, int):
            groups = tuple(
                dataclasses.replace(group, num_blocks=None) for group in self.description.groups
            )
            return dataclasses.replace(self.description, num_blocks=self.num_rows, groups=groups)
        groups = tuple(
            dataclasses.replace(group, num_blocks=self.num_rows[group.id])
            for group in self.description.groups
        )
        return dataclasses.replace(self.description, groups=groups)

    def max_rows(self) -> int:
        """The most rows any group's layers hold."""
        return max((space.num_rows for space in self.spaces.values()), default=0)

    def row_bytes(self) -> dict[int, int]:
        """Per group, the bytes of one dumped row its checksummed layers read."""
        result = {}
        for group in self.description.groups:
            total = 0
            for entry in group.layers:
                if entry.shares is not None or entry.name in self.description.draft_layers:
                    continue
                tensor = self.layer_arrays.get(entry.name)
                if tensor is not None:
                    total += sum(tensor_nbytes(part) for part in layer_parts(tensor))
            rows = self.space(group.id).num_rows
            result[group.id] = total // rows if rows else 0
        return result

    def drop_pages(self) -> None:
        """Drop the mapped pages this process holds resident.

        They are read again from the file (or the page cache) when next touched.
        """
        for mapped in self.maps:
            mapped.drop_pages()

    def check_unchanged(self) -> None:
        """Refuse to read on from a file that shrank since it was mapped.

        Raises:
            KvauditError: The file changed while reading.

        """
        for mapped in self.maps:
            mapped.check_unchanged()

    @property
    def layer_arrays(self) -> dict[str, LayerTensor]:
        """``arrays``, always set after construction."""
        assert self.arrays is not None
        return self.arrays

    def file_offset(self, tensor: torch.Tensor | np.ndarray) -> int:
        """The byte offset in the dump's file of a tensor's first element.

        For an ExampleConnector folder the offset is in the file of the tensor's layer.

        Args:
            tensor: One of ``tensors`` or ``arrays``, or any view of one (a row, a slice,
                another dtype).

        Returns:
            The offset, in bytes from the start of the file.

        Raises:
            KvauditError: The tensor is not a view of this dump's file mappings (a copy,
                an empty tensor, another dump's tensor), or reaches past them.

        """
        if (not isinstance(tensor, np.ndarray) and tensor.device.type != "cpu") or any(
            size == 0 for size in tensor.shape
        ):
            raise KvauditError(
                "the tensor is not a view of this dump's file mapping", source=self.path
            )
        first = data_ptr(tensor)
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, strides(tensor)))
        end = first + (last + 1) * element_size(tensor)
        for mapped in self.maps:
            base = mapped.address
            if base <= first and end <= base + mapped.length:
                return first - base
        raise KvauditError("the tensor is not a view of this dump's file mapping", source=self.path)

    @functools.cached_property
    def array_views(self) -> dict[int, GroupViews]:
        """Every group's views of ``arrays`` (numpy, no torch), built once.

        They hold the same groups, fingerprints and reasons as ``group_views``, for the
        CPU path, the inventory, locating a difference and planting a fault.
        """
        return build_group_views(
            self.description,
            self.layer_arrays,
            tp_rank=self.worker.tp_rank,
            tp_size=self.worker.tp_size,
            num_blocks=self.num_rows,
        )

    @functools.cached_property
    def group_views(self) -> dict[int, GroupViews]:
        """Every group's views of the dump's rows as torch tensors, built once.

        They are what a torch or GPU checksummer sees.
        """
        return build_group_views(
            self.description,
            self.tensors,
            tp_rank=self.worker.tp_rank,
            tp_size=self.worker.tp_size,
            num_blocks=self.num_rows,
        )


@dataclass
class DumpSet:
    """One engine's dumps, sorted by ``(pp_rank, tp_rank)``.

    ``missing`` lists the ``(pp_rank, tp_rank)`` of its layout that no dump holds;
    ``complete`` is true when there are none.
    """

    dumps: list[Dump]
    complete: bool
    missing: list[tuple[int, int]] = field(default_factory=list)

    @property
    def request_ids(self) -> list[str]:
        """Every request some dump lists, sorted."""
        return sorted({request_id for dump in self.dumps for request_id in dump.requests})


def _arrays_of(tensor: LayerTensor) -> LayerTensor:
    """A CPU tensor (or K and V tensors) as numpy integer arrays sharing its memory."""
    if isinstance(tensor, tuple):
        return (_array_of(tensor[0]), _array_of(tensor[1]))
    return _array_of(tensor)


def _array_of(tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor
    return as_integers(tensor.detach().cpu()).numpy()
