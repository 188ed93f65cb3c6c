"""A dump's ``kvaudit.requests`` read strictly: each request's token count, its groups'
start positions and block ids (held by the dump), block hashes and received wire bytes."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping

from ..core.validation import MAX_TOKENS, check_positions, fail, is_int, load_json, short
from ..description import CacheDescription
from .block_ids import check_group_blocks, group_key
from .dump import META_REQUESTS, DumpRequest

_REQUEST_KEYS = ("num_tokens", "groups", "block_hashes", "received")


def parse_requests(
    metadata: Mapping[str, str],
    description: CacheDescription,
    holds: Mapping[int, Callable[[int], bool]],
    source: str,
) -> dict[str, DumpRequest]:
    """Read ``kvaudit.requests``: each request's tokens, group entries, hashes and wire bytes.

    Args:
        metadata: The dump's metadata.
        description: The cache description the dump is read under.
        holds: Per group id, whether the dump holds a block id.
        source: The dump, in errors.

    Returns:
        The requests by id.

    """
    if META_REQUESTS not in metadata:
        fail(source, f"no {META_REQUESTS} in the metadata")
    data = load_json(metadata[META_REQUESTS], source, META_REQUESTS)
    if not isinstance(data, dict):
        fail(source, f"{META_REQUESTS}: expected a JSON object, got {short(data)}")
    group_ids = {group.id for group in description.groups}
    requests = {}
    for request_id, item in data.items():
        where = f"{META_REQUESTS}: request {request_id!r}"
        if not isinstance(item, dict):
            fail(source, f"{where}: expected a JSON object, got {short(item)}")
        for key in item:
            if key not in _REQUEST_KEYS:
                fail(source, f"{where}: unknown key {key!r}; expected {', '.join(_REQUEST_KEYS)}")
        for key in ("num_tokens", "groups"):
            if key not in item:
                fail(source, f"{where}: no {key}")
        num_tokens = item["num_tokens"]
        if not is_int(num_tokens) or not 0 <= num_tokens <= MAX_TOKENS:
            fail(
                source,
                f"{where}: num_tokens must be an integer from 0 to {MAX_TOKENS}, got "
                f"{short(num_tokens)}",
            )
        groups_data = item["groups"]
        if not isinstance(groups_data, dict):
            fail(source, f"{where}: groups: expected a JSON object, got {short(groups_data)}")
        groups: dict[int, tuple[int, list[int]]] = {}
        for key, entry in groups_data.items():
            group_id = group_key(source, f"{where} groups", key, group_ids)
            group_where = f"{where} group {group_id}"
            if not isinstance(entry, list) or len(entry) != 2:
                fail(source, f"{group_where}: expected [start, [block ids]], got {short(entry)}")
            check_group_blocks(
                source, group_where, entry[0], entry[1], holds[group_id], "is not held by the dump"
            )
            block_size = description.group(group_id).block_size
            check_positions(
                source, group_where, int(num_tokens), block_size, int(entry[0]), len(entry[1])
            )
            groups[group_id] = (int(entry[0]), [int(block_id) for block_id in entry[1]])
        hashes = _parse_hashes(source, where, item.get("block_hashes", {}), groups, group_ids)
        received = item.get("received")
        if received is not None:
            if not isinstance(received, str):
                fail(source, f"{where}: received: expected base64 text, got {short(received)}")
            try:
                received = base64.b64decode(received, validate=True)
            except (binascii.Error, ValueError):
                fail(source, f"{where}: received: not valid base64")
        requests[request_id] = DumpRequest(int(num_tokens), groups, hashes, received)
    return requests


def _parse_hashes(
    source: str,
    where: str,
    data: object,
    groups: Mapping[int, tuple[int, list[int]]],
    group_ids: set[int],
) -> dict[int, list[bytes]]:
    if not isinstance(data, dict):
        fail(source, f"{where}: block_hashes: expected a JSON object, got {short(data)}")
    hashes: dict[int, list[bytes]] = {}
    for key, items in data.items():
        group_id = group_key(source, f"{where} block_hashes", key, group_ids)
        hash_where = f"{where} block_hashes {group_id}"
        listed = len(groups[group_id][1]) if group_id in groups else 0
        if not isinstance(items, list) or len(items) > listed:
            fail(
                source,
                f"{hash_where}: expected a list of at most {listed} hex hashes, one per "
                "listed block",
            )
        values = []
        for item in items:
            try:
                if not isinstance(item, str) or not item:
                    raise ValueError
                values.append(bytes.fromhex(item))
            except ValueError:
                fail(source, f"{hash_where}: {short(item)} is not a hex hash")
        hashes[group_id] = values
    return hashes
