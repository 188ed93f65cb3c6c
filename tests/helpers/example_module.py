"""The bundled example's builder (``examples/make_example.py``), loaded once for the test
modules that build its dump sets: ``from example_module import example``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "make_example.py"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvaudit_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


example = _load_example()
