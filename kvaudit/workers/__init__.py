"""A worker's raw KV as every reader sees it: the protocols dumps, live tensors and
engines' agents share (``RawWorker``, ``FetchingWorker``, ``Listing``), a request's rows
(``request_rows``), a checksum's ``Progress`` and what a source holds (``Inventory``).

Modules: ``protocol`` (the protocols, ``request_rows``, ``Progress``), ``inventory`` (what
``kvaudit inspect`` shows, and its builders). The package imports only ``core``,
``description``, ``views`` and ``records``: ``checksum``, ``sources`` and the comparisons
above them share its types.
"""

from __future__ import annotations

from ..core.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ("FetchingWorker", "Listing", "Progress", "RawWorker", "fetched", "fetches"), ".protocol"
    ),
    "request_rows": ".protocol",
    **dict.fromkeys(
        ("GroupInfo", "Inventory", "RequestInventory", "WorkerInventory"), ".inventory"
    ),
}

__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
