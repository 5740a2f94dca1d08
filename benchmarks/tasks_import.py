"""Task import throughput and per-repository environment build times, in one run.

    .venv/bin/python benchmarks/tasks_import.py [--instances N] [--repeats R] [--quick]

- Import: a SWE-smith mirror in the published layout (main clean; per instance a branch whose
  parent plants a bug and whose tip deletes the fail-to-pass tests), made here from a small real
  package; every instance imported with `import_swesmith` and then gated (all of tasks/gates.py,
  gold and noop graded in sandboxes). Tasks per minute, gates included; with the F2P/P2P lists from
  the instances, and derived by running the suite at both revisions.
- Environment: `tasks/environment.ensure` for the default spec (pytest) into an empty cache
  (cold: a venv plus pip install from pip's local cache) and again (cached: the marker check).
Medians of R runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpus import write_section
from opencomposer.tasks import gates
from opencomposer.tasks.builders.importers import ImportConfig, import_swesmith
from opencomposer.tasks.environment import EnvironmentSpec, ensure
from opencomposer.tasks.patch import GIT_ENV

ROOT = Path(__file__).resolve().parents[1]
FAST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -p no:cacheprovider -o addopts= --junitxml={junit} {tests}"


def sh(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env={**os.environ, **GIT_ENV})


def make_mirror(root: Path, n: int) -> tuple[Path, list[dict]]:
    mirror = root / "mirror"
    (mirror / "pkg").mkdir(parents=True)
    (mirror / "tests").mkdir()
    funcs = [f"def f{i}(x):\n    return x + {i + 1}\n" for i in range(n)]
    (mirror / "pkg" / "__init__.py").write_text("")
    (mirror / "pkg" / "ops.py").write_text("\n\n".join(funcs))
    for i in range(n):
        (mirror / "tests" / f"test_f{i}.py").write_text(f"from pkg.ops import f{i}\n\n\ndef test_f{i}():\n"
                                                        f"    assert f{i}(1) == {2 + i}\n")
    sh(mirror, "init", "-q", "-b", "main")
    sh(mirror, "add", "-A")
    sh(mirror, "commit", "-qm", "clean")
    instances = []
    for i in range(n):
        branch = f"pkg.{i:04d}.func_pm_op_change__{i}"
        sh(mirror, "checkout", "-qb", branch, "main")
        text = (mirror / "pkg" / "ops.py").read_text().replace(f"return x + {i + 1}\n", f"return x - {i + 1}\n")
        (mirror / "pkg" / "ops.py").write_text(text)
        sh(mirror, "commit", "-qam", "Bug Patch")
        sh(mirror, "rm", "-q", f"tests/test_f{i}.py")
        sh(mirror, "commit", "-qm", "Remove F2P Tests")
        others = [f"tests/test_f{j}.py::test_f{j}" for j in range(n) if j != i][:3]
        instances.append({"instance_id": branch, "FAIL_TO_PASS": [f"tests/test_f{i}.py::test_f{i}"],
                          "PASS_TO_PASS": others})
    sh(mirror, "checkout", "-q", "main")
    return mirror, instances


def import_rate(mirror: Path, instances: list[dict], out: Path, derive: bool) -> tuple[float, int]:
    cfg = ImportConfig(test_cmd=FAST, derive_tests=derive)
    t0 = time.perf_counter()
    accepted = 0
    for inst in instances:
        root = import_swesmith(mirror, inst, out, cfg)
        accepted += all(g.ok for g in gates.validate(root))
    return 60 * len(instances) / (time.perf_counter() - t0), accepted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="print only, do not write docs/benchmarks.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="oc-bench-imp-") as tmp:
        tmp = Path(tmp)
        cold, cached = [], []
        for r in range(args.repeats):
            cache = tmp / f"envs{r}"
            t0 = time.perf_counter()
            ensure(EnvironmentSpec(), root=cache)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ensure(EnvironmentSpec(), root=cache)
            cached.append(time.perf_counter() - t0)
        mirror, instances = make_mirror(tmp, args.instances)
        listed, derived = [], []
        for r in range(args.repeats):
            rate, ok = import_rate(mirror, instances, tmp / f"listed{r}", derive=False)
            assert ok == len(instances), f"only {ok} of {len(instances)} accepted"
            listed.append(rate)
            rate, ok = import_rate(mirror, instances, tmp / f"derived{r}", derive=True)
            assert ok == len(instances), f"only {ok} of {len(instances)} accepted (derived)"
            derived.append(rate)
    med = statistics.median
    cmd = " ".join(["benchmarks/tasks_import.py", *sys.argv[1:]])
    md = "\n".join([
        "## Task import and task environments (`benchmarks/tasks_import.py`)", "",
        f"Reproduce: `.venv/bin/python {cmd}` — medians of {args.repeats} runs; a SWE-smith mirror in the "
        f"published layout with {args.instances} instances, each imported and then put through every gate "
        "(gold, noop and determinism graded in sandboxes).", "",
        "| | median |", "|---|---|",
        f"| import + gates, F2P/P2P from the instances | {med(listed):.1f} tasks/min |",
        f"| import + gates, F2P/P2P derived (suite run at bug and gold) | {med(derived):.1f} tasks/min |",
        f"| task environment (pytest), cold: venv + pip install | {med(cold):.2f} s |",
        f"| task environment, cached | {med(cached) * 1000:.2f} ms |",
        f"| cold / cached | {med(cold) / med(cached):.0f}x |", ""])
    print(md)
    if not args.quick:
        write_section(ROOT / "docs" / "benchmarks.md", "tasks-import", md)


if __name__ == "__main__":
    os.environ.setdefault("OPENCOMPOSER_STATE", tempfile.mkdtemp(prefix="oc-bench-state-"))
    main()
