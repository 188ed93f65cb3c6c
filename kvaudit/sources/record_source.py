"""Records as sources: the JSON ``kvaudit checksum --format json`` writes, read back.

A record holds checksums only: it can be compared and inspected, not checksummed again
over fewer tokens nor located in. It is a ``.json`` file or any file whose content starts
with ``{``, and stands alone among a command's SOURCE arguments.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..core.errors import KvauditError
from ..core.files import check_input
from ..core.validation import MAX_DEPTH, DuplicateKeyError, short, short_text, unique_keys
from ..description import CacheDescription
from ..records import Record, WorkerInfo
from ..workers.inventory import GroupInfo, Inventory, RequestInventory, WorkerInventory, add_request
from .base import RecordQuery, Source
from .registry import OpenOptions
from .sniffing import DESCRIPTION_HINT, is_description_data, looks_like_description


class RecordSource(Source):
    """A record saved by ``kvaudit checksum --format json``."""

    kind = "record"

    def __init__(self, name: str, record: Record) -> None:
        super().__init__([name])
        self.record = record

    @property
    def request_ids(self) -> list[str]:
        return list(self.record.requests)

    @property
    def positions(self) -> str:
        return self.record.positions

    def token_counts(self) -> dict[str, int]:
        return {rid: request.num_tokens for rid, request in self.record.requests.items()}

    def inventory(self) -> Inventory:
        block_sizes: dict[int, int] = {}
        requests: dict[str, RequestInventory] = {}
        for request_id, request in self.record.requests.items():
            held = {}
            for gid, group in request.groups.items():
                block_sizes.setdefault(gid, group.block_size)
                held[gid] = (group.start, range(group.count))
            add_request(requests, request_id, request.num_tokens, held)
        workers = []
        for summary in self.record.workers:
            gids = sorted(set(summary.fingerprints) | set(summary.not_covered))
            groups = [
                GroupInfo(
                    id=gid,
                    fingerprint=summary.fingerprints.get(gid, 0),
                    covered=gid not in summary.not_covered,
                    reason=summary.not_covered.get(gid),
                    block_size=block_sizes.get(gid),
                    scales=tuple(
                        (name, fact.k_scale, fact.v_scale)
                        for name, fact in summary.layers.items()
                        if fact.group == gid
                        and (fact.k_scale is not None or fact.v_scale is not None)
                    ),
                )
                for gid in gids
            ]
            workers.append(WorkerInventory(summary.worker, None, groups))
        return Inventory(
            self.kind,
            self.names,
            workers,
            self.record.complete,
            list(self.record.missing_workers),
            requests,
        )

    def _stated_worker(self) -> WorkerInfo | None:
        return self.record.workers[0].worker if self.record.workers else None

    def checksum(self, query: RecordQuery) -> Record:
        record, positions, request_ids = self.record, query.positions, query.request_ids
        if positions is not None and positions != record.positions:
            raise KvauditError(
                f"the record numbers positions by {record.positions}, not {positions}; "
                "checksum the dumps again to renumber them",
                self.names[0],
            )
        if request_ids is None:
            return record
        return Record(
            record.positions,
            record.workers,
            record.complete,
            {request_id: record.requests[request_id] for request_id in request_ids},
            list(record.missing_workers),
        )


def load_record(path: str) -> Record:
    """Read a record JSON file.

    Raises:
        KvauditError: The file is missing, not JSON, or not a record; the message names it.

    """
    check_input(path)  # a FIFO or a device would block or never end
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvauditError("no such file", path) from None
    except UnicodeDecodeError:
        raise KvauditError("not a UTF-8 text file, expected a record (JSON)", path) from None
    except OSError as error:
        raise KvauditError(f"cannot read: {error.strerror}", path) from None
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKeyError as error:
        raise KvauditError(f"key {short(error.key)} appears twice in one object", path) from None
    except json.JSONDecodeError as error:
        if looks_like_description(path):
            raise KvauditError(DESCRIPTION_HINT, path) from None
        raise KvauditError(
            f"line {error.lineno}: not valid JSON ({error.msg}), expected a record", path
        ) from None
    except RecursionError:
        raise KvauditError(f"nested more than {MAX_DEPTH} levels deep", path) from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise KvauditError(f"not valid JSON ({short_text(str(error))})", path) from None
    if is_description_data(data):
        raise KvauditError(DESCRIPTION_HINT, path)
    return Record.from_json(data, path)


def open_records(
    names: Sequence[str], records: Sequence[str], options: OpenOptions
) -> RecordSource:
    """The record kind's opener: one record, standing alone."""
    if len(names) != 1:
        raise KvauditError(
            f"{records[0]}: a record stands alone; give one record, or dumps without records"
        )
    return RecordSource(records[0], load_record(records[0]))


def record_as_source(record: Record, config: CacheDescription | None, label: str) -> RecordSource:
    """A ``Record`` object as a source named ``label``."""
    return RecordSource(label, record)
