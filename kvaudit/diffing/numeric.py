"""``diff --numeric``: a producer and a consumer compared by value over the tokens both hold,
from both sides' raw KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..compare.numeric import NumericReport
from ..errors import KvauditError
from ..numeric import numeric_diff
from ..sources import Progress, Source
from .sides import check_wanted, shared_tokens, unique_ids


def numeric_sources(
    producer: Source,
    consumer: Source,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    request_ids: Sequence[str] | None = None,
    progress: Progress | None = None,
) -> NumericReport:
    """The producer compared with the consumer by value over the tokens both hold
    (docs/numeric.md).

    Raises:
        KvauditError: A requested id on neither side, or a side that holds only checksums.

    """
    ids = unique_ids(request_ids)
    if ids is not None:
        check_wanted(producer, consumer, ids)
    shared = shared_tokens(producer, consumer, ids)
    raw = []
    for side in (producer, consumer):
        workers = side.raw_kv()
        if workers is None:
            raise KvauditError(
                f"--numeric needs the raw KV on both sides; {', '.join(side.names)} is a "
                f"{side.kind} that holds only checksums"
            )
        raw.append(workers)
    left, right = raw
    return numeric_diff(
        left, right, shared, atol=atol, rtol=rtol, request_ids=ids, progress=progress
    )
