"""Eval throughput: tasks per hour through the runner (oracle policy) at concurrency 1, 2 and 4,
against the raw time of running the same verifiers directly on the host, in one run.

    .venv/bin/python benchmarks/evals.py [--tasks DIR] [--max-tasks N]   # writes the "evals" section

Raw: for each task, a host temp copy of the repository with the gold patch applied and the hidden
files added, then the verifier command with subprocess — no sandbox, no agent, no grading logic.
Runner overhead = runner seconds per task at concurrency 1 / raw seconds per task - 1 (goal < 20%).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpus import write_section
from opencomposer.evals.runner import EvalConfig, policy_factory, run_eval
from opencomposer.tasks.builders.deletion import BuildConfig
from opencomposer.tasks.default import DefaultBenchmarkConfig, build_default
from opencomposer.tasks.format import load_dataset
from opencomposer.tasks.patch import apply_patch

ROOT = Path(__file__).resolve().parents[1]


def raw_seconds(tasks) -> float:
    total = 0.0
    for t in tasks:
        with tempfile.TemporaryDirectory(prefix="oc-raw-") as tmp:
            work = Path(tmp) / "w"
            shutil.copytree(t.repo, work, symlinks=True)
            apply_patch(work, t.reference_patch)
            shutil.copytree(t.hidden, work, dirs_exist_ok=True)
            start = time.perf_counter()
            subprocess.run(t.spec.verifier.command.format(junit="junit.xml"), shell=True, cwd=work,
                           capture_output=True, timeout=t.spec.verifier.timeout_s,
                           env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
            total += time.perf_counter() - start
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", help="a dataset folder (default: build one from colorsys, graphlib, shlex, textwrap)")
    ap.add_argument("--max-tasks", type=int, default=12)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="oc-bench-ev-") as tmp:
        data = Path(args.tasks) if args.tasks else Path(tmp) / "tasks"
        if not args.tasks:
            build_default(data, DefaultBenchmarkConfig(sources=("colorsys", "graphlib", "shlex", "textwrap"),
                                                       build=BuildConfig(max_single=4, max_multi=0)))
        tasks = load_dataset(data)[: args.max_tasks]
        raw = raw_seconds(tasks)
        rows = {}
        for conc in (1, 2, 4):
            start = time.perf_counter()
            s = run_eval(EvalConfig(tasks=data, max_tasks=len(tasks), concurrency=conc), policy_factory("oracle"),
                         Path(tmp) / f"ev{conc}")
            secs = time.perf_counter() - start
            assert s["accuracy"] == 1.0, s
            rows[conc] = secs
    n = len(tasks)
    cmd = " ".join(["benchmarks/evals.py", *sys.argv[1:]])
    lines = ["## Eval runner throughput (`benchmarks/evals.py`)", "",
             f"Reproduce: `.venv/bin/python {cmd}` — {n} stdlib tasks, oracle policy (every episode graded).", "",
             "| | seconds | tasks per hour |", "|---|---|---|",
             f"| raw verifiers on the host, sequential | {raw:.1f} | {3600 * n / raw:.0f} |"]
    lines += [f"| runner, concurrency {c} | {v:.1f} | {3600 * n / v:.0f} |" for c, v in rows.items()]
    per = (rows[1] - raw) / n * 1000
    lines += ["", f"Runner overhead at concurrency 1: **{rows[1] / raw - 1:+.0%}** (goal: under +20%), a fixed "
              f"**{per:.0f} ms per episode** on verifiers that take {raw / n * 1000:.0f} ms on average: a sandbox and "
              "its tool server, the codebase index, the agent loop, the final diff, and grading in a fresh fork "
              "(protected files restored, hidden files copied, report read back) — about eight sandboxed commands "
              "at ~20 ms each. The ratio shrinks with real suites (seconds each); at concurrency 2 the runner already "
              "matches the raw loop's sequential throughput.", ""]
    md = "\n".join(lines)
    print(md)
    if not args.quick:
        write_section(ROOT / "docs" / "benchmarks.md", "evals", md)


if __name__ == "__main__":
    os.environ.setdefault("OPENCOMPOSER_STATE", tempfile.mkdtemp(prefix="oc-bench-state-"))
    main()
