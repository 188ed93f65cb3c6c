"""``verify --received``: a consumer's checksums, over the producer's tokens and under its
position numbering, against the producer's wire checksums its dumps carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..compare import DiffReport, verify_received
from ..compare.received import received_numbering
from ..core.errors import KvauditError
from ..dumps import DumpSet
from ..pairing import group_windows
from ..records.wire import WireChecksums, decode_wire
from ..sources import Progress, Runtime, Source
from .sides import trim_to


def received_wires(
    dump_set: DumpSet, request_ids: Sequence[str] | None = None
) -> dict[str, WireChecksums]:
    """Per request, the producer's wire checksums the set's dumps carry, decoded
    (``carried_wires``)."""
    carriers = [
        (dump.path, {rid: r.received for rid, r in dump.requests.items() if r.received is not None})
        for dump in dump_set.dumps
    ]
    return carried_wires(carriers, request_ids)


def carried_wires(
    carriers: Iterable[tuple[str, Mapping[str, bytes]]], request_ids: Sequence[str] | None
) -> dict[str, WireChecksums]:
    """Per request, the wire bytes that dump files carry (each file's name with its bytes
    per request), decoded; only ``request_ids`` where given.

    Raises:
        KvauditError: Two workers carry different bytes for one request.
        WireFormatError: Malformed bytes; the message names the dump file and the request.

    """
    found: dict[str, tuple[bytes, str]] = {}
    for name, carried in carriers:
        for request_id, data in carried.items():
            if request_ids is not None and request_id not in request_ids:
                continue
            seen = found.get(request_id)
            if seen is None:
                found[request_id] = (data, name)
            elif seen[0] != data:
                raise KvauditError(
                    f"request {request_id!r}: the received checksums differ from those "
                    f"{seen[1]} carries; the workers of one consumer receive the same",
                    name,
                )
    return {
        request_id: decode_wire(data, source=f"{name}: request {request_id!r}: received")
        for request_id, (data, name) in found.items()
    }


def verify_wire(
    source: Source,
    wires: Mapping[str, WireChecksums],
    ids: list[str] | None,
    runtime: Runtime,
    progress: Progress | None,
) -> DiffReport:
    """The source checked against the producer checksums its dumps carry (per request, as
    ``received_wires`` reads them)."""
    name = ", ".join(source.names)
    numbering = received_numbering(wires, name)
    counts = source.token_counts()
    # The consumer's checksums cover only the producer's tokens, as a diff's do.
    sent = {
        rid: min(int(wire.num_tokens), counts[rid]) for rid, wire in wires.items() if rid in counts
    }
    record = trim_to(source, sent).checksum(ids, numbering, runtime, progress)
    return verify_received(
        record,
        wires,
        source=name,
        request_ids=ids,
        consumer_tokens=counts,
        windows=group_windows(source),
    )
