"""The connector's settings: the ``"kvaudit"`` mapping of ``kv_connector_extra_config``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core.errors import KvauditError

POLICIES = ("log", "fail")
_KEYS = (
    "output",
    "policy",
    "max_dump_bytes",
    "dump_sample_rate",
    "rotate_dumps",
    "layer_sums",
    "positions",
    "backend",
    "engine",
    "live_socket",
)
WHERE = "kv_connector_extra_config.kvaudit"


@dataclass(frozen=True)
class AuditConfig:
    """What the connector audits and where it writes.

    ``output``: the folder records, descriptions and dumps go to (None: nothing written);
    ``policy``: ``log`` or ``fail`` (mismatching blocks reported as load errors);
    ``max_dump_bytes``: at most this many bytes of dumps per worker;
    ``dump_sample_rate``: the fraction of audited requests whose blocks are dumped;
    ``rotate_dumps``: a producer dumps every request it sends and keeps the latest within
    ``max_dump_bytes`` (the oldest removed), so a consumer's failed check finds the
    producer's side still on disk;
    ``layer_sums``: each checksum line also holds every block's total split per layer and
    K or V plane, so that ``kvaudit diff`` of two output folders names the differing layer
    without a dump (docs/checksum.md, "Layer sums");
    ``positions``: ``request`` or ``block`` numbering; ``backend``: the checksum backend;
    ``engine``: a label for this engine in records (default: its KV role and engine id);
    ``live_socket``: a folder where each worker serves a live agent on
    ``ppP-tpT.sock`` (docs/live.md; None: no agent).
    """

    output: str | None = None
    policy: str = "log"
    max_dump_bytes: int = 0
    dump_sample_rate: float = 0.0
    rotate_dumps: bool = False
    layer_sums: bool = True
    positions: str = "request"
    backend: str = "auto"
    engine: str = ""
    live_socket: str | None = None


def parse_config(raw: object) -> AuditConfig:
    """The settings in ``raw`` (a mapping, or None for the defaults).

    Raises:
        KvauditError: An unknown key or a value of the wrong kind, in one line.

    """
    if raw is None:
        return AuditConfig()
    if not isinstance(raw, Mapping):
        raise KvauditError(f"expected a mapping, got {type(raw).__name__}", WHERE)
    unknown = sorted(str(key) for key in raw if key not in _KEYS)
    if unknown:
        raise KvauditError(f"unknown key {unknown[0]!r}, expected one of {', '.join(_KEYS)}", WHERE)
    values: dict[str, Any] = dict(raw)
    output = values.get("output")
    if output is not None and (not isinstance(output, str) or not output):
        raise KvauditError(f"output: expected a folder path, got {output!r}", WHERE)
    _choice(values, "policy", POLICIES)
    _choice(values, "positions", ("request", "block"))
    _choice(values, "backend", ("auto", "torch", "triton"))
    size = values.get("max_dump_bytes", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise KvauditError(f"max_dump_bytes: expected a non-negative integer, got {size!r}", WHERE)
    rate = values.get("dump_sample_rate", 0.0)
    if (
        isinstance(rate, bool)
        or not isinstance(rate, (int, float))
        or not math.isfinite(rate)
        or not 0 <= rate <= 1
    ):
        raise KvauditError(f"dump_sample_rate: expected a number from 0 to 1, got {rate!r}", WHERE)
    rotate = values.get("rotate_dumps", False)
    if not isinstance(rotate, bool):
        raise KvauditError(f"rotate_dumps: expected true or false, got {rotate!r}", WHERE)
    layer_sums = values.get("layer_sums", True)
    if not isinstance(layer_sums, bool):
        raise KvauditError(f"layer_sums: expected true or false, got {layer_sums!r}", WHERE)
    engine = values.get("engine", "")
    if not isinstance(engine, str):
        raise KvauditError(f"engine: expected text, got {engine!r}", WHERE)
    live_socket = values.get("live_socket")
    if live_socket is not None and (not isinstance(live_socket, str) or not live_socket):
        raise KvauditError(f"live_socket: expected a folder path, got {live_socket!r}", WHERE)
    return AuditConfig(
        output=output,
        policy=values.get("policy", "log"),
        max_dump_bytes=size,
        dump_sample_rate=float(rate),
        rotate_dumps=rotate,
        layer_sums=layer_sums,
        positions=values.get("positions", "request"),
        backend=values.get("backend", "auto"),
        engine=engine,
        live_socket=live_socket,
    )


def _choice(values: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> None:
    value = values.get(key, choices[0])
    if value not in choices:
        raise KvauditError(f"{key}: expected one of {', '.join(choices)}, got {value!r}", WHERE)
