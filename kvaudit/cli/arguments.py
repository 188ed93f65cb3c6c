"""What the commands share about their arguments: SOURCEs opened (as the command's
processes open them: spread under torchrun), descriptions read, ``--request`` ids, and
output options checked before any work."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.errors import KvauditError
from ..core.files import check_output, output_identity
from ..distributed.processes import processes

if TYPE_CHECKING:
    from ..description import CacheDescription
    from ..sources import Source


def check_outputs(outputs: dict[str, str | None], inputs: Sequence[str | None]) -> None:
    """Refuse, before any work, an output option (``-o``) that names no file, names one
    of the command's inputs (SOURCE arguments, records, descriptions), or names the file
    another output option names (one report would overwrite the other); under torchrun,
    on rank 0 only, which writes them.

    Raises:
        KvauditError: One line naming the output and the problem.

    """
    if not processes().writes:
        return
    named = [name for name in inputs if name]
    seen: dict[object, str] = {}
    for option, output in outputs.items():
        if output is None:
            continue
        check_output(output, named, option)
        identity = output_identity(output, option)
        if identity in seen:
            raise KvauditError(
                f"{option} and {seen[identity]} name the same file: one report would "
                "overwrite the other; give each its own",
                output,
            )
        seen[identity] = option


def load_config(path: str | None) -> CacheDescription | None:
    """The cache description a ``-c``-style option names; None when not given (then YAML
    is never imported)."""
    if path is None:
        return None
    from ..description import load_description

    return load_description(path)


def open_sources(
    names: Sequence[str], config: CacheDescription | None, device: str | None
) -> Source:
    """SOURCE arguments resolved; live tensors move to ``--device`` only when given. Under
    torchrun, each process opens its share of the dumps (docs/scale.md)."""
    return processes().open_sources(names, config, device)


def wanted_ids(request_ids: Sequence[str]) -> list[str] | None:
    """The ``--request`` ids, each once; None (every request) when none is given."""
    return list(dict.fromkeys(request_ids)) or None
