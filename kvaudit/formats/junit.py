"""A diff report as JUnit XML, for CI systems that show test results.

One test case per request and group (classname ``kvaudit.<request>``, or
``kvaudit.<name>.<request>`` for a report named after its sides, name ``group <id>``):
errored when the group could not be compared (the reason is the message), else failed
when blocks or replicas differ or positions are missing (unless the report allows
missing positions). A request the consumer lacks is a failed case named ``request``; one
only the consumer has is a skipped case. A report in which nothing was verified, and no
case says so already (a request with no group to compare, no request in common, or
nothing compared where missing positions are allowed), has an errored case ``kvaudit`` /
``nothing compared``. A case compared by the seed lane of the checksum alone says so, and
why, in its ``<system-out>``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from ..compare.model import (
    SEED_LANE_NOTE,
    DiffReport,
    GroupComparison,
    StaleSource,
    matches_text,
)
from ..diagnosis import Finding, diagnose
from .json import located_items

# Characters XML 1.0 cannot hold at all, escaped or not.
_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text: str) -> str:
    """``text`` with the characters XML 1.0 forbids written as Python escapes
    (``\\x1b``, ``\\ud800``)."""
    return _NOT_XML.sub(lambda match: match.group(0).encode("unicode_escape").decode(), text)


def _list(items: Sequence[object], limit: int = 20) -> str:
    """The first ``limit`` items, comma-separated, and how many more there are."""
    shown = ", ".join(str(item) for item in items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def failure_message(
    group: GroupComparison, *, allow_missing: bool = False, findings: Sequence[Finding] = ()
) -> str:
    """One line: the diagnosis's findings first, then the positions whose blocks differ
    (and the producer blocks they hold, where traced), the replicas that differ and the
    positions the consumer lacks (unless ``allow_missing``)."""
    parts = [finding.line for finding in findings]
    if group.mismatched_positions:
        parts.append(
            f"blocks differ at positions {_list(group.mismatched_positions)} "
            f"(block size {group.block_size}, {group.compared} compared)"
        )
    traced = [
        f"position {position} holds {_sources_text(group, position, sources)}"
        for position, sources in sorted(group.stale_sources.items())
        if sources
    ]
    if traced:
        parts.append(_list(traced, 5))
    if group.replica_mismatches:
        pairs = [f"{position} ({r}:{i})" for position, r, i in group.replica_mismatches]
        parts.append(f"replicas differ at position (replica key) {_list(pairs)}")
    if group.missing_positions and not allow_missing:
        parts.append(
            f"the consumer lacks positions {_list(group.missing_positions)} "
            f"(block size {group.block_size})"
        )
    return "; ".join(parts)


def _sources_text(group: GroupComparison, position: int, sources: Sequence[StaleSource]) -> str:
    """A position's first sources, and how many more (all the places that match where
    the list was cut short)."""
    total = group.stale_matches.get(position)
    if total is None:
        return _list([_source_text(s) for s in sources], 3)
    shown = min(len(sources), 3)
    listed = ", ".join(_source_text(s) for s in sources[:shown])
    return f"{listed} ({matches_text(total, shown)})"


def _source_text(source: StaleSource) -> str:
    """A producer block a consumer block holds, as ``req-b position 1``."""
    size = f" (of {source.block_size} tokens)" if source.block_size is not None else ""
    return f"{source.request} position {source.position}{size}"


def _item_text(key: str, value: object) -> str:
    """One field of a located entry as ``key value``."""
    if isinstance(value, dict):
        value = " ".join(f"{name} {item}" for name, item in value.items())
    return f"{key} {value}"


def _located_text(group: GroupComparison) -> str:
    """The located differences, one per line."""
    return "\n".join(
        ", ".join(_item_text(key, value) for key, value in located_items(item))
        for item in group.located
    )


def _case(suite: ET.Element, prefix: str, request_id: str, name: str) -> ET.Element:
    """A new ``<testcase>`` of the suite for a request."""
    return ET.SubElement(
        suite, "testcase", {"classname": xml_text(f"{prefix}.{request_id}"), "name": name}
    )


def diff_junit(report: DiffReport, suite_name: str = "kvaudit.diff", name: str = "") -> str:
    """The report as a JUnit XML document (``<testsuites>`` holding one ``<testsuite>``).

    Args:
        report: The report written.
        suite_name: The name of the ``<testsuite>`` (``kvaudit.diff``, ``kvaudit.verify``).
        name: What the report compares (``prefill->decode``): the suite is
            ``SUITE_NAME NAME`` and each case's classname ``kvaudit.NAME.REQUEST``, so that
            the reports of several engines merged in one CI view stay apart ("": the
            suite and classnames without it).

    Returns:
        The XML text.

    """
    prefix = f"kvaudit.{name}" if name else "kvaudit"
    root = ET.Element("testsuites", {"name": "kvaudit"})
    title = f"{suite_name} {name}" if name else suite_name
    suite = ET.SubElement(root, "testsuite", {"name": xml_text(title)})
    tests = failures = errors = skipped = 0
    diagnosis = diagnose(report)
    for request_id, gid, group in report.groups():
        found = diagnosis.get((request_id, gid), [])
        case = _case(suite, prefix, request_id, f"group {gid}")
        tests += 1
        if group.unverified is not None:
            # One outcome per case: unverified wins; any differences found go in its text.
            errors += 1
            error = ET.SubElement(
                case, "error", {"message": xml_text(group.unverified), "type": "unverified"}
            )
            if group.differs:
                message = failure_message(group, allow_missing=report.allow_missing, findings=found)
                error.text = xml_text(message)
        elif not report.group_ok(group):
            failures += 1
            message = failure_message(group, allow_missing=report.allow_missing, findings=found)
            kind = "mismatch" if group.differs else "missing"
            failure = ET.SubElement(case, "failure", {"message": xml_text(message), "type": kind})
            body = "\n".join([*(finding.line for finding in found), _located_text(group)])
            failure.text = xml_text(body.strip("\n")) or None
        if group.compared and group.seed_lane_only is not None:
            out = ET.SubElement(case, "system-out")
            out.text = xml_text(f"{SEED_LANE_NOTE}: {group.seed_lane_only}")
    if report.scale_differences:
        # Layer scales are the engine's, not a request's: one case for them all.
        case = _case(suite, prefix, "", "scales")
        case.set("classname", prefix)
        tests += 1
        failures += 1
        message = "; ".join(report.scale_differences)
        failure = ET.SubElement(case, "failure", {"message": xml_text(message), "type": "scale"})
        failure.text = xml_text("\n".join(report.scale_differences))
    for request_id in report.only_in_producer:
        case = _case(suite, prefix, request_id, "request")
        tests += 1
        failures += 1
        message = "the request is missing on the consumer"
        ET.SubElement(case, "failure", {"message": message, "type": "missing"})
    for request_id in report.only_in_consumer:
        case = _case(suite, prefix, request_id, "request")
        tests += 1
        skipped += 1
        ET.SubElement(case, "skipped", {"message": "the request is on the consumer only"})
    groupless = any(not groups for groups in report.requests.values())
    if report.empty_reason is not None and (groupless or failures + errors == 0):
        # Only where no case above fails already: else the suite is red and says why.
        case = _case(suite, prefix, "", "nothing compared")
        case.set("classname", prefix)
        tests += 1
        errors += 1
        ET.SubElement(case, "error", {"message": xml_text(report.empty_reason), "type": "empty"})
    counts = {"tests": tests, "failures": failures, "errors": errors, "skipped": skipped}
    for element in (root, suite):
        for key, value in counts.items():
            element.set(key, str(value))
    body = ET.tostring(root, encoding="unicode")
    return f'<?xml version="1.0" encoding="UTF-8"?>\n{body}\n'
