"""Live caches: an agent an engine runs over its KV cache, answering kvaudit's
questions on a local unix socket (docs/live.md).

``Agent`` serves one worker (``agent``); ``protocol`` is the wire form (length-prefixed
JSON and bytes), ``server`` the socket thread, ``messages`` what the agent sends
about its cache, ``client`` the side the command line uses (``live:PATH`` sources).
Names are imported on first use, so that the command line's client loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.lazy import lazy_exports

if TYPE_CHECKING:
    from .agent import Agent, BlockTables, socket_path
    from .client import call, sockets_of

_EXPORTS = {
    "Agent": ".agent",
    "BlockTables": ".agent",
    "socket_path": ".agent",
    "call": ".client",
    "sockets_of": ".client",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["Agent", "BlockTables", "call", "socket_path", "sockets_of"]
