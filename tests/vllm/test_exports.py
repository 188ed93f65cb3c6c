"""kvaudit.integrations.vllm's public names each resolve to their module's own object,
with vllm installed (tests/project/test_exports.py checks the mapping itself, and skips
this where vllm is missing)."""

from __future__ import annotations

import importlib

from kvaudit.integrations import vllm as package


def test_each_name_resolves() -> None:
    assert package._EXPORTS
    for name, home in package._EXPORTS.items():
        source = importlib.import_module(home, package.__name__)
        assert getattr(package, name) is getattr(source, name), name
