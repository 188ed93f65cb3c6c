"""What the agent sends about its cache, as plain JSON: the requests' block tables, its
groups for ``inspect``, and a worker's checksums in the record format
(``kvaudit checksum --format json``, one worker) so that the client reads them with the
record's strict reader.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.scheme import to_hex
from ..core.validation import worker_layout
from ..records import RECORD_FORMAT, GroupChecksums, RequestChecksums, WorkerRecord
from ..views import GroupViews, LayerTensor
from ..views.inputs import RequestBlocks


def listing_to_json(requests: Mapping[str, RequestBlocks]) -> dict[str, Any]:
    """Request id to ``{"num_tokens": n, "groups": {"gid": [start, [block ids]]}}``."""
    return {rid: listing_entry(request) for rid, request in requests.items()}


def listing_entry(request: RequestBlocks) -> dict[str, Any]:
    """One request of a listing: ``{"num_tokens": n, "groups": {"gid": [start, [ids]]}}``
    (block ids as Python ints: ``plain_requests`` made them so)."""
    return {
        "num_tokens": int(request.num_tokens),
        "groups": {
            str(gid): [int(start), [int(b) for b in block_ids]]
            for gid, (start, block_ids) in sorted(request.groups.items())
        },
    }


def json_member(key: str, value: object) -> bytes:
    """``"key":value`` as compact JSON, a member of an object assembled piece by piece."""
    return json.dumps({key: value}, separators=(",", ":"), allow_nan=False)[1:-1].encode()


def object_with_members(
    head: Mapping[str, Any], key: str, members: list[bytes], depth: int = 1
) -> list[bytes]:
    """Compact JSON of ``head`` whose last object ``depth`` levels in (``head`` itself at
    1, its last member's value at 2) gains a last member ``key``: an object of
    ``members`` (``"id":value`` each, from ``json_member``), in pieces that are joined
    once, where they are sent, and never parsed again.

    Args:
        head: The reply's other members (the object at each level below it non-empty).
        key: The name of the member added.
        members: The added object's members.
        depth: How deep the object that gains ``key`` lies.

    Returns:
        The pieces of the whole object's UTF-8 JSON text, in order.

    """
    text = json.dumps(head, separators=(",", ":"), allow_nan=False).encode()
    pieces = [text[:-depth], b",", json_member(key, {})[:-1]]
    for number, member in enumerate(members):
        if number:
            pieces.append(b",")
        pieces.append(member)
    pieces.append(b"}" * (depth + 1))
    return pieces


def hex_rows(values: np.ndarray) -> list[list[str]]:
    """Each row of a 2-D array of uint64 as 16 lowercase hex digits per value, as
    ``to_hex`` writes one (all at once: a request's values, without a call per value)."""
    rows, width = values.shape
    if not width:
        return [[] for _ in range(rows)]
    digits = np.ascontiguousarray(values, dtype=">u8").tobytes().hex()
    words = [digits[i : i + 16] for i in range(0, len(digits), 16)]
    return [words[i : i + width] for i in range(0, len(words), width)]


def group_infos(
    groups: Mapping[int, GroupViews], tensors: Mapping[str, LayerTensor]
) -> list[dict[str, Any]]:
    """Each group's spec, coverage, fingerprint and bytes of the tensors it owns."""
    result = []
    for views in groups.values():
        group = views.group
        spec = group.spec
        owned = [layer.name for layer in group.layers if layer.shares is None]
        size = 0
        for name in owned:
            tensor = tensors.get(name)
            parts = tensor if isinstance(tensor, tuple) else () if tensor is None else (tensor,)
            size += sum(part.numel() * part.element_size() for part in parts)
        result.append(
            {
                "id": group.id,
                "fingerprint": to_hex(views.fingerprint),
                "covered": views.covered,
                "reason": views.reason,
                "type": spec.type,
                "block_size": spec.block_size,
                "kernel_block_size": spec.kernel_block_size,
                "layout": "state" if spec.is_state else spec.layout,
                "layers": len(group.layers),
                "bytes": size,
            }
        )
    return result


def worker_record_to_json(record: WorkerRecord) -> dict[str, Any]:
    """One worker's checksums as a record of that worker alone."""
    return {
        **worker_record_head(record),
        "requests": {
            rid: request_checksums_to_json(request) for rid, request in record.requests.items()
        },
    }


def worker_record_head(record: WorkerRecord) -> dict[str, Any]:
    """A worker record's JSON without its ``requests`` (which come last)."""
    worker = record.worker
    return {
        "format": RECORD_FORMAT,
        "positions": record.positions,
        "workers": [
            {
                "source": worker.source,
                "tp_rank": worker.tp_rank,
                "tp_size": worker.tp_size,
                "pp_rank": worker.pp_rank,
                "pp_size": worker.pp_size,
                "role": worker.role,
                "fingerprints": {
                    str(gid): to_hex(fp) for gid, fp in sorted(record.fingerprints.items())
                },
                "not_covered": {
                    str(gid): reason for gid, reason in sorted(record.not_covered.items())
                },
            }
        ],
        "complete": not worker_layout([worker]),
    }


def request_checksums_to_json(request: RequestChecksums) -> dict[str, Any]:
    """One request of a worker record: its token count and each group's checksums."""
    return {
        "num_tokens": int(request.num_tokens),
        "groups": {str(gid): _group_json(group) for gid, group in sorted(request.groups.items())},
    }


def _group_json(group: GroupChecksums) -> dict[str, Any]:
    """One group of a worker record's request, the strong lane where it carries it."""
    entry: dict[str, Any] = {
        "block_size": int(group.block_size),
        "start": int(group.start),
        "fingerprint": to_hex(group.fingerprint),
        "replica_keys": [[int(n), int(i)] for n, i in group.replica_keys],
        "values": hex_rows(group.values),
        "totals": [row[0] for row in hex_rows(group.totals()[:, None])],
    }
    strong_totals = group.strong_totals()
    if group.strong is not None and strong_totals is not None:
        entry["strong"] = hex_rows(group.strong)
        entry["strong_totals"] = [row[0] for row in hex_rows(strong_totals[:, None])]
    return entry
