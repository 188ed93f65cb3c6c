"""The whole-engine stage's fixtures: one tiny random-weight Llama for every test (made
at test time, nothing from a hub). Each test module starts its own pair of engines, stopped
when the module ends, so that no two pairs run at once on the machine's two cores."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "vllm_pd_cpu"))

from tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder."""
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
