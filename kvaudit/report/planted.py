"""What ``corrupt`` planted, for people."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ..core.ranges import ranges
from ..corrupt.result import PlantedFault, SwappedTokens
from .text import plural


def print_corrupted(console: Console, fault: PlantedFault) -> None:
    """Print what ``corrupt`` planted: where, which layers, heads and tokens, which bytes.

    Args:
        console: Where the lines are printed.
        fault: The fault ``corrupt_dump`` planted.

    """
    console.print(
        Text.assemble(
            ("planted ", "bold"),
            (fault.mode, "bold red"),
            f" in {fault.out} (a copy of {fault.source})",
        )
    )
    lines = [
        f"request {fault.request}, group {fault.group}, position {fault.position} "
        f"(engine block {fault.block}, dump row {fault.row}, "
        f"request of {fault.num_tokens} tokens)",
        "layers: " + ", ".join(fault.layers),
        f"heads: {ranges(fault.heads)}",
        f"tokens: {ranges(fault.tokens)}",
    ]
    origin = fault.origin
    if origin is not None:
        if origin.request is not None:
            lines.append(
                f"from: request {origin.request} position {origin.position} "
                f"(engine block {origin.block}, dump row {origin.row})"
            )
        else:
            lines.append(f"from: engine block {origin.block} (dump row {origin.row})")
    flip = fault.flip
    if flip is not None:
        lines.append(
            f"flipped: bit {flip.bit} of byte {flip.byte} of the cell of "
            f"{flip.layer} head {flip.head} token {flip.token}"
        )
    swap = fault.swap
    if isinstance(swap, SwappedTokens):
        first, second = swap.tokens
        lines.append(f"swapped: tokens {first} and {second} of {swap.layer}")
    elif swap is not None:
        first, second = swap.heads
        lines.append(f"swapped: heads {first} and {second} of {swap.layer}")
    changed = sum(end - start for start, end in fault.byte_ranges)
    lines.append(
        f"bytes changed: {changed} in {plural(len(fault.byte_ranges), 'range')} of the file"
    )
    for line in lines:
        console.print("  " + line)
