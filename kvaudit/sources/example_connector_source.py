"""vLLM ExampleConnector folders as sources: a folder of one request's prompt KV
(``<layer_name>.safetensors``, one ``kv_cache`` tensor each), several such folders, or a
connector's storage path that holds them, read as one dump of their requests under the
engine's own description (``-c``; docs/dump-format.md, "Other inputs").

``kvaudit.sources.sniffing`` recognises the folders; ``kvaudit.dumps.example_connector``
reads their files. The folders stand with their own kind only: a connector's folders are
one worker of TP 1, which no dump of another worker joins.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.errors import KvauditError
from ..dumps import DumpSet
from ..dumps.example_connector import open_example_connectors
from .dump_source import DumpSource
from .registry import OpenOptions
from .sniffing import example_connector_folders


def open_example_connector_folders(
    names: Sequence[str], claimed: Sequence[str], options: OpenOptions
) -> DumpSource:
    """The ExampleConnector kind's opener: every argument a folder, or a directory of them.

    Args:
        names: The command's SOURCE arguments.
        claimed: Those that are ExampleConnector folders or directories of them.
        options: What the command line says about them (``config``, required).

    Returns:
        A dump source of one dump: every folder's request, in the order given (a
        directory's folders in name order).

    Raises:
        KvauditError: An argument of another kind among them, a folder that does not read
            under the description, or two folders of one request.

    """
    others = [name for name in names if name not in claimed]
    if others:
        raise KvauditError(
            f"{others[0]}: ExampleConnector folders cannot be mixed with dumps or other "
            "sources; give the folders, or their storage directory, alone"
        )
    folders = [folder for name in names for folder in example_connector_folders(name)]
    dump = open_example_connectors(folders, options.config)
    return DumpSource(names, DumpSet([dump], True, []))
