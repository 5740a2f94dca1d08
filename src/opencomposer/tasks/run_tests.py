"""Verifier-side test runner: runs unittest test modules and writes a JUnit XML report.

Standard library only: it is copied into a task's hidden verifier files and runs inside the
sandbox at grading time (`python .oc_verifier/run_tests.py --junit PATH module ...`). Before loading
tests it drops from `sys.modules` every module the workspace itself defines, so the code under test
is always the workspace's copy even if the interpreter imported a same-named standard-library
module at start-up (unittest itself imports several).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import unittest
import xml.etree.ElementTree as ET


class Recorder(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str, str, float, str]] = []
        self._t = 0.0

    def startTest(self, test):  # noqa: N802 - unittest API
        self._t = time.perf_counter()
        super().startTest(test)

    def _add(self, test, outcome: str, detail: str = "") -> None:
        tid = test.id()
        cls, _, name = tid.rpartition(".")
        self.records.append((cls, name, outcome, time.perf_counter() - self._t, detail))

    def addSuccess(self, test):  # noqa: N802
        self._add(test, "passed")

    def addFailure(self, test, err):  # noqa: N802
        self._add(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):  # noqa: N802
        self._add(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):  # noqa: N802
        self._add(test, "skipped", reason)

    def addExpectedFailure(self, test, err):  # noqa: N802
        self._add(test, "passed")

    def addUnexpectedSuccess(self, test):  # noqa: N802
        self._add(test, "failed", "unexpected success")

    def addSubTest(self, test, subtest, err):  # noqa: N802
        if err is not None:
            self._add(test, "failed", self._exc_info_to_string(err, test))


def purge_workspace_modules(root: str) -> None:
    local = set()
    for name in os.listdir(root):
        if name.endswith(".py"):
            local.add(name[:-3])
        elif os.path.isfile(os.path.join(root, name, "__init__.py")):
            local.add(name)
    for mod in list(sys.modules):
        if mod.split(".")[0] in local:
            del sys.modules[mod]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--junit", required=True)
    ap.add_argument("--local", action="append", default=[],
                    help="a module the tests must import from the workspace (not a same-named stdlib one)")
    ap.add_argument("modules", nargs="+")
    args = ap.parse_args()
    root = os.getcwd()
    sys.path.insert(0, root)
    purge_workspace_modules(root)
    result = Recorder()
    loader = unittest.TestLoader()
    # Code under test that shares its name with a standard-library module (the bundled benchmark
    # copies stdlib modules into the workspace): deleting the workspace's copy must not let the
    # tests pass against the interpreter's own.
    for name in args.local:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = os.path.realpath(getattr(spec, "origin", None) or "")
        if not origin.startswith(os.path.realpath(root) + os.sep):
            result.records.append((name, "<workspace>", "error", 0.0,
                                   f"{name} is not imported from the workspace ({origin or 'not found'})"))
    for mod in args.modules if not result.records else []:
        try:
            suite = loader.loadTestsFromName(mod)
        except Exception as e:  # noqa: BLE001 - an import error is a test error, recorded as such
            result.records.append((mod, "<import>", "error", 0.0, f"{type(e).__name__}: {e}"))
            continue
        suite.run(result)
    suite_el = ET.Element("testsuite", name="opencomposer", tests=str(len(result.records)))
    for cls, name, outcome, secs, detail in result.records:
        case = ET.SubElement(suite_el, "testcase", classname=cls, name=name, time=f"{secs:.4f}")
        if outcome in ("failed", "error"):
            ET.SubElement(case, "failure" if outcome == "failed" else "error", message=detail[:200]).text = detail
        elif outcome == "skipped":
            ET.SubElement(case, "skipped", message=detail[:200])
    ET.ElementTree(suite_el).write(args.junit)
    bad = sum(1 for r in result.records if r[2] in ("failed", "error"))
    print(f"{len(result.records) - bad} passed, {bad} failed")
    return 1 if bad or not result.records else 0


if __name__ == "__main__":
    raise SystemExit(main())
