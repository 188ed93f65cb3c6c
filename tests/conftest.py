"""Fixtures the test modules share; the helpers they share are modules beside it
(``kvbuild``, ``reference``, ``engine_runs``, ``dumped_sets``)."""

from __future__ import annotations

import pytest
from dumped_sets import Sets, build_sets


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> Sets:
    """A producer's and a consumer's dump sets of one model, with their decoded cells
    (built once per test module that asks for them)."""
    return build_sets(tmp_path_factory.mktemp("sets"))
