"""The speedrun's sandbox stage: prove isolation on this machine and show snapshot/fork on real code.

It builds a workspace from real code with its real tests (the standard library's `json` package
and its `test_json` suite, copied out of this Python's installation), runs the suite in a sandbox,
forks the sandbox, breaks the code in one child and not the other, and shows that the two diverge
while the parent is untouched. It also measures create+exec latency and fork time, and records the
doctor's checks. Everything goes to `<run>/sandbox/summary.json` for the report card.
"""

from __future__ import annotations

import shutil
import statistics
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.core.metrics import MetricsWriter
from opencomposer.core.rundir import RunDir
from opencomposer.sandbox import doctor
from opencomposer.sandbox.base import SandboxConfig
from opencomposer.sandbox.local import Workspace


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxStageConfig:
    enabled: bool = True
    latency_samples: int = 20
    """create+exec `true` repetitions for the latency figures."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def make_json_workspace(dest: Path) -> Path:
    """Copy the stdlib `json` package and its test suite into `dest` (real code, real tests)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    src_pkg, src_tests = stdlib / "json", stdlib / "test" / "test_json"
    if not src_tests.is_dir():
        raise FileNotFoundError(f"this Python has no test suite at {src_tests}")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(src_pkg, dest / "json", ignore=ignore)
    shutil.copytree(src_tests, dest / "test_json", ignore=ignore)
    return dest


# The suite's package __init__ only loads inside the stdlib's `test` package, so name the modules.
TEST_CMD = "python -m unittest $(ls test_json/test_*.py | sed 's/[.]py$//; s#/#.#g') 2>&1 | tail -3"
#: The bug planted in one fork: the pure-Python string encoder stops quoting and escaping.
BREAK = ("return '\"' + ESCAPE.sub(replace, s) + '\"'", "return s")


def run(cfg: SandboxStageConfig, run_dir: RunDir, metrics: MetricsWriter, progress=None) -> dict:
    summary: dict = {}
    checks = doctor.run_checks()
    summary["doctor"] = doctor.as_dicts(checks)
    summary["isolation_ok"] = all(c.enforced for c in checks)
    with tempfile.TemporaryDirectory(prefix="oc-speedrun-ws-") as tmp:
        src = make_json_workspace(Path(tmp))
        with Workspace(src, cfg.sandbox) as ws:
            summary["layers"] = ws.mode
            with ws.sandbox() as parent:
                t0 = time.perf_counter()
                base = parent.exec(TEST_CMD, timeout_s=300)
                summary["tests_in_sandbox"] = {"ok": "OK" in base.stdout, "tail": base.stdout.strip(),
                                               "seconds": time.perf_counter() - t0}
                t0 = time.perf_counter()
                broken, clean = parent.fork(2)
                summary["fork_seconds"] = time.perf_counter() - t0
                with broken, clean:
                    code = broken.read_file("json/encoder.py").decode()
                    if BREAK[0] not in code:
                        raise RuntimeError("json/encoder.py changed upstream; update stage.BREAK")
                    broken.write_file("json/encoder.py", code.replace(BREAK[0], BREAK[1], 1))
                    r_broken = broken.exec(TEST_CMD, timeout_s=300)
                    r_clean = clean.exec(TEST_CMD, timeout_s=300)
                    summary["fork_demo"] = {
                        "broken_child_fails": "FAILED" in r_broken.stdout,
                        "clean_child_passes": "OK" in r_clean.stdout,
                        "broken_tail": r_broken.stdout.strip(),
                        "clean_tail": r_clean.stdout.strip(),
                        "parent_unchanged": (src / "json" / "encoder.py").read_bytes()
                        == parent.read_file("json/encoder.py"),
                    }
            lat = []
            for _ in range(cfg.latency_samples):
                t0 = time.perf_counter()
                with ws.sandbox() as sb:
                    sb.exec("true")
                lat.append((time.perf_counter() - t0) * 1000)
                if progress is not None:
                    progress()
            lat.sort()
            summary["create_exec_ms"] = {"p50": statistics.median(lat), "p95": lat[int(0.95 * (len(lat) - 1))]}
    metrics.log(stage="sandbox", create_exec_p50_ms=summary["create_exec_ms"]["p50"],
                fork_s=summary["fork_seconds"], isolation_ok=summary["isolation_ok"])
    run_dir.write_json("sandbox/summary.json", summary)
    return summary
