"""The Triton quantisers and grouped GEMMs, run under Triton's interpreter on the CPU at small
sizes: the quantisers bit-identical to the pure-torch ones (gathered rows included: the fused
permute + quantise), the products equal to the emulation up to float32 summation order, and the
whole low-precision MoE layer on the kernels equal to the layer on the emulation."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU interpreter (tests/conftest.py sets it first)
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from opencomposer.kernels import grouped_gemm as gg  # noqa: E402
from opencomposer.kernels import mx  # noqa: E402
from opencomposer.kernels import triton_gemm as tg  # noqa: E402
from opencomposer.kernels.triton_quant import quantize_rows  # noqa: E402

TILES = {"bm": 32, "bn": 32}
TORCH_QUANT = {"mxfp8": mx.quantize_mx, "mxfp8-e5m2": lambda x: mx.quantize_mx(x, "e5m2"),
               "fp8-block": mx.quantize_fp8_block, "nvfp4": mx.quantize_nvfp4}


def problem(k=80):
    g = torch.Generator().manual_seed(0)
    counts = [24, 0, 40, 9]  # variable counts, one empty expert, K not a multiple of any block
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), k, generator=g)
    w = torch.randn(4, 40, k, generator=g)
    dy = torch.randn(sum(counts), 40, generator=g)
    return x, w, dy, offsets


def close(a, b, tol=1e-5):
    return float((a - b).abs().max() / b.abs().max()) < tol


@pytest.mark.parametrize("fmt", sorted(TORCH_QUANT))
def test_quantiser_is_bit_identical_to_torch_including_gathered_rows(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 136, generator=g) * torch.logspace(-6, 6, 40)[:, None]
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 17.0, 1.5 * 2.0 ** -9, 464.0, 1e30, -0.0])
    x[3, :8] = special
    x[4] = 0.0                                                      # an all-zero row
    x[5, 16:48] = (torch.arange(32) + 0.5) * 2.0 ** -9              # E4M3 subnormal ties in one block
    got, want = quantize_rows(x, fmt), TORCH_QUANT[fmt](x)
    assert mx.identical(got.q.float(), want.q.float()) and torch.equal(got.scale, want.scale)
    if want.q.dtype == got.q.dtype:  # float8 from both: the same bits, signed zeros included
        finite = ~want.q.float().isnan()
        assert torch.equal(got.q.view(torch.uint8)[finite], want.q.view(torch.uint8)[finite])
    if fmt == "nvfp4":
        assert torch.equal(got.token_scale, want.token_scale)
    assert got.q[3, 0].float().isnan() and got.q[3, 1].float() == got.q.float().nan_to_num().max()
    index = torch.tensor([7, 3, 3, 0, 39, 5])                     # a permutation with repeats
    got, want = quantize_rows(x, fmt, index=index), TORCH_QUANT[fmt](x[index])
    assert mx.identical(got.q.float(), want.q.float()) and torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("fmt", tg.FORMATS)
def test_fprop_dgrad_wgrad_match_the_emulation(fmt):
    x, w, dy, offs = problem()
    assert close(tg.fprop(x, w, offs, fmt, **TILES), gg.fprop(x, w, offs, fmt))
    index = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(2))
    assert close(tg.fprop(x, w, offs, fmt, index=index, **TILES), gg.fprop(x[index], w, offs, fmt))
    assert close(tg.dgrad(dy, w, offs, fmt, **TILES), gg.dgrad(dy, w, offs, fmt))
    got = tg.wgrad(x, dy, offs, fmt, **TILES)
    assert close(got, gg.wgrad(x, dy, offs, fmt)) and (got[1] == 0).all()
    none = tg.wgrad(x[:0], dy[:0], torch.zeros(4, dtype=torch.int32), fmt, **TILES)   # no tokens at all
    assert none.shape == (4, 40, 80) and (none == 0).all()


def test_the_moe_layer_on_the_kernels_equals_the_layer_on_the_emulation():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 32, generator=g, requires_grad=True)
    idx = torch.randint(0, 3, (20, 2), generator=g)              # top-2 of 3 experts
    order = idx.reshape(-1).argsort(stable=True)
    token = order // 2
    offs = torch.bincount(idx.reshape(-1), minlength=3).cumsum(0).to(torch.int32)
    gate_up = torch.randn(3, 48, 32, generator=g, requires_grad=True)
    down = torch.randn(3, 32, 24, generator=g, requires_grad=True)
    up = torch.randn(40, 32, generator=g)
    runs = {}
    for kernel in ("torch", "triton"):
        y = gg.experts_backend("nvfp4", "mxfp8", kernel=kernel)(x, token, offs, gate_up, down)
        (y * up).sum().backward()
        runs[kernel] = (y.detach(), x.grad, gate_up.grad, down.grad)
        x.grad = gate_up.grad = down.grad = None
    (y, dx, d_gate_up, d_down), want = runs["triton"], runs["torch"]
    assert close(y, want[0], 1e-4) and close(d_down, want[3], 1e-4)
    # dx and d_gate_up pass through SwiGLU's derivative of the forward's h, which differs between
    # the two by float32 summation order (~1e-7); re-quantising it to MXFP8 can then round a few
    # elements to the neighbouring FP8 value. A wrong kernel would be off by far more.
    for got, ref in ((dx, want[1]), (d_gate_up, want[2])):
        assert float((got - ref).norm() / ref.norm()) < 1e-2


def test_bad_input_is_refused():
    x, w, _, offs = problem()
    with pytest.raises(ValueError, match="disagree"):
        tg.grouped(quantize_rows(x), tg.quantize_experts(w[:, :, :40].contiguous(), "mxfp8"), offs)
    with pytest.raises(ValueError, match="disagree"):  # formats must match
        tg.grouped(quantize_rows(x, "fp8-block"), tg.quantize_experts(w, "mxfp8"), offs)
    with pytest.raises(mx.FormatError, match="unknown format"):
        quantize_rows(x, "int4")
    with pytest.raises(IndexError, match="out of range"):
        quantize_rows(x, index=torch.tensor([0, x.shape[0]]))
    with pytest.raises(mx.FormatError, match="not 'bf16'"):
        tg.fprop(x, w, offs, "bf16")
    with pytest.raises(ValueError, match="kernel must be"):
        gg.experts_backend("mxfp8", "mxfp8", kernel="cuda")(x, torch.arange(x.shape[0]), offs, w, w)
