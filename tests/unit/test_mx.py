"""MX formats: bit-exact against float64 references on random and adversarial inputs, defined
behaviour on bad input, batch invariance of per-token NVFP4, and the error bounds of kernels.md."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.kernels.mx import (  # noqa: E402
    FormatError,
    quantize_fp8_block,
    quantize_fp8_block_ref,
    quantize_mx,
    quantize_mx_ref,
    quantize_nvfp4,
    quantize_nvfp4_ref,
    round_to_format,
    round_to_format_ref,
)


def adversarial(fmt_max: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(4096, generator=g) * s for s in (1e-3, 1.0, 30.0, 1e3)]
    grid = torch.arange(-64, 64, dtype=torch.float32)
    ties = (grid + 0.5) * 2.0 ** -9                                  # E4M3 subnormal ties
    ties2 = torch.tensor([17.0, 19.0, 9.5, 10.5, 0.25, 0.75, 2.5, 5.0, 464.0, 480.0, -464.0, 5e4, 6e4])
    tiny = torch.tensor([2.0 ** -10, 3 * 2.0 ** -10, 1e-30, -1e-30, 0.0, -0.0])
    out = torch.tensor([fmt_max, -fmt_max, fmt_max * 1.03, 1e30, -1e30])
    return torch.cat(parts + [ties, ties2, tiny, out])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_element_rounding_is_bit_exact(fmt):
    fmax = {"e4m3": 448.0, "e5m2": 57344.0, "e2m1": 6.0}[fmt]
    x = adversarial(fmax)
    fast = round_to_format(x, fmt).float()
    ref = round_to_format_ref(x, fmt).float()
    assert torch.equal(fast, ref)
    assert fast.abs().max() == fmax                     # saturates, never Inf
    nan = round_to_format(torch.tensor([float("nan")]), fmt).float()
    assert torch.isnan(nan).all()


def test_known_values():
    assert round_to_format(torch.tensor([464.0, 2.0 ** -10, 3 * 2.0 ** -10]), "e4m3").float().tolist() == \
        [448.0, 0.0, 2.0 ** -8]                         # saturation, ties to even at the subnormal end
    assert round_to_format(torch.tensor([0.25, 0.75, 2.5, 5.0, 7.0]), "e2m1").tolist() == [0.0, 1.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_mxfp8_matches_its_reference(fmt, rounding):
    x = adversarial(448.0)[: 32 * 500].reshape(50, 320)
    x[3, 5] = float("nan")
    x[7, 40] = float("inf")
    mx = quantize_mx(x, fmt, scale_rounding=rounding)
    q, scale = quantize_mx_ref(x, fmt, scale_rounding=rounding)
    assert torch.equal(mx.scale.double(), scale)
    a, b = mx.q.float().double(), q
    assert torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
    deq = mx.dequantize()
    assert torch.isnan(deq[3, 5]) and not torch.isnan(deq[3, 4])   # NaN stays in its element
    assert torch.isfinite(deq[7, 40])                                # Inf saturates
    # ceil scales never overflow: every finite element is off by at most half a step of its format
    if rounding == "ceil":
        finite = torch.isfinite(x)
        rel = {"e4m3": 2 ** -4, "e5m2": 2 ** -3}[fmt]
        assert ((deq - x).abs()[finite] <= x.abs()[finite] * rel * 1.0001
                + mx.scale.repeat_interleave(32, -1)[finite] * 2 ** -9).all()


def test_padding_and_zero_blocks():
    x = torch.randn(3, 45)
    x[1] = 0.0
    mx = quantize_mx(x)
    assert mx.q.shape == (3, 64) and mx.dequantize().shape == (3, 45)
    assert (mx.dequantize()[1] == 0).all() and (mx.scale[1] == 2.0 ** -127).all()
    nv = quantize_nvfp4(x)
    assert nv.dequantize().shape == (3, 45) and (nv.dequantize()[1] == 0).all()
    with pytest.raises(FormatError):
        quantize_mx(x, "e2m1")
    with pytest.raises(FormatError):
        quantize_mx(x, scale_rounding="nearest")


def test_nvfp4_matches_its_reference_and_is_batch_invariant():
    x = adversarial(448.0)[: 16 * 600].reshape(60, 160)
    x[3, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 17.0])   # Inf saturates
    nv = quantize_nvfp4(x)
    q, bscale, token = quantize_nvfp4_ref(x)
    assert torch.equal(torch.nan_to_num(nv.q.double(), nan=7.0), torch.nan_to_num(q, nan=7.0))
    assert torch.equal(nv.scale.double(), bscale) and torch.equal(nv.token_scale.double(), token)
    assert nv.q[3, 0].isnan() and nv.q[3, 1] == 6.0 and nv.q[3, 2] == -6.0
    # a token's quantisation does not depend on the other tokens in the batch
    alone = quantize_nvfp4(x[17:18]).dequantize()
    assert torch.equal(alone[0], nv.dequantize()[17])
    other = x.clone()
    other[:17] *= 1000.0
    assert torch.equal(quantize_nvfp4(other).dequantize()[17], nv.dequantize()[17])


@pytest.mark.parametrize("rows", [1, 128])
def test_fp8_blocks_match_their_reference(rows):
    adv = adversarial(448.0)
    x = torch.cat([adv, adv.flip(0) * 0.37])[: 200 * 136].reshape(200, 136)  # neither a multiple of 128
    x[3, 5], x[7, 40], x[150:] = float("nan"), float("inf"), 0.0
    fb = quantize_fp8_block(x, rows=rows)
    q, scale = quantize_fp8_block_ref(x, rows=rows)
    assert fb.scale.shape == ((200, 2) if rows == 1 else (2, 2))
    assert torch.equal(fb.scale.double(), scale)
    assert torch.equal(torch.nan_to_num(fb.q.float().double(), nan=7.0), torch.nan_to_num(q, nan=7.0))
    deq = fb.dequantize()
    assert deq.shape == x.shape and torch.isnan(deq[3, 5]) and torch.isfinite(deq[7, 40])
    if rows == 1:
        assert (fb.scale[150:] == 1.0).all() and (deq[150:] == 0).all()   # all-zero tiles


def test_fp8_weight_blocks_serve_the_transpose():
    """A 128x128 block holds the same values whichever way it is read, so the backward's W^T needs
    no second quantisation (the reason DeepSeek-V3 tiles weights this way); 1x32 MX blocks do."""
    w = torch.randn(3, 256, 384, generator=torch.Generator().manual_seed(5))
    assert torch.equal(quantize_fp8_block(w, rows=128).dequantize().transpose(1, 2),
                       quantize_fp8_block(w.transpose(1, 2), rows=128).dequantize())
    assert not torch.equal(quantize_mx(w).dequantize().transpose(1, 2), quantize_mx(w.transpose(1, 2)).dequantize())
    with pytest.raises(FormatError, match="1x128 or 128x128"):
        quantize_fp8_block(w, rows=32)


@pytest.mark.parametrize("fmt,bound", [("mxfp8", 0.045), ("nvfp4", 0.15)])
def test_gemm_error_within_kernels_md_bounds(fmt, bound):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 1024, generator=g), torch.randn(1024, 128, generator=g)
    ref = a.double() @ b.double()
    if fmt == "mxfp8":
        qa, qb = quantize_mx(a).dequantize(), quantize_mx(b.T.contiguous()).dequantize().T
    else:
        qa, qb = quantize_nvfp4(a).dequantize(), quantize_nvfp4(b.T.contiguous()).dequantize().T
    err = ((qa.double() @ qb.double()) - ref).norm() / ref.norm()
    assert err < bound, float(err)
