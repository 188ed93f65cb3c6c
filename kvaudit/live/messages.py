"""What the agent sends about its cache, as plain JSON: the requests' block tables, its
groups for ``inspect``; a worker's checksums go in the record format
(``kvaudit checksum --format json``, one worker), written by the record's one encoder
(``kvaudit.records.encoding``) so that the client reads them with the record's strict
reader.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..core.scheme import to_hex
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
