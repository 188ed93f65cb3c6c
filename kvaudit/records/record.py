"""``Record``: one engine's checksums, summed over its workers, as ``kvaudit checksum
--format json`` writes them (``records.encoding``) and ``Record.from_json`` reads them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..core.errors import KvauditError
from ..core.validation import POSITION_NUMBERINGS, Positions, check_plain, worker_layout
from .model import RECORD_FORMAT, RequestChecksums, WorkerSummary


@dataclass
class Record:
    """One engine's checksums, summed over its workers.

    ``missing_workers`` lists the ``(pp_rank, tp_rank)`` of the engine's layout that the
    set lacks; ``complete`` is true when there are none.
    """

    positions: Positions
    workers: list[WorkerSummary]
    complete: bool
    requests: dict[str, RequestChecksums]
    missing_workers: list[tuple[int, int]] = field(default_factory=list)

    def partial_groups(self) -> list[tuple[str, int, str]]:
        """Each ``(request, group, why)`` whose sums miss a worker's part.

        Returns:
            The partial groups, requests in record order and groups in id order.

        """
        return [
            (request_id, gid, group.partial)
            for request_id, request in self.requests.items()
            for gid, group in sorted(request.groups.items())
            if group.partial is not None
        ]

    @classmethod
    def from_json(cls, data: Mapping, source: str) -> Record:
        """A record read back from its JSON form, validated strictly.

        Args:
            data: The parsed JSON, as ``records.encoding.record_to_json`` makes it.
            source: What names the record in errors (its file).

        Returns:
            The record.

        Raises:
            KvauditError: A wrong format tag, a missing or unknown key, a value of the
                wrong type, bad hex, rows of the wrong width, or totals that are not the
                sums of the replica-0 values; the message names the source and key path.

        Example:
            A record through its JSON form (``kvaudit checksum --format json``) and back:

            >>> import torch
            >>> from kvaudit import Checksummer, RequestBlocks, combine_workers
            >>> from kvaudit.description import parse_description
            >>> from kvaudit.formats import record_to_json
            >>> from kvaudit.records import Record
            >>> description = parse_description({"kvaudit": 1, "num_blocks": 2, "groups": [{
            ...     "spec": {"type": "full_attention", "block_size": 4, "num_kv_heads": 1,
            ...              "head_size": 8, "dtype": "float32", "layout": "NHTC"},
            ...     "layers": ["model.layers.0.attn"]}]}, "json")
            >>> summer = Checksummer(description, [torch.ones(2, 1, 4, 16)])
            >>> worker = summer.checksum({"a": RequestBlocks(5, {0: (0, [1, 0])})})
            >>> record = combine_workers([worker])
            >>> data = record_to_json(record)  # plain data: json.dumps writes it
            >>> back = Record.from_json(data, "a.json")
            >>> record_to_json(back) == data, list(back.requests)
            (True, ['a'])
            >>> data["requests"]["a"]["num_tokens"] = "five"
            >>> Record.from_json(data, "a.json")
            Traceback (most recent call last):
            ...
            kvaudit.core.errors.KvauditError: a.json: requests["a"].num_tokens: expected ...

        """
        # Imported here: a checksum writes records, only a few commands read them back.
        from .reading import RecordReader, item_path, request_from_json, worker_from_json

        check_plain(data, source)
        reader = RecordReader(source)
        reader.keys(
            data, "", ("format", "positions", "workers", "complete", "requests"), ("processes",)
        )
        if "processes" in data:  # how many processes computed it (kvaudit under torchrun)
            reader.integer(data["processes"], "processes", 1)
        if data["format"] != RECORD_FORMAT:
            reader.fail("format", f"expected {RECORD_FORMAT!r}, {reader.got(data['format'])}")
        positions = data["positions"]
        if positions not in POSITION_NUMBERINGS:
            reader.fail(
                "positions", f"expected one of {POSITION_NUMBERINGS}, {reader.got(positions)}"
            )
        workers_data = reader.array(data["workers"], "workers")
        if not workers_data:
            reader.fail("workers", "expected at least one worker")
        workers = [
            worker_from_json(reader, item, f"workers[{index}]")
            for index, item in enumerate(workers_data)
        ]
        try:
            missing = worker_layout([summary.worker for summary in workers])
        except KvauditError as error:
            reader.fail("workers", str(error))
        complete = data["complete"]
        if not isinstance(complete, bool):
            reader.fail("complete", f"expected true or false, {reader.got(complete)}")
        if complete and missing:
            reader.fail("complete", f"is true but workers (pp_rank, tp_rank) {missing} are missing")
        if not complete and not missing:
            reader.fail("complete", "is false but no worker is missing")
        requests_data = reader.obj(data["requests"], "requests")
        requests = {
            request_id: request_from_json(reader, item, item_path("requests", request_id))
            for request_id, item in requests_data.items()
        }
        return cls(positions, workers, complete, requests, missing)
