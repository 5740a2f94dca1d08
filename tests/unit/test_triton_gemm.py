"""The Triton MXFP8 grouped GEMM, run under Triton's interpreter on the CPU at small sizes, against
the pure-torch emulation (the same quantised operands; only float32 summation order differs)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton compiles anything: the CPU interpreter
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from opencomposer.kernels import grouped_gemm as gg  # noqa: E402
from opencomposer.kernels import triton_gemm as tg  # noqa: E402


def problem(k=80):
    g = torch.Generator().manual_seed(0)
    counts = [40, 0, 70, 18]  # variable counts, one empty expert, K not a multiple of 32
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), k, generator=g)
    w = torch.randn(4, 48, k, generator=g)
    dy = torch.randn(sum(counts), 48, generator=g)
    return x, w, dy, offsets


def close(a, b):
    return float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_fprop_dgrad_wgrad_match_the_emulation():
    x, w, dy, offs = problem()
    tiles = {"bm": 16, "bn": 16}
    assert close(tg.fprop(x, w, offs, **tiles), gg.fprop(x, w, offs, "mxfp8"))
    assert close(tg.dgrad(dy, w, offs, **tiles), gg.dgrad(dy, w, offs, "mxfp8"))
    got = tg.wgrad(x, dy, offs, **tiles)
    assert close(got, gg.wgrad(x, dy, offs, "mxfp8")) and (got[1] == 0).all()


def test_disagreeing_operands_are_refused():
    from opencomposer.kernels.mx import quantize_mx

    x, w, _, offs = problem()
    with pytest.raises(ValueError, match="disagree"):
        tg.mx_grouped(quantize_mx(x), quantize_mx(w[:, :, :40]), offs)
