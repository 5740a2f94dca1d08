"""JUnit XML -> {test id: outcome}. Test ids are `classname::name` (pytest and our runner agree)."""

from __future__ import annotations

import xml.etree.ElementTree as ET


class JunitError(ValueError):
    pass


def parse_junit(text: str) -> dict[str, str]:
    """Outcomes: passed, failed, error, skipped. Raises JunitError on XML that is not a report."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise JunitError(f"not XML: {e}") from None
    if root.tag not in ("testsuite", "testsuites"):
        raise JunitError(f"root element is <{root.tag}>, not a JUnit report")
    out: dict[str, str] = {}
    for case in root.iter("testcase"):
        tid = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                break
        # A test reported twice (subtests) keeps its worst outcome.
        if out.get(tid) in ("failed", "error") and outcome == "passed":
            continue
        out[tid] = outcome
    return out
