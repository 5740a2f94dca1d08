"""The kernels stage (speedrun and `opencomposer kernels check`): quantisers exact, GEMM errors
within bounds, a tiny MoE trained per backend that learns and tracks float32, and its report."""

from __future__ import annotations

import json
import subprocess
import sys

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
