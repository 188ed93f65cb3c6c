"""What a dump is: the names of its format (version, metadata keys, the stored-checksums
tensor) and the dataclasses of an opened dump, its requests and a set of dumps.
"""

from __future__ import annotations

import functools
import mmap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..description import CacheDescription
from ..errors import KvauditError
from ..records import WorkerInfo
from ..views import GroupViews, LayerTensor, build_group_views
from .layers import layer_parts
from .safetensors_io import tensor_nbytes

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


@dataclass
class DumpRequest:
    """One request as a dump lists it: its token count and, per group, the position of
    the first listed block and the ENGINE block ids of consecutive positions; the
    block hashes of the leading listed blocks and the producer's wire bytes, if given."""

    num_tokens: int
    groups: dict[int, tuple[int, list[int]]]
    block_hashes: dict[int, list[bytes]] = field(default_factory=dict)
    received: bytes | None = None


@dataclass
class Dump:
    """One worker's dump, opened and checked, its tensors memory-mapped (read-only).

    ``tensors`` holds each layer's cache (K and V tensors for layouts that keep them
    apart) whose ``N`` axis (state layers: first axis) is the dumped rows' kernel blocks;
    row ``i`` is engine block ``block_ids[i]``, or block ``i`` when ``block_ids`` is None
    (the whole cache). The tensors view the file's pages: never write to them.
    """

    path: str
    worker: WorkerInfo
    description: CacheDescription
    tensors: dict[str, LayerTensor]
    num_rows: int
    block_ids: list[int] | None
    requests: dict[str, DumpRequest]
    stored_checksums: np.ndarray | None = None
    # The file mappings the tensors view (kept open as long as the dump is).
    maps: list[mmap.mmap] = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rows: dict[int, int] | None = None
        if self.block_ids is not None:
            self._rows = {block_id: row for row, block_id in enumerate(self.block_ids)}

    @property
    def name(self) -> str:
        """The dump in messages: its path."""
        return self.path

    def holds(self, block_id: int) -> bool:
        """Whether the dump holds a row of this engine block."""
        if self._rows is not None:
            return block_id in self._rows
        return 0 <= block_id < self.num_rows

    def row_of(self, block_id: int) -> int:
        """The row that holds an engine block.

        Raises:
            KvauditError: The dump does not hold the block.

        """
        if not self.holds(block_id):
            raise KvauditError(f"the dump does not hold block {block_id}", source=self.path)
        return self._rows[block_id] if self._rows is not None else block_id

    def row_bytes(self) -> dict[int, int]:
        """Per group, the bytes of one dumped row its checksummed layers read."""
        result = {}
        for group in self.description.groups:
            total = 0
            for entry in group.layers:
                if entry.shares is not None or entry.name in self.description.draft_layers:
                    continue
                tensor = self.tensors.get(entry.name)
                if tensor is not None:
                    total += sum(tensor_nbytes(part) for part in layer_parts(tensor))
            result[group.id] = total // self.num_rows if self.num_rows else 0
        return result

    def drop_pages(self) -> None:
        """Drop the mapped pages this process holds resident; they are read again from the
        file (or the page cache) when next touched."""
        for mapped in self.maps:
            mapped.madvise(mmap.MADV_DONTNEED)

    def file_offset(self, tensor: torch.Tensor) -> int:
        """The byte offset in the dump's file of a tensor's first element (for an
        ExampleConnector folder: in the file of the tensor's layer). ``tensor`` is one of
        ``tensors`` or any view of one (a row, a slice, another dtype).

        Raises:
            KvauditError: The tensor is not a view of this dump's file mappings (a copy,
                an empty tensor, another dump's tensor), or reaches past them.

        """
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            raise KvauditError(
                "the tensor is not a view of this dump's file mapping", source=self.path
            )
        first = tensor.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        end = first + (last + 1) * tensor.element_size()
        for mapped in self.maps:
            base = int(np.frombuffer(mapped, dtype=np.uint8, count=1).ctypes.data)
            if base <= first and end <= base + len(mapped):
                return first - base
        raise KvauditError("the tensor is not a view of this dump's file mapping", source=self.path)

    @functools.cached_property
    def group_views(self) -> dict[int, GroupViews]:
        """Every group's views of the dump's rows (as its checksummer sees them), built
        once: what locating a difference and planting a fault read blocks through."""
        return build_group_views(
            self.description,
            self.tensors,
            tp_rank=self.worker.tp_rank,
            tp_size=self.worker.tp_size,
            num_blocks=self.num_rows,
        )


@dataclass
class DumpSet:
    """One engine's dumps, sorted by ``(pp_rank, tp_rank)``; ``missing`` lists the
    ``(pp_rank, tp_rank)`` of its layout that no dump holds."""

    dumps: list[Dump]
    complete: bool
    missing: list[tuple[int, int]] = field(default_factory=list)

    @property
    def request_ids(self) -> list[str]:
        """Every request some dump lists, sorted."""
        return sorted({request_id for dump in self.dumps for request_id in dump.requests})
