"""The Triton kernels compiled ahead of time for Hopper (sm_90) and Blackwell (sm_100) on this
GPU-less machine, and their PTX inspected (`triton_ptx.py`, in its own process): the grouped GEMMs
reach the tensor cores in the intended precision, and the quantisers divide with IEEE
round-to-nearest (`div.rn.f32`), never the approximate `div.full.f32` that Triton's `/` compiles
to — the kind of division report §6.1 saw diverge after about a hundred RL steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def ptx() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_ptx.py"))], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def divisions(words: list[str]) -> set[str]:
    return {w for w in words if w.startswith("div.")}


@pytest.mark.parametrize("fmt,mma", [("mxfp8", "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"),
                                     ("fp8-block", "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"),
                                     ("nvfp4", "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16")])
def test_grouped_gemms_use_hopper_tensor_cores_in_their_precision(ptx, fmt, mma):
    assert mma in ptx[f"gemm/{fmt}/sm_90"]
    if fmt != "nvfp4":  # the one-launch Wgrad too
        assert mma in ptx[f"wgrad/{fmt}/sm_90"]


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8-block"])
def test_fp8_gemms_use_blackwell_fp8_tensor_cores(ptx, fmt):
    for kernel in ("gemm", "wgrad"):
        assert any(w.startswith("tcgen05.mma") and "f8f6f4" in w for w in ptx[f"{kernel}/{fmt}/sm_100"])


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp8-e5m2", "fp8-block", "nvfp4"])
def test_quantisers_divide_exactly(ptx, fmt):
    # MXFP8 divides by a power of two, done exactly as a multiplication: no division instruction
    assert divisions(ptx[f"quant/{fmt}/sm_90"]) == (set() if fmt.startswith("mxfp8") else {"div.rn.f32"})


def test_plain_division_would_be_approximate(ptx):
    """The control: why the quantisers spell out `tl.math.div_rn`."""
    assert divisions(ptx["plain-division/sm_90"]) == {"div.full.f32"}
