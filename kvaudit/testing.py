"""Assertions for tests and CI: did a connector deliver the producer's KV intact?

``assert_kv_equal(producer, consumer)`` compares two sides the way ``kvaudit diff`` does
and raises ``AssertionError`` whose message is the diff report as plain text (the same
summary, verdict and located differences as the command's table), so a failing test
says which request, group, block, layer, head, tokens and byte broke. A side is:

- a dump file, a directory of one engine's dumps, or a list of dump files (``str`` or
  ``os.PathLike``); a record JSON file (``kvaudit checksum --format json``);
- a ``kvaudit.records.Record`` or a ``kvaudit.dumps.DumpSet`` already in memory;
- a ``LiveSide``: live ``Checksummer`` objects of one engine's workers with the requests'
  blocks, and optionally their tensors (to locate differences without writing dumps).

Example, in a connector's test::

    from kvaudit.testing import assert_kv_equal

    def test_transfer_is_intact(tmp_path):
        run_transfer(dump_dir=tmp_path)          # writes producer/ and consumer/ dumps
        assert_kv_equal(tmp_path / "producer", tmp_path / "consumer")
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .checksum.checksummer import Checksummer
from .compare import CompareOptions, DiffReport, diff_sources
from .description import CacheDescription, load_description
from .dumps import DumpSet
from .records import Record
from .report import print_diff, render_text
from .sources import ChecksummerSource, Source, register_object, source_of
from .views.inputs import LayerTensors, RequestBlocks


@dataclass
class LiveSide:
    """One engine's workers, live, as one side of ``assert_kv_equal``.

    ``checksummers``: one ``Checksummer`` per worker of the engine (every TP rank of
    every PP stage), each built over that worker's cache tensors with its ranks and role
    (a producer's ``role="producer"``, a consumer's ``role="consumer"``).
    ``requests``: the requests' blocks in the engine's block ids, as ``RequestBlocks``:
    one mapping that every worker shares (engines keep one block table), or a list with
    one mapping per checksummer.
    ``tensors``: optionally, per checksummer (same order), the tensors it was built over
    (by layer name, or the ``kv_caches`` list);
    with them on both sides differences are located down to layers, heads, tokens and
    bytes, as for dumps.
    ``name``: the side in messages, and in the names of workers that have no source.
    """

    checksummers: Sequence[Checksummer]
    requests: Mapping[str, RequestBlocks] | Sequence[Mapping[str, RequestBlocks]]
    tensors: Sequence[LayerTensors] | None = None
    name: str = "live"

    def source(self) -> ChecksummerSource:
        """The side as a source the diff driver reads.

        Returns:
            A source over the checksummers, each with its requests (and tensors).

        Raises:
            KvauditError: No checksummers, or a list of requests or tensors whose length
                is not the number of checksummers.

        """
        if isinstance(self.requests, Mapping):
            requests = [self.requests] * len(self.checksummers)
        else:
            requests = list(self.requests)
        return ChecksummerSource(self.checksummers, requests, self.tensors, self.name)


register_object(LiveSide, lambda side, config, label: side.source(), "a LiveSide")

Side = str | os.PathLike | Sequence[str | os.PathLike] | Record | DumpSet | LiveSide
"""What ``assert_kv_equal`` takes for a producer or a consumer."""


def _description(config: CacheDescription | str | os.PathLike | None) -> CacheDescription | None:
    """The ``config`` option as a description: given, read from its YAML path, or None."""
    if config is None or isinstance(config, CacheDescription):
        return config
    return load_description(os.fspath(config))


def as_source(side: Side, config: CacheDescription | None = None, label: str = "side") -> Source:
    """A side of ``assert_kv_equal`` as a source, through the source registry.

    Args:
        side: Dumps or a record by path (one or several), a ``Record``, a ``DumpSet``
            or a ``LiveSide``.
        config: The cache description of dumps that carry none.
        label: What errors call the side (``producer``, ``consumer``).

    Returns:
        The side as a ``Source``.

    Raises:
        KvauditError: A side that cannot be read or is of no known kind.

    Example:
        >>> import torch
        >>> from kvaudit import Checksummer, RequestBlocks
        >>> from kvaudit.description import parse_description
        >>> from kvaudit.testing import LiveSide, as_source
        >>> description = parse_description({"kvaudit": 1, "num_blocks": 3, "groups": [{
        ...     "spec": {"type": "full_attention", "block_size": 2, "num_kv_heads": 1,
        ...              "head_size": 8, "dtype": "float16", "layout": "NTHC"},
        ...     "layers": ["model.layers.3.attn"]}]}, "live")
        >>> workers = [Checksummer(description, {"model.layers.3.attn": torch.zeros(3, 2, 1, 16)})]
        >>> source = as_source(LiveSide(workers, {"r": RequestBlocks(4, {0: (0, [0, 2])})}))
        >>> source.request_ids
        ['r']

    """
    return source_of(side, config, label)


def diff_kv(
    producer: Side,
    consumer: Side,
    *,
    request_ids: Sequence[str] | None = None,
    config: CacheDescription | str | os.PathLike | None = None,
    locate: bool = True,
) -> DiffReport:
    """The diff report of two sides (see ``assert_kv_equal``), without asserting.

    Args:
        producer: The side that sent the KV.
        consumer: The side that received it.
        request_ids: The requests compared; None for every request.
        config: A ``CacheDescription`` or a YAML path that supplies or overrides the
            dumps' description.
        locate: Narrow differences down where both sides hold the raw KV.

    Returns:
        The report, as ``diff_sources`` makes it.

    Raises:
        KvauditError: Bad input (a missing or malformed dump, an unknown request id).

    Example:
        A producer's dump and a consumer's that holds the same KV in other blocks, then one
        element changed:

        >>> import pathlib, tempfile, torch
        >>> from kvaudit import RequestBlocks, WorkerInfo
        >>> from kvaudit.description import parse_description
        >>> from kvaudit.dumps import write_dump
        >>> from kvaudit.testing import diff_kv
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> description = parse_description({"kvaudit": 1, "num_blocks": 4, "groups": [{
        ...     "spec": {"type": "full_attention", "block_size": 4, "num_kv_heads": 2,
        ...              "head_size": 4, "dtype": "float32", "layout": "NHTC"},
        ...     "layers": ["model.layers.0.attn"]}]}, "diff")
        >>> def dump(name, cache, blocks, role):
        ...     write_dump(folder / name, description, {"model.layers.0.attn": cache},
        ...                {"q": RequestBlocks(8, {0: (0, blocks)})}, worker=WorkerInfo(role=role))
        ...     return folder / name
        >>> kv = torch.randn(4, 2, 4, 8)  # NHTC: [blocks, heads, tokens, K and V]
        >>> sent = dump("producer.safetensors", kv, [0, 1], "producer")
        >>> moved = kv[[2, 3, 0, 1]]  # the producer's blocks 0 and 1 in blocks 2 and 3
        >>> diff_kv(sent, dump("consumer.safetensors", moved, [2, 3], "consumer")).ok
        True
        >>> moved[3, 1, 2, 0] += 1  # block 3 holds position 1
        >>> report = diff_kv(sent, dump("consumer.safetensors", moved, [2, 3], "consumer"))
        >>> report.ok, [group.mismatched_positions for _, _, group in report.groups()]
        (False, [[1]])

    """
    description = _description(config)
    left = as_source(producer, description, "producer")
    right = as_source(consumer, description, "consumer")
    options = CompareOptions(request_ids)
    return diff_sources(left, right, options, locate=None if locate else False)


def report_text(report: DiffReport, title: str | None = None) -> str:
    """A diff report as plain text: what ``kvaudit diff`` prints as its table.

    Args:
        report: The report drawn.
        title: A line printed above the table; None for none.

    Returns:
        The text, without colours.

    Example:
        >>> import torch
        >>> from kvaudit import Checksummer, RequestBlocks
        >>> from kvaudit.description import parse_description
        >>> from kvaudit.testing import LiveSide, diff_kv, report_text
        >>> description = parse_description({"kvaudit": 1, "num_blocks": 2, "groups": [{
        ...     "spec": {"type": "full_attention", "block_size": 8, "num_kv_heads": 2,
        ...              "head_size": 2, "dtype": "float32", "layout": "NHTC"},
        ...     "layers": ["model.layers.1.attn"]}]}, "text")
        >>> def side(cache, role):
        ...     summer = Checksummer(description, {"model.layers.1.attn": cache}, role=role)
        ...     return LiveSide([summer], {"s": RequestBlocks(8, {0: (0, [1])})}, [[cache]])
        >>> cache = torch.randn(2, 2, 8, 4)
        >>> broken = cache.clone()
        >>> broken[1, 0, 5, 3] = 0.0  # block 1, head 0, token 5, an element of V
        >>> text = report_text(diff_kv(side(cache, "producer"), side(broken, "consumer")), "mine")
        >>> print(text.splitlines()[0])
        mine
        >>> "MISMATCH" in text
        True

    """
    return render_text(functools.partial(print_diff, title=title, located_rows="first"), report)


def assert_kv_equal(
    producer: Side,
    consumer: Side,
    *,
    request_ids: Sequence[str] | None = None,
    config: CacheDescription | str | os.PathLike | None = None,
    locate: bool = True,
) -> DiffReport:
    """Assert that the consumer holds the producer's KV, request by request.

    Both sides are checksummed over the tokens both hold (a consumer that decoded further
    is compared up to the last shared token), whatever their TP and PP sizes, layouts,
    block ids and block sizes. ``request_ids`` limits the comparison (default: every
    request); ``config`` (a ``CacheDescription`` or a YAML path) supplies or overrides
    the dumps' description; ``locate`` narrows differences down where both sides hold the
    raw KV (dumps, or a ``LiveSide`` with tensors).

    Args:
        producer: The side that sent the KV.
        consumer: The side that received it.
        request_ids: The requests compared; None for every request.
        config: A ``CacheDescription`` or a YAML path.
        locate: Narrow differences down where both sides hold the raw KV.

    Returns:
        The report, when it is ok.

    Raises:
        AssertionError: A block, replica or request differs or is missing, or a group
            could not be verified; the message is the report as plain text.
        KvauditError: Bad input (a missing or malformed dump, an unknown request id).

    Example:
        Two live sides (a ``LiveSide`` each) of one request, the consumer at TP=2:

        >>> import torch
        >>> from kvaudit import Checksummer, RequestBlocks
        >>> from kvaudit.description import parse_description
        >>> from kvaudit.testing import LiveSide, assert_kv_equal
        >>> def workers(caches, role):
        ...     spec = {"type": "full_attention", "block_size": 4, "num_kv_heads": 4 // len(caches),
        ...             "head_size": 8, "dtype": "bfloat16", "layout": "NHTC"}
        ...     description = parse_description({"kvaudit": 1, "num_blocks": 2, "model_kv_heads": 4,
        ...         "groups": [{"spec": spec, "layers": ["model.layers.2.attn"]}]}, role)
        ...     return [Checksummer(description, {"model.layers.2.attn": cache}, role=role,
        ...                         tp_rank=rank, tp_size=len(caches))
        ...             for rank, cache in enumerate(caches)]
        >>> kv = torch.randn(2, 4, 4, 16).to(torch.bfloat16)  # [blocks, heads, tokens, K and V]
        >>> blocks = {"t": RequestBlocks(7, {0: (0, [1, 0])})}
        >>> producer = LiveSide(workers([kv], "producer"), blocks)
        >>> halves = [kv[:, :2].contiguous(), kv[:, 2:].contiguous()]
        >>> report = assert_kv_equal(producer, LiveSide(workers(halves, "consumer"), blocks))
        >>> report.ok
        True
        >>> halves[1][0, 1, 2, 0] += 1  # block 0 is position 1 of the request
        >>> assert_kv_equal(producer, LiveSide(workers(halves, "consumer"), blocks))
        Traceback (most recent call last):
        ...
        AssertionError: ...
        kvaudit: the consumer's KV is not the producer's
        ...

    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this function's
    report = diff_kv(producer, consumer, request_ids=request_ids, config=config, locate=locate)
    if not report.ok:
        raise AssertionError(
            "\n" + report_text(report, "kvaudit: the consumer's KV is not the producer's")
        )
    return report


__all__ = ["LiveSide", "Side", "as_source", "assert_kv_equal", "diff_kv", "report_text"]
