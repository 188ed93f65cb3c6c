"""The live agent's wire protocol: length-prefixed frames of plain JSON and bytes.

A frame is a 12-byte header (the JSON's length as a big-endian uint32, the payload's
as a big-endian uint64), the JSON text (UTF-8, an object) and the payload bytes. A
client sends one request frame on a fresh connection; the agent answers with one reply
frame and closes it. Nothing received is ever unpickled or executed: JSON is parsed
strictly (``kvaudit.core.validation.load_json``) and every size is bounded before reading.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from typing import Any

from ..core.errors import KvauditError
from ..core.validation import MAX_TOKENS, check_int, load_json, short

PROTOCOL = 1
"""The protocol version an agent states in its ``hello`` reply."""
HEADER = struct.Struct(">IQ")
MAX_REQUEST_JSON = 1 << 20
"""The largest request an agent reads (1 MiB of JSON, no payload)."""
MAX_REPLY_JSON = 256 << 20
"""The largest reply JSON a client reads (a listing or record of many requests)."""
MAX_PAYLOAD = 4 << 30
"""The largest payload a client reads (raw blocks of one fetch)."""
MAX_IDS = 8192
"""The most request ids one request names (a client asks about more in batches): it
bounds what one request costs the engine."""
OPS = ("hello", "list", "checksum", "dump", "fetch")
_ID = re.compile(r"[^\x00-\x1f]{1,1024}")


def encode_frame(message: Mapping[str, Any], payload: bytes = b"") -> bytes:
    """One frame: header, compact JSON of ``message``, then ``payload``."""
    return encode_header(message, len(payload)) + payload


def encode_header(message: Mapping[str, Any], payload_size: int) -> bytes:
    """A frame's header and compact JSON of ``message``, for a payload of ``payload_size``
    bytes sent after them."""
    text = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return HEADER.pack(len(text), payload_size) + text


def frame_sizes(header: bytes, max_json: int, max_payload: int, source: str) -> tuple[int, int]:
    """The JSON and payload lengths a frame header states, each checked against its bound.

    Raises:
        KvauditError: A length over its bound, or an empty JSON part.

    """
    size, payload = HEADER.unpack(header)
    if not 2 <= size <= max_json:
        raise KvauditError(f"frame of {size} bytes of JSON (at most {max_json})", source)
    if payload > max_payload:
        raise KvauditError(
            f"frame with a payload of {payload} bytes (at most {max_payload})", source
        )
    return size, payload


def decode_json(text: bytes, source: str) -> dict[str, Any]:
    """A frame's JSON part as an object, parsed strictly.

    Raises:
        KvauditError: Not UTF-8, not JSON, nested too deeply, or not an object.

    """
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError:
        raise KvauditError("frame: JSON that is not UTF-8", source) from None
    data = load_json(decoded, source, "frame")
    if not isinstance(data, dict):
        raise KvauditError(f"frame: expected a JSON object, got {short(data)}", source)
    return data


def request_id_list(value: object, source: str, what: str = "requests") -> list[str] | None:
    """A request's list of request ids (None: all), each a plain non-empty string.

    Raises:
        KvauditError: Not a list of strings, too many, or an id with control characters.

    """
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_IDS:
        raise KvauditError(f"{what}: expected a list of at most {MAX_IDS} request ids", source)
    for item in value:
        if not isinstance(item, str) or not _ID.fullmatch(item):
            raise KvauditError(f"{what}: bad request id {short(item)}", source)
    return list(dict.fromkeys(value))


def token_limits(value: object, source: str) -> dict[str, int]:
    """A request's ``num_tokens``: request id to the most tokens to cover.

    Raises:
        KvauditError: Not an object of request ids to token counts.

    """
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_IDS:
        raise KvauditError("num_tokens: expected an object of request ids to counts", source)
    request_id_list(list(value), source, "num_tokens")
    return {
        rid: check_int(count, source, f"num_tokens.{short(rid)}", 0, MAX_TOKENS)
        for rid, count in value.items()
    }
