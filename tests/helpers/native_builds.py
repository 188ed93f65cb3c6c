"""kvaudit's C extensions as the tests see them: each imported where it built, the mark
that skips a module's tests where it did not (unless CI requires the builds), and the
check that fails CI when one did not build."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRED = os.environ.get("KVAUDIT_REQUIRE_NATIVE") == "1"
"""CI (scripts/test.sh) sets KVAUDIT_REQUIRE_NATIVE=1: every extension must have built."""


def built(name: str) -> ModuleType | None:
    """The extension module ``name``, or None where it did not build."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def skip_unless_built(module: ModuleType | None, name: str, instead: str) -> pytest.MarkDecorator:
    """Skip where ``name`` did not build (``instead`` says what runs then), unless required."""
    return pytest.mark.skipif(
        module is None and not REQUIRED,
        reason=f"{name} did not build (no C compiler at install): {instead}",
    )


def assert_built_where_required(module: ModuleType | None, name: str) -> None:
    """Under KVAUDIT_REQUIRE_NATIVE=1 a missing build fails; elsewhere the check skips."""
    if not REQUIRED:
        pytest.skip("KVAUDIT_REQUIRE_NATIVE=1 is not set")
    assert module is not None, f"{name} did not build (see setup.py)"
