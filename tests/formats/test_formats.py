"""Every output form, byte for byte: the JSON, CSV and JUnit of ``kvaudit.formats`` and the
tables of ``kvaudit.report``, for small fixed results that reach the awkward cases (uint64
values past 2**63, long lists that wrap, quotes and control characters, non-finite
errors, replica entries, every planted-fault mode).

The expected texts in ``tests/golden/formats/`` were written by the code before the
formats layer existed (``Record.to_json``, ``DiffReport.to_junit``, ``kvaudit.report``
of commit 073aa70): the output is the same as it was. The JSON texts are also checked
against their parsed values, so that the golden files say what they hold.
"""

from __future__ import annotations

import ast
import csv
import functools
import io
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from kvaudit.compare import DiffReport, GroupComparison, StaleSource
from kvaudit.corrupt import (
    ChangedSlice,
    CorruptMode,
    FlippedBit,
    PlantedFault,
    StaleOrigin,
    SwappedHeads,
    SwappedTokens,
)
from kvaudit.formats import (
    diff_json_text,
    diff_junit,
    inventory_to_json,
    json_text,
    planted_to_json,
    record_csv,
    record_to_json,
)
from kvaudit.locate import LocatedDifference
from kvaudit.numeric.model import GroupNumeric, NumericReport, RequestNumeric, SliceErrors
from kvaudit.records import (
    GroupChecksums,
    Record,
    RequestChecksums,
    WorkerInfo,
    WorkerRecord,
    combine_workers,
)
from kvaudit.report import (
    SideNames,
    print_corrupted,
    print_diff,
    print_inventory,
    print_record,
    render_text,
)
from kvaudit.report.numeric import print_numeric
from kvaudit.workers import GroupInfo, Inventory, RequestInventory, WorkerInventory

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "formats"
LAYER = "model.layers.3.self_attn.attn"


def golden(name: str) -> str:
    return (GOLDEN / f"{name}.txt").read_text(encoding="utf-8")


# Fixed results.


def record() -> Record:
    """Two TP workers, replica keys (1, 0) and (2, r), values past 2**63, a request id
    that CSV must quote."""
    workers = []
    for rank in range(2):
        values = np.array([[2**64 - 1 - rank, 5], [rank, 2**63 + rank]], dtype=np.uint64)
        groups = {
            0: GroupChecksums(16, 1, [(1, 0), (2, rank)], values, 0xAB),
            1: GroupChecksums(4, 0, [(1, 0)], np.array([[rank + 1]] * 4, dtype=np.uint64), 0xCD),
        }
        quoted = GroupChecksums(4, 0, [(1, 0)], np.array([[9]], dtype=np.uint64), 0xCD)
        requests = {
            "req-7": RequestChecksums(40, groups),
            'r,"q"': RequestChecksums(3, {1: quoted}),
        }
        worker = WorkerInfo(rank, 2, 0, 1, "consumer", "decode", f"out/rank{rank}.safetensors")
        not_covered = {2: "its KV heads are packed"} if rank else {}
        workers.append(
            WorkerRecord(worker, "request", {0: 0xAB00 + rank, 1: 0xCD}, not_covered, requests)
        )
    return combine_workers(workers)


LOCATED = [
    LocatedDifference(
        2,
        "model.layers.1.self_attn.attn",
        3,
        [33, 35],
        1234,
        0.5,
        0.01,
        0.125,
        consumer_worker=(1, 0),
        file="decode/rank1.safetensors",
    ),
    LocatedDifference(
        2, "model.layers.0.mla", 0, list(range(32, 48)), 0, math.inf, math.nan, math.inf, 3
    ),
]


def report() -> DiffReport:
    """A mismatch with more than 20 positions, replica differences and located entries; an
    unverified group with quotes and a control character; an unverified group that also
    differs; a clean group; a request without groups; requests on one side only; missing
    positions, a traced stale block, token counts and a warning."""
    a0 = GroupComparison(
        compared=30,
        mismatched_positions=list(range(2, 26)),
        replica_mismatches=[(1, 2, 1), (2, 2, 1), (2, 4, 3)],
        located=list(LOCATED),
        block_size=16,
        missing_positions=[30, 31],
        held=(32, 30),
        stale_sources={2: [StaleSource("req-b", 0, 1)], 3: []},
    )
    a1 = GroupComparison(
        unverified='covered on the producer only (consumer: "<packed>" & \x1b)', block_size=16
    )
    a2 = GroupComparison(
        compared=1,
        mismatched_positions=[0],
        unverified="a worker is missing on the consumer",
        block_size=4,
    )
    b0 = GroupComparison(compared=2, block_size=16)
    requests = {"req-a": {1: a1, 0: a0, 2: a2}, "req-b": {0: b0}, "req-empty": {}}
    report = DiffReport("request", requests, ["req-gone"], ["req-extra"])
    report.num_tokens = {"req-a": (512, 500), "req-b": (20, 20), "req-empty": (3, None)}
    report.warnings = ["the roles look swapped"]
    return report


def inventory() -> Inventory:
    worker = WorkerInfo(1, 2, 0, 1, "producer", "prefill", "p/rank1.safetensors")
    groups = [
        GroupInfo(0, 0xAB, True, None, "attention", 16, 8, "NTHC", 4, 123456),
        GroupInfo(1, 0xCD, False, "its KV heads are packed"),
    ]
    requests = {"req-7": RequestInventory(40, {1: {3, 1, 2}, 0: {0, 1, 2}})}
    return Inventory(
        "dumps", ["p/"], [WorkerInventory(worker, 64, groups)], False, [(0, 0)], requests
    )


def planted(mode: CorruptMode, **details: object) -> PlantedFault:
    changes = [
        ChangedSlice(LAYER, 2, list(range(32, 48)), []),
        ChangedSlice(LAYER, 3, [40], [257, 258]),
    ]
    return PlantedFault(
        source="c/rank1.safetensors",
        out="broken/rank1.safetensors",
        mode=mode,
        seed=3,
        request="req-long",
        group=0,
        position=2,
        block=43,
        row=14,
        num_tokens=257,
        layers=[LAYER],
        heads=[2, 3],
        tokens=list(range(32, 48)),
        changes=changes,
        byte_ranges=[[100, 104], [300, 301]],
        **details,  # type: ignore[arg-type]
    )


FAULTS = {
    "flip": planted("flip", flip=FlippedBit(LAYER, 2, 33, 5, 7)),
    "swap-tokens": planted("swap-tokens", swap=SwappedTokens(LAYER, 2, [33, 34])),
    "swap-heads": planted("swap-heads", swap=SwappedHeads(LAYER, [2, 3])),
    "stale": planted("stale", origin=StaleOrigin("req-short", 1, 9, 3)),
    "zero": planted("zero"),
}


# Records.


def test_record_json() -> None:
    text = json_text(record_to_json(record())) + "\n"
    assert text == golden("record_json")
    data = json.loads(text)
    group = data["requests"]["req-7"]["groups"]["0"]
    assert group["replica_keys"] == [[1, 0], [2, 0], [2, 1]]
    # Totals are the replica-0 sums mod 2**64: (2**64 - 1) + (2**64 - 2) + 5 + 5.
    assert group["totals"][0] == f"{(2 * 2**64 - 3 + 5) % 2**64:016x}"
    assert Record.from_json(data, "golden").requests.keys() == {"req-7", 'r,"q"'}


def test_json_text_writes_long_lists_an_item_a_line() -> None:
    # Plain items of a long list are written flat, nested lists and objects indented.
    value = {"a": ["x" * 30, "y" * 30, 7, [1, 2], {}, (3, 4), {"k": [1]}], "b": []}
    assert json_text(value).splitlines() == [
        "{",
        '  "a": [',
        f'    "{"x" * 30}",',
        f'    "{"y" * 30}",',
        "    7,",
        "    [1, 2],",
        "    {},",
        "    [3, 4],",
        "    {",
        '      "k": [1]',
        "    }",
        "  ],",
        '  "b": []',
        "}",
    ]
    with pytest.raises(ValueError):
        json_text([math.nan])


def test_record_csv() -> None:
    text = record_csv(record())
    assert text == golden("record_csv")
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == ["request", "group", "position", "replica_key", "value"]
    assert rows[-1] == ['r,"q"', "1", "0", "total", "0000000000000012"]


def test_record_table() -> None:
    assert render_text(print_record, record()) == golden("record_table")


# Diff reports.


def test_diff_json() -> None:
    text = diff_json_text(report())
    assert text == golden("diff_json")
    entries = json.loads(text)["requests"]["req-a"]["groups"]["0"]["located"]
    assert "replica" not in entries[0] and entries[1]["replica"] == 3
    assert entries[1]["max_abs_error"] is None and entries[1]["max_rel_error"] is None
    assert entries[0]["scaled_error"] == 0.125 and entries[1]["scaled_error"] is None


def test_diff_junit() -> None:
    text = diff_junit(report(), "kvaudit.verify")
    assert text == golden("diff_junit")
    suite = ET.fromstring(text).find("testsuite")
    assert suite is not None
    counts = {key: suite.get(key) for key in ("tests", "failures", "errors", "skipped")}
    # The request without groups: nothing of it was verified, an errored case.
    assert counts == {"tests": "7", "failures": "2", "errors": "3", "skipped": "1"}


def junit_cases(report: DiffReport) -> list[tuple[str, str, str]]:
    """Each test case of the report's JUnit form: classname, name and its outcome."""
    suite = ET.fromstring(diff_junit(report, "kvaudit.diff")).find("testsuite")
    assert suite is not None
    return [
        (case.get("classname", ""), case.get("name", ""), case[0].tag if len(case) else "pass")
        for case in suite.iter("testcase")
    ]


def test_a_named_junit_report_keeps_its_cases_apart_from_another_engines() -> None:
    # Two consumers' reports merged in one CI view: suites and classnames differ by name.
    cases = []
    for name in ("prefill->decode-a", "prefill->decode-b"):
        root = ET.fromstring(diff_junit(report(), "kvaudit.diff", name))
        suite = root.find("testsuite")
        assert suite is not None and suite.get("name") == f"kvaudit.diff {name}"
        cases.append({(case.get("classname"), case.get("name")) for case in suite})
        assert all(
            cls == f"kvaudit.{name}" or cls.startswith(f"kvaudit.{name}.") for cls, _ in cases[-1]
        )
    assert not cases[0] & cases[1]


def test_diff_junit_has_one_case_per_request_and_group_when_each_says_why() -> None:
    # cli.md: one test case per request and group, errored when unverified; nothing was
    # compared, and every case is already errored: no case beside them.
    uncovered = GroupComparison(unverified="not covered on either side", block_size=16)
    report = DiffReport("request", {"r1": {0: uncovered}, "r2": {0: uncovered, 1: uncovered}})
    assert report.empty_reason is not None
    assert junit_cases(report) == [
        ("kvaudit.r1", "group 0", "error"),
        ("kvaudit.r2", "group 0", "error"),
        ("kvaudit.r2", "group 1", "error"),
    ]


def test_diff_junit_says_nothing_was_compared_where_no_case_does() -> None:
    # No request in common, or nothing compared where missing positions are allowed: the
    # suite would pass without the case that says nothing was verified.
    allowed = GroupComparison(block_size=16, missing_positions=[0, 1])
    for report in (
        DiffReport("request", {}),
        DiffReport("request", {"r1": {0: allowed}}, allow_missing=True),
    ):
        cases = junit_cases(report)
        assert cases[-1] == ("kvaudit", "nothing compared", "error")
        assert all(outcome == "pass" for *_, outcome in cases[:-1])


def test_diff_tables() -> None:
    assert render_text(print_diff, report()) == golden("diff_table")
    # Every located row, also those the diagnosis names above the table.
    every = functools.partial(print_diff, located_rows="all")
    assert render_text(every, report()) == golden("diff_table_all")
    stored = SideNames("stored checksums", "dumps", "checked")
    text = render_text(
        lambda console, report: print_diff(
            console, report, title="verify the stored checksums of x", sides=stored
        ),
        report(),
    )
    assert text == golden("diff_table_stored")


# Inventories and planted faults.


def test_inventory_json_and_table() -> None:
    text = json_text(inventory_to_json(inventory())) + "\n"
    assert text == golden("inventory_json")
    assert json.loads(text)["requests"]["req-7"]["groups"] == {"0": [0, 1, 2], "1": [1, 2, 3]}
    assert render_text(print_inventory, inventory()) == golden("inventory_table")


@pytest.mark.parametrize("mode", sorted(FAULTS))
def test_planted_fault(mode: str) -> None:
    fault = FAULTS[mode]
    text = json_text(planted_to_json(fault)) + "\n"
    assert text == golden(f"planted_{mode}_json")
    data = json.loads(text)
    assert data["mode"] == mode
    details = {"flip": ["flip"], "swap-tokens": ["swap"], "swap-heads": ["swap"], "stale": ["from"]}
    assert [key for key in ("flip", "swap", "from") if key in data] == details.get(mode, [])
    assert render_text(print_corrupted, fault) == golden(f"planted_{mode}_text")


def test_stale_block_from_an_unlisted_row() -> None:
    fault = planted("stale", origin=StaleOrigin(None, None, 7, 7))
    assert render_text(print_corrupted, fault) == golden("planted_stale_row_text")


# Layering.

PACKAGE = Path(__file__).resolve().parents[2] / "kvaudit"
WRITERS = ("kvaudit.formats", "kvaudit.report", "kvaudit.cli.progress", "kvaudit.cli")


def imported_modules(path: Path) -> set[str]:
    """The ``kvaudit`` modules a file imports, as absolute names (type-checking imports too)."""
    package = ".".join(path.relative_to(PACKAGE.parent).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("kvaudit")}


@pytest.mark.parametrize("module", ["compare", "corrupt", "locate", "records", "numeric"])
def test_results_do_not_import_their_writers(module: str) -> None:
    """Results flow into the writers, never back: no cycle between a result and its form."""
    paths = (
        [PACKAGE / module] if module.endswith(".py") else sorted((PACKAGE / module).glob("*.py"))
    )
    for path in paths:
        assert not any(name.startswith(WRITERS) for name in imported_modules(path)), path


def test_formats_and_tables_are_apart() -> None:
    for path in sorted((PACKAGE / "formats").glob("*.py")):
        assert not any(
            name.startswith(("kvaudit.report", "kvaudit.cli")) for name in imported_modules(path)
        )
    for path in sorted((PACKAGE / "report").glob("*.py")):
        assert not any(
            name.startswith(("kvaudit.formats", "kvaudit.cli")) for name in imported_modules(path)
        )


def test_the_numeric_table_shows_the_failing_slices_ranked_by_scaled_error() -> None:
    # Real bf16 KV holds exact zeros: a relative error is infinite almost everywhere, the
    # scaled error (largest error over the slice's largest value) is not. Intact slices
    # are left out; a group with none failing is one line.
    def slice_of(head: int, error: float, over: int) -> SliceErrors:
        return SliceErrors(
            "model.layers.0.self_attn.attn", 0, head, tokens=8, elements=64,
            max_abs_error=error, max_rel_error=math.inf, max_producer=2.0,
            over_tolerance=over,
        )  # fmt: skip

    slices = [slice_of(0, 0.001, 0), slice_of(1, 0.5, 3), slice_of(2, 0.25, 1)]
    bad = GroupNumeric(0, ["model.layers.0.self_attn.attn"], 3, slices, 8, np.zeros((1, 1)))
    calm = GroupNumeric(0, ["model.layers.0.self_attn.attn"], 1, slices[:1], 8, np.zeros((1, 1)))
    report = NumericReport(0.01, 0.01)
    report.requests = {
        "a": RequestNumeric("a", 8, {0: bad}),
        "b": RequestNumeric("b", 8, {0: calm}),
    }
    text = render_text(functools.partial(print_numeric, report=report, title="t"))
    lines = text.splitlines()
    rows = [line for line in lines if "model.layers.0" in line and "│" in line]
    assert [row.split("│")[2].strip() for row in rows] == ["1", "2"]  # worst first
    assert "scaled error" in text and "max rel" not in text and "inf" not in text
    assert "1 slices within the tolerance in --format json" in text
    assert any(
        line.startswith("request b, group 0: 8 tokens: all 1 slices within the tolerance")
        for line in lines
    )
