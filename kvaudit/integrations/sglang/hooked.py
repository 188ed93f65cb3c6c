"""Every SGLang method kvaudit's hooks wrap or call, and every SGLang attribute they read
that is not a constructor argument or a documented field, named once, with what kvaudit
uses it for and the SGLang version it was checked against (docs/sglang.md, "What kvaudit
reaches inside SGLang").

SGLang publishes no stable API for a plug-in to reach its scheduler's disaggregation
steps: its ``HookRegistry`` wraps any method by its dotted name. So each name kvaudit
hooks, calls or reads here may change in another SGLang version; the code reads them
through ``read`` and ``read_or_none`` only, so that a name missing from the SGLang
installed gives one log line naming it and the version checked, and the request is then
unverified (or the agent does not start), never a default that passes for a check.

This module imports neither SGLang nor anything that does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Literal

logger = logging.getLogger("kvaudit.integrations.sglang.inline")

SGLANG_CHECKED = "0.5.23"
"""The SGLang version every name below was checked against (its source read, its
classes run in tests/sglang)."""

Kind = Literal["hook", "call", "read"]


@dataclass(frozen=True)
class Name:
    """One SGLang method or attribute kvaudit reaches: ``owner`` (SGLang's module and
    class), ``attribute`` (a dotted path for a chain of attributes), ``kind`` (``hook``:
    an AROUND hook registered on it; ``call``: kvaudit calls it; ``read``: kvaudit reads
    it) and ``use`` (what kvaudit does with it)."""

    owner: str
    attribute: str
    kind: Kind
    use: str

    @property
    def target(self) -> str:
        """The dotted name ``HookRegistry`` takes: ``owner.attribute``."""
        return f"{self.owner}.{self.attribute}"

    @property
    def private(self) -> bool:
        """Whether SGLang marks it private (a leading underscore)."""
        return any(part.startswith("_") for part in self.attribute.split("."))


_PREFILL = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
_DECODE = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin"
_QUEUE = "sglang.srt.disaggregation.decode.DecodeTransferQueue"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_BUFFERS = "sglang.srt.disaggregation.utils.MetadataBuffers"
_POOLS = "sglang.srt.mem_cache.memory_pool"

SEND_KV_CHUNK = Name(
    _PREFILL, "send_kv_chunk", "hook", "on the last chunk: checksum, sum over TP, write the row"
)
COMMIT_TRANSFER = Name(
    _QUEUE, "_commit_transfer_to_req", "hook", "keep the row before clear_slot zeroes it"
)
VERIFY_CHECKSUMS = Name(
    _DECODE, "_verify_kv_checksums", "hook", "after SGLang's check: kvaudit's, per request"
)
INGEST_REQUESTS = Name(
    _SCHEDULER, "ingest_requests", "hook", "once per loop iteration: start and poll the agent"
)
HANDLE_MISMATCH = Name(
    _DECODE, "_handle_kv_checksum_mismatch", "call", "abort a mismatched request SGLang's way"
)
TRANSFER_STATES = Name(
    f"{_POOLS}.MambaPool",
    "_iter_transfer_state_entries",
    "call",
    "a Mamba pool's state tensors in transfer order",
)
SLOT_SIBLINGS = Name(
    f"{_POOLS}.MambaPool", "_slot_siblings", "read", "refuse slot-indexed side states"
)
CONV_SHARD_GROUPS = Name(
    f"{_POOLS}.MambaPool", "conv_shard_groups", "read", "a conv state's q/k/v split over TP"
)
KV_CACHE_LAYOUT = Name(
    f"{_POOLS}.MHATokenToKVPool", "kv_cache_layout", "read", "refuse layouts other than nhd"
)
USE_HND = Name(f"{_POOLS}.MHATokenToKVPool", "use_hnd", "read", "refuse the hnd layout")
USE_DSA = Name(f"{_POOLS}.MLATokenToKVPool", "use_dsa", "read", "refuse DSA (NSA) pools")
QUEUE_SCHEDULER = Name(
    _QUEUE, "scheduler", "read", "the commit hook finds its scheduler's kvaudit state"
)
KV_CHECKSUM = Name(_BUFFERS, "kv_checksum", "read", "the checksum row kvaudit's words travel in")
BOOTSTRAP_ROOM = Name(
    _BUFFERS, "bootstrap_room", "read", "the row a hybrid pool's group words travel in"
)
ATTN_TP_CPU_GROUP = Name(
    _SCHEDULER, "attn_tp_cpu_group", "read", "the gloo group the ranks' sums are gathered on"
)
SLIDING_WINDOW = Name(
    _SCHEDULER, "sliding_window_size", "read", "an SWAKVPool's window (None: no window)"
)
MODEL = Name(_SCHEDULER, "tp_worker.model_runner.model", "read", "the attention layers' fp8 scales")
INFLIGHT_QUEUE = Name(
    _SCHEDULER,
    "disagg_prefill_inflight_queue",
    "read",
    "a prefill's requests served to live: clients",
)
WAITING_QUEUE = Name(
    _SCHEDULER, "waiting_queue", "read", "a decode's requests served to live: clients"
)
RUNNING_BATCH = Name(
    _SCHEDULER, "running_batch", "read", "a decode's requests served to live: clients"
)
MODE = Name(_SCHEDULER, "disaggregation_mode", "read", "the live agent's role")
CACHE_PROTECTED = Name(
    "sglang.srt.managers.schedule_batch.ReqKvInfo",
    "cache_protected_len",
    "read",
    "where the decode's cached prefix ends (the range checked starts there)",
)
SCALES = Name(
    "sglang.srt.layers.radix_attention.RadixAttention",
    "k_scale_float",
    "read",
    "an fp8 layer's K scale (v_scale_float: its V scale)",
)

HOOKED: tuple[Name, ...] = (
    SEND_KV_CHUNK,
    COMMIT_TRANSFER,
    VERIFY_CHECKSUMS,
    INGEST_REQUESTS,
    HANDLE_MISMATCH,
    TRANSFER_STATES,
    SLOT_SIBLINGS,
    CONV_SHARD_GROUPS,
    KV_CACHE_LAYOUT,
    USE_HND,
    USE_DSA,
    QUEUE_SCHEDULER,
    KV_CHECKSUM,
    BOOTSTRAP_ROOM,
    ATTN_TP_CPU_GROUP,
    SLIDING_WINDOW,
    MODEL,
    INFLIGHT_QUEUE,
    WAITING_QUEUE,
    RUNNING_BATCH,
    MODE,
    CACHE_PROTECTED,
    SCALES,
)
"""The table docs/sglang.md shows (tests/sglang/test_hooked.py checks it against the
SGLang installed)."""


class NotInThisSglang(AttributeError):
    """An SGLang name kvaudit reaches is missing from the object it was read on (another
    SGLang version than the one checked, or a stand-in that lacks it); the message says
    which, in one line."""


_reported: set[str] = set()
"""The names already logged as missing (bounded by ``HOOKED``): each is logged once per
process, whichever scheduler meets it."""


def installed_version() -> str:
    """The SGLang version installed, or ``unknown``."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "unknown"


def read(obj: object, name: Name, attribute: str | None = None) -> Any:
    """``obj``'s attribute ``name`` (its dotted path walked).

    Args:
        obj: The SGLang object (of ``name.owner``'s class, or one that stands in for it).
        name: The row of ``HOOKED``.
        attribute: Another attribute of the same row (``v_scale_float`` of ``SCALES``).

    Returns:
        The attribute's value.

    Raises:
        NotInThisSglang: An attribute on the path is missing.

    """
    value = obj
    for part in (attribute or name.attribute).split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise NotInThisSglang(
                f"{type(value).__name__} has no {part!r} ({name.target}; kvaudit was "
                f"checked against SGLang {SGLANG_CHECKED}, SGLang {installed_version()} "
                "is installed)"
            ) from None
    return value


def read_or_none(obj: object, name: Name, consequence: str, attribute: str | None = None) -> Any:
    """``read``, or None where the attribute is missing, which is logged once per name
    with ``consequence`` (what kvaudit does without it).

    Args:
        obj: The SGLang object.
        name: The row of ``HOOKED``.
        consequence: What follows from its absence, e.g. ``"no fp8 scales recorded"``.
        attribute: As for ``read``.

    Returns:
        The attribute's value, or None.

    """
    try:
        return read(obj, name, attribute)
    except NotInThisSglang as missing:
        report(missing, consequence)
        return None


def report(missing: NotInThisSglang, consequence: str) -> None:
    """Log a missing name once per process, with what kvaudit does without it.

    Args:
        missing: The error ``read`` raised.
        consequence: What follows from the absence.

    """
    text = str(missing)
    if text not in _reported and len(_reported) < 4 * len(HOOKED):
        _reported.add(text)
        logger.warning("kvaudit: %s: %s", text, consequence)


def call(obj: object, name: Name, *args: Any) -> Any:
    """Call ``obj``'s method ``name`` with ``args``.

    Args:
        obj: The SGLang object.
        name: A ``call`` row of ``HOOKED``.
        *args: The method's arguments.

    Returns:
        What the method returns.

    Raises:
        NotInThisSglang: The method is missing.

    """
    return read(obj, name)(*args)
