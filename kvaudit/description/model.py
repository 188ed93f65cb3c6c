"""The cache description's model: a worker's KV cache groups, their layers, specs and
layouts, as typed, immutable dataclasses (docs/cache-description.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..core.dtypes import BFLOAT16, DType

ATTENTION_TYPES = (
    "full_attention",
    "sliding_window",
    "chunked_local_attention",
    "mla",
    "sliding_window_mla",
)
MLA_TYPES = ("mla", "sliding_window_mla")
SPEC_TYPES = (*ATTENTION_TYPES, "mamba")

SPEC_CLASSES = {
    "full_attention": "FullAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "chunked_local_attention": "ChunkedLocalAttentionSpec",
    "mla": "MLAAttentionSpec",
    "sliding_window_mla": "SlidingWindowMLASpec",
    "mamba": "MambaSpec",
}
"""vLLM's ``KVCacheSpec`` class of each spec type: part of a layer's fingerprint."""


@dataclass(frozen=True)
class StateSplit:
    """How one Mamba state is split across TP ranks: the split axis and its segments.

    Each segment is ``(local_rows, replicas)``: this worker's rows of the segment along
    ``axis``, and how many consecutive ranks hold the same rows.
    """

    axis: int
    segments: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's cache holds and how its tensor is laid out (a group's spec,
    with a layer's overrides merged over it)."""

    type: str
    block_size: int
    kernel_block_size: int
    num_kv_heads: int = 1
    head_size: int = 0
    head_size_v: int = 0
    dtype: DType = BFLOAT16
    layout: str = "NTHC"
    sliding_window: int | None = None
    max_tp_shards: int | None = None
    # chunked_local_attention only: tokens per attention chunk, where known.
    attention_chunk_size: int | None = None
    # Mamba only.
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[DType, ...] = ()
    checksummed_states: int | None = None
    tp_replicated: bool = False
    state_splits: tuple[StateSplit, ...] | None = None
    # vLLM's KVCacheSpec class, where the engine uses another than the type's own.
    spec_class: str | None = None
    # Attention only: what stored K and V elements are multiplied by to give their values
    # (quantized caches); used by value comparisons, not by checksums.
    k_scale: float | None = None
    v_scale: float | None = None

    @property
    def class_name(self) -> str:
        """The name of vLLM's ``KVCacheSpec`` class for this layer (``spec_class``, else
        the type's class)."""
        return self.spec_class or SPEC_CLASSES[self.type]

    @property
    def is_state(self) -> bool:
        return self.type == "mamba"

    @property
    def is_mla(self) -> bool:
        return self.type in MLA_TYPES

    def axis_sizes(self, *, kernel_blocks: int = 1, tokens: int | None = None) -> dict[str, int]:
        """The size of each layout letter (docs/cache-description.md, "Layouts"):
        ``kernel_blocks`` along N, ``tokens`` along T (default: a kernel block's)."""
        return {
            "N": kernel_blocks,
            "T": self.kernel_block_size if tokens is None else tokens,
            "H": self.num_kv_heads,
            "K": 2,
            "D": self.head_size,
            "C": self.head_size + self.head_size_v,
        }

    @property
    def covered_states(self) -> int:
        """How many leading Mamba states are checksummed."""
        if self.checksummed_states is None:
            return len(self.shapes)
        return self.checksummed_states


@dataclass(frozen=True)
class LayerEntry:
    """One layer of a group: its name, merged spec, and the layer whose cache it aliases."""

    name: str
    spec: LayerSpec
    shares: str | None = None


NOT_TRANSFERRED = "it is not a transfer group"
HOST_RESIDENT = "its KV is host-resident"
LEFT_OUT_BY_DESCRIPTION = frozenset({NOT_TRANSFERRED, HOST_RESIDENT})
"""The reasons a group is not covered because its description says so (``transfer:
false``, ``host_resident: true``); any other reason means KV that moves goes unchecked."""


@dataclass(frozen=True)
class GroupDescription:
    """A KV cache group: layers that share one block table and block size."""

    id: int
    spec: LayerSpec
    layers: tuple[LayerEntry, ...]
    transfer: bool = True
    host_resident: bool = False
    # The group's own block space (a second pool, state slots); None: the top-level one.
    num_blocks: int | None = None

    @property
    def block_size(self) -> int:
        return self.spec.block_size


@dataclass(frozen=True)
class CacheDescription:
    """A worker's whole KV cache description."""

    num_blocks: int
    groups: tuple[GroupDescription, ...]
    model_kv_heads: int | None = None
    draft_layers: frozenset[str] = field(default_factory=frozenset)
    # Where it was read from, for error messages; not part of what the description says.
    source: str = field(default="<description>", compare=False)

    def group(self, group_id: int) -> GroupDescription:
        """The group with this id.

        Args:
            group_id: The group's id.

        Returns:
            The group's description.

        Raises:
            KeyError: The description has no such group.

        """
        for group in self.groups:
            if group.id == group_id:
                return group
        raise KeyError(group_id)

    def blocks_of(self, group_id: int) -> int:
        """The manager blocks of a group's block space (its own ``num_blocks``, else the
        top-level one).

        Args:
            group_id: The group's id.

        Returns:
            The number of blocks each of the group's layer caches holds.

        Raises:
            KeyError: The description has no such group.

        """
        own = self.group(group_id).num_blocks
        return self.num_blocks if own is None else own

    @property
    def has_group_spaces(self) -> bool:
        """Whether some group has a block space of its own (``num_blocks`` of its own)."""
        return any(group.num_blocks is not None for group in self.groups)

    def group_rows(self, num_blocks: int | Mapping[int, int] | None = None) -> dict[int, int]:
        """Each group's rows: ``num_blocks`` for every group when an int, a group's entry
        when a mapping, else (None, or a group the mapping lacks) its block space's size.

        Args:
            num_blocks: The rows tensors hold, for all groups or per group id.

        Returns:
            Group id to the rows its layers' tensors hold.

        """
        if isinstance(num_blocks, int):
            return {group.id: num_blocks for group in self.groups}
        given = num_blocks or {}
        return {
            group.id: given[group.id] if group.id in given else self.blocks_of(group.id)
            for group in self.groups
        }


FORMAT_VERSION = 1
"""The description format version a description's ``kvaudit`` key must give."""

LAYOUT_AXES = "NTHKDC"
"""The axis letters of a layout (see docs/cache-description.md, "Layouts")."""

SLIDING_TYPES = ("sliding_window", "sliding_window_mla")
