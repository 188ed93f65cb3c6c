"""What the agent sends about its cache, as plain JSON: the requests' block tables, its
groups for ``inspect``, and a worker's checksums in the record format
(``kvaudit checksum --format json``, one worker) so that the client reads them with the
record's strict reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.scheme import to_hex
from ..core.validation import worker_layout
from ..records import RECORD_FORMAT, WorkerRecord
from ..views import GroupViews, LayerTensor
from ..views.inputs import RequestBlocks


def listing_to_json(requests: Mapping[str, RequestBlocks]) -> dict[str, Any]:
    """Request id to ``{"num_tokens": n, "groups": {"gid": [start, [block ids]]}}``."""
    return {
        rid: {
            "num_tokens": int(request.num_tokens),
            "groups": {
                str(gid): [int(start), [int(b) for b in block_ids]]
                for gid, (start, block_ids) in sorted(request.groups.items())
            },
        }
        for rid, request in requests.items()
    }


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
        "requests": {
            rid: {
                "num_tokens": int(request.num_tokens),
                "groups": {
                    str(gid): {
                        "block_size": int(group.block_size),
                        "start": int(group.start),
                        "fingerprint": to_hex(group.fingerprint),
                        "replica_keys": [[int(n), int(i)] for n, i in group.replica_keys],
                        "values": [[to_hex(v) for v in row] for row in group.values.tolist()],
                        "totals": [to_hex(v) for v in group.totals().tolist()],
                    }
                    for gid, group in sorted(request.groups.items())
                },
            }
            for rid, request in record.requests.items()
        },
    }
