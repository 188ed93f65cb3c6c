"""The ``inspect`` tables: what a source holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from ..core.scheme import to_hex
from .text import (
    SafeTable,
    completeness,
    filled_table,
    human_bytes,
    layout_line,
    print_missing,
    ranges,
    worker_name,
)

if TYPE_CHECKING:
    from ..workers import Inventory


def print_inventory(console: Console, inventory: Inventory) -> None:
    """Print the ``inspect`` tables: workers, groups per worker, requests.

    Args:
        console: Where the tables are printed.
        inventory: The inventory drawn.

    """
    workers = [item.worker for item in inventory.workers]
    label = f"{inventory.kind}:"
    # A live source is named as given (live:PATH): its label is not repeated.
    names = [name.removeprefix(label) for name in inventory.sources]
    console.print(
        Text.assemble(
            (f"{label} ", "bold"),
            " ".join(names),
            f" ({layout_line(workers)}, ",
            completeness(inventory.complete),
            ")",
        )
    )
    if not inventory.complete:
        print_missing(console, inventory.missing_workers, "checksums of this set are partial")

    rows: list[list[str | Text]] = []
    for item in inventory.workers:
        worker = item.worker
        rows.append(
            [
                worker_name(worker),
                f"{worker.tp_rank}/{worker.tp_size}",
                f"{worker.pp_rank}/{worker.pp_size}",
                worker.role,
                worker.engine,
                "" if item.rows is None else str(item.rows),
            ]
        )
    console.print(filled_table("Workers", ("source", "tp", "pp", "role", "engine", ">rows"), rows))

    rows = []
    for item in inventory.workers:
        for group in item.groups:
            block = ""
            if group.block_size is not None:
                block = str(group.block_size)
                if group.kernel_block_size not in (None, group.block_size):
                    block += f" ({group.kernel_block_size})"
            rows.append(
                [
                    worker_name(item.worker),
                    str(group.id),
                    group.type or "",
                    block,
                    group.layout or "",
                    "" if group.layers is None else str(group.layers),
                    "" if group.bytes is None else human_bytes(group.bytes),
                    to_hex(group.fingerprint),
                    Text("yes", style="green")
                    if group.covered
                    else Text(f"no: {group.reason}", style="yellow"),
                ]
            )
    columns = ("worker", ">group", "type", "block", "layout", ">layers", ">bytes")
    console.print(filled_table("Groups", (*columns, "fingerprint", "covered"), rows))
    scale_rows = _scale_rows(inventory)
    if scale_rows:
        columns = ("worker", ">group", ">k_scale", ">v_scale", "layers")
        console.print(filled_table("Scales (quantized KV)", columns, scale_rows))

    group_ids = sorted({gid for req in inventory.requests.values() for gid in req.positions})
    table = SafeTable(title="Requests", title_justify="left")
    table.add_column("request")
    table.add_column("tokens", justify="right")
    for gid in group_ids:
        table.add_column(f"group {gid} blocks")
    for request_id, request in inventory.requests.items():
        cells = []
        for gid in group_ids:
            held = request.positions.get(gid)
            cells.append(f"{len(held)} ({ranges(held)})" if held else "-")
        table.add_row(request_id, str(request.num_tokens), *cells)
    console.print(table)


def _scale_text(scale: float | None) -> str:
    return "-" if scale is None else repr(float(scale))


def _scale_rows(inventory: Inventory) -> list[list[str | Text]]:
    """The ``Scales`` table's rows: per worker and group, one row per pair of K and V
    scales, with the layers that have it (``all N layers`` where every layer of the group
    has the same)."""
    rows: list[list[str | Text]] = []
    for item in inventory.workers:
        for group in item.groups:
            pairs: dict[tuple[float | None, float | None], list[str]] = {}
            for name, k_scale, v_scale in group.scales:
                pairs.setdefault((k_scale, v_scale), []).append(str(name))
            for (k_scale, v_scale), names in pairs.items():
                if len(pairs) == 1 and len(names) == group.layers:
                    layers = f"all {len(names)} layers"
                else:
                    layers = ", ".join(names)
                rows.append(
                    [
                        worker_name(item.worker),
                        str(group.id),
                        _scale_text(k_scale),
                        _scale_text(v_scale),
                        layers,
                    ]
                )
    return rows
