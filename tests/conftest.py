"""Fixtures the test modules share; the helpers they share are the package
``tests/helpers/`` (this folder is on ``sys.path`` while the tests run).

Test modules live in a folder per package they test (``tests/checksum/`` for
``kvaudit/checksum/``...), ``tests/project/`` for checks of the whole project,
``tests/vllm/`` for the vLLM stage and ``tests/sglang/`` for the SGLang stage."""

from __future__ import annotations

import pytest
from helpers.dumped_sets import Sets, build_sets


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Sets:
    """A producer's and a consumer's dump sets of one model, with their decoded cells
    (built once per test module that asks for them)."""
    return build_sets(tmp_path_factory.mktemp("sets"))
