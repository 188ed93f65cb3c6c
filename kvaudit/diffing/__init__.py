"""The dump-level driver of ``kvaudit diff`` and ``kvaudit verify``: sources in, a
``DiffReport`` out.

``diff_sources`` checksums a producer and a consumer (dump sets, records or live
workers) request by request over the tokens both hold, compares the checksums
(``kvaudit.compare``) and, where both sides hold the raw KV, narrows every differing block
down to layers, heads, tokens and bytes (``kvaudit.locate``). ``verify_sources`` checks one
source against a saved record, against the producer checksums its dumps received, or
against the stored checksums of its offloaded blocks.

Modules, each using only those above it: ``sides`` (requested ids, the tokens both sides
hold, a side trimmed and checksummed), ``diff`` (``diff_sources``: comparing, locating,
tracing), ``received`` and ``stored`` (the checksums dumps carry, checked), ``verify``
(``verify_sources``: one of three ways). The comparison by value is ``kvaudit.numeric``.
"""

from .diff import diff_sources, diff_work, locate_report
from .received import carried_wires, received_wires, verify_wire
from .sides import shared_tokens
from .stored import stored_checks, verify_stored
from .verify import verify_sources, verify_work

__all__ = [
    "carried_wires",
    "diff_sources",
    "diff_work",
    "locate_report",
    "received_wires",
    "shared_tokens",
    "stored_checks",
    "verify_sources",
    "verify_stored",
    "verify_wire",
    "verify_work",
]
