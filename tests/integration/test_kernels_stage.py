"""The kernels stage (speedrun and `opencomposer kernels check`): quantisers exact, GEMM errors
within bounds, a tiny MoE trained per backend that learns and tracks float32, and its report; and
the GPU check script's smoke mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")


def test_kernels_check_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "kernels", "check", f"--out={tmp_path}",
                        "--steps=30", '--backends=["torch", "nvfp4", "fp8-block"]'],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = list(tmp_path.iterdir())
    s = json.loads((run / "kernels" / "summary.json").read_text())
    assert s["kernels"] == "emulation" and s["device"] == "cpu"
    assert s["quantisers_exact"] == {"mxfp8": True, "fp8-block": True, "nvfp4": True}
    errs = s["gemm_errors"]
    assert all(e["within"] for e in errs.values())
    assert errs["bf16"]["fprop"] < errs["mxfp8"]["fprop"] < errs["nvfp4"]["fprop"]   # the formats' order
    t = s["training"]
    for name, rec in t.items():
        assert rec["losses"][-1] < 0.8 * rec["losses"][0], name                     # each backend learns
    assert t["torch"]["heldout_vs_float32"] == 0.0
    assert abs(t["nvfp4"]["heldout_vs_float32"]) < 0.05 and abs(t["fp8-block"]["heldout_vs_float32"]) < 0.05
    svg = (run / "kernels" / "loss.svg").read_text()
    assert svg.count("<polyline") == 3 and "fp8-block" in svg
    assert "## Low-precision MoE kernels" in r.stdout and "nvfp4 / mxfp8" in r.stdout


def test_kernels_check_refuses_an_unknown_backend(tmp_path):
    r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "kernels", "check", f"--out={tmp_path}",
                        '--backends=["torch", "int3"]'], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "int3" in r.stderr and "not registered" in r.stderr


def test_gpu_check_script_runs_its_smoke_mode_on_the_cpu():
    """benchmarks/kernels_gpu.py is the only thing a lent GPU runs, on a budget of minutes: its own
    plumbing (every check, sweep, timing and the table) must work before it gets there. The smoke
    mode runs it at toy sizes under Triton's interpreter and writes nothing to docs/."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    before = (root / "docs" / "benchmarks.md").read_text()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-W", "ignore", "kernels_gpu.py", "--cpu-smoke"], cwd=root / "benchmarks",
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    checks = [line for line in r.stdout.splitlines() if line.startswith("| ") and line.endswith(" |")
              and ("==" in line)]
    assert len(checks) == 11 and all(line.endswith("| yes |") for line in checks), "\n".join(checks)
    assert "0 errors." in r.stdout and "Fused permute + quantise" in r.stdout
    assert (root / "docs" / "benchmarks.md").read_text() == before
