"""Live caches: an agent an engine runs over its KV cache, answering kvaudit's
questions on a local unix socket (docs/live.md).

``Agent`` serves one worker (``agent``); ``protocol`` is the wire form (length-prefixed
JSON and bytes), ``server`` the socket thread, ``records_wire`` what the agent sends
about its cache, ``client`` the side the command line uses (``live:PATH`` sources).
"""

from .agent import Agent, BlockTables, socket_path
from .client import call, sockets_of

__all__ = ["Agent", "BlockTables", "call", "socket_path", "sockets_of"]
