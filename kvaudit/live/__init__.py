"""Live caches: an agent an engine runs over its KV cache, answering kvaudit's
questions on a local unix socket (docs/live.md).

``Agent`` serves one worker (``agent``); ``protocol`` is the wire form (length-prefixed
JSON and bytes), ``server`` the socket thread, ``messages`` what the agent sends
about its cache, ``client`` the side the command line uses (``live:PATH`` sources).
Names are imported on first use, so that the command line's client loads no torch.
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("Agent", "BlockTables", "socket_path"), ".agent"),
    **dict.fromkeys(("call", "sockets_of"), ".client"),
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
