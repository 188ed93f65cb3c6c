"""``kvaudit corrupt``: a copy of one dump file with one planted fault, and what changed."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, get_args

import click

from ..core.errors import KvauditError
from ..core.exit_status import ExitStatus
from ..corrupt.mode_names import MODES
from .arguments import check_outputs, load_config
from .group import main
from .options import CORRUPT_EXIT_HELP, PlantedFormat, common_options, format_option
from .output import emit, emit_table

if TYPE_CHECKING:
    from ..corrupt import CorruptMode


@main.command(epilog=CORRUPT_EXIT_HELP)
@click.argument("source", metavar="SOURCE")
@click.option(
    "-o", "--output", metavar="OUT", required=True, help="Where to write the corrupted copy."
)
@click.option("--request", "request_id", metavar="ID", required=True, help="The request.")
@click.option("--group", "group_id", metavar="G", type=int, required=True, help="The group id.")
@click.option(
    "--position",
    metavar="P",
    type=int,
    required=True,
    help="The request's block position, in the dump's block size of the group.",
)
@click.option("--layer", metavar="NAME", default=None, help="Only this layer.")
@click.option("--head", metavar="H", type=int, default=None, help="Only this global KV head.")
@click.option(
    "--token",
    metavar="T",
    type=int,
    default=None,
    help="This request position (flip, swap); stale: the block's tokens up to it only.",
)
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="flip",
    show_default=True,
    help="flip a bit, zero the block, swap tokens or heads, a stale block from another "
    "request, tokens shifted by one slot.",
)
@click.option(
    "--seed", metavar="N", type=int, default=0, show_default=True, help="Seed of the choices."
)
@format_option(get_args(PlantedFormat), "How to say what changed.")
@common_options
def corrupt(
    source: str,
    output: str,
    request_id: str,
    group_id: int,
    position: int,
    layer: str | None,
    head: int | None,
    token: int | None,
    mode: CorruptMode,
    seed: int,
    output_format: PlantedFormat,
    config_path: str | None,
    device: str | None,
    quiet: bool,
) -> int:
    """Write a copy of one dump file with one planted fault in one block, and say what
    changed (for testing connectors and checkers)."""
    from ..corrupt import corrupt_dump
    from ..formats import json_text, planted_to_json
    from ..report import print_corrupted
    from ..sources import resolve_device

    resolve_device(device or "auto")
    if os.path.exists(output) and os.path.exists(source) and os.path.samefile(source, output):
        raise KvauditError("the output is SOURCE itself; corrupt writes a copy elsewhere", output)
    check_outputs({"-o": output}, [source, config_path])
    fault = corrupt_dump(
        source,
        output,
        request_id=request_id,
        group_id=group_id,
        position=position,
        layer=layer,
        head=head,
        token=token,
        mode=mode,
        seed=seed,
        config=load_config(config_path),
    )
    if output_format == "json":
        emit(json_text(planted_to_json(fault)) + "\n", None)
    else:
        emit_table(functools.partial(print_corrupted, fault=fault), None)
    return ExitStatus.OK
