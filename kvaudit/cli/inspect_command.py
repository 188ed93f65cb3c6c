"""``kvaudit inspect``: what a dump set (or record, or live engine) holds."""

from __future__ import annotations

import functools
from typing import get_args

import click

from ..core.exit_status import ExitStatus
from .arguments import load_config, open_sources
from .group import main
from .options import EXIT_HELP, InventoryFormat, common_options, format_option
from .output import emit, emit_table, stamp, warn


@main.command(epilog=EXIT_HELP)
@click.argument("sources", metavar="SOURCE...", nargs=-1, required=True)
@format_option(get_args(InventoryFormat), "Output format.")
@common_options
def inspect(
    sources: tuple[str, ...],
    output_format: InventoryFormat,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Show what a dump set holds: workers, groups, coverage, fingerprints, requests."""
    from ..formats import inventory_to_json, json_text
    from ..report import print_inventory
    from ..sources import resolve_device

    resolve_device(device or "auto")  # rejects --device cuda without CUDA, as everywhere
    source = open_sources(sources, load_config(config_path), device)
    warn(source.warnings)
    inventory = source.inventory()
    if output_format == "json":
        emit(json_text(stamp(inventory_to_json(inventory))) + "\n", None)
    else:
        emit_table(functools.partial(print_inventory, inventory=inventory), None)
    return ExitStatus.OK if inventory.complete else ExitStatus.INCOMPLETE
