"""The examples in the public API's docstrings run and print what they say (doctest): a
reader who copies one gets the documented result."""

from __future__ import annotations

import doctest
from collections.abc import Callable
from typing import Any

import pytest

import kvaudit.checksum.kernels
import kvaudit.testing
from kvaudit import Checksummer, combine_workers, load_description
from kvaudit.description import parse_description
from kvaudit.dumps import open_dump, open_dump_set, write_dump
from kvaudit.records import Record

DOCUMENTED: list[tuple[str, Callable[..., Any] | type | object]] = [
    ("Checksummer", Checksummer),
    ("combine_workers", combine_workers),
    ("load_description", load_description),
    ("parse_description", parse_description),
    ("open_dump", open_dump),
    ("open_dump_set", open_dump_set),
    ("write_dump", write_dump),
    ("Record.from_json", Record.from_json),
    ("kvaudit.testing.as_source", kvaudit.testing.as_source),
    ("kvaudit.testing.diff_kv", kvaudit.testing.diff_kv),
    ("kvaudit.testing.report_text", kvaudit.testing.report_text),
    ("kvaudit.testing.assert_kv_equal", kvaudit.testing.assert_kv_equal),
    ("kvaudit.checksum.kernels", kvaudit.checksum.kernels),
]


@pytest.mark.parametrize(("name", "documented"), DOCUMENTED, ids=[n for n, _ in DOCUMENTED])
def test_the_docstring_example_runs(name: str, documented: object) -> None:
    tests = doctest.DocTestFinder(recurse=False).find(documented, name, globs={})
    examples = sum(len(test.examples) for test in tests)
    assert examples > 0, f"{name} has no example in its docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
