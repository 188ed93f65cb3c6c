"""Hints in a dump's errors for a description that belongs to the other engine (which
inputs a file looks like instead, a description or a record, is
``kvaudit.sources.sniffing``'s to say).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.validation import Role


def own_description_option(role: str) -> str:
    """The option that gives one side of a command its own cache description."""
    if role in ("producer", "consumer"):
        return f"--{role}-config with diff, -c otherwise"
    return "-c"


def other_engine_hint(role: Role, num_blocks: int) -> str:
    """What to do when a description's ``num_blocks`` does not fit a dump: it is probably
    the other engine's; name this dump's side and the option that takes its own."""
    option = own_description_option(role)
    return (
        f"the cache description given ({num_blocks} blocks) does not fit this {role}'s dump, "
        f"it may be the other engine's: give the {role}'s own description ({option})"
    )
