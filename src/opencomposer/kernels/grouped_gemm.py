"""Grouped GEMMs over experts with variable token counts, in bf16 and the low-precision formats
(report §6.1; Cursor's MXFP8 MoE kernels blog): the forward product (Fprop) and the two backward
products (Dgrad: gradient of the input, Wgrad: gradient of the weights).

Layouts follow `nn.Linear`: tokens `x` (N, K) sorted by expert with cumulative `offsets` (G,)
int32, weights `w` (G, M, K). Each operand is quantised along the product's reduction dimension —
K for Fprop, M for Dgrad, the tokens of each expert for Wgrad (blocks never straddle experts) —
then multiplied. This pure-torch path emulates the kernels exactly up to float32 accumulation
order: the Triton kernels (`triton_gemm`) multiply the FP8/FP4 values and apply the same scales.
`fp8-block` quantises activations in 1x128 tiles and weights in 128x128 blocks (DeepSeek-V3).

`LowPrecisionExperts` runs on the Triton kernels when the tensors are on a GPU (`kernel="auto"`)
and on this emulation elsewhere; `kernel="triton"` forces the kernels, which on a CPU means
Triton's interpreter (the tests use it to check the whole layer).
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
import torch.nn.functional as F

from opencomposer.kernels.mx import FormatError, quantize_fp8_block, quantize_mx, quantize_nvfp4

FMTS = ("fp32", "bf16", "mxfp8", "nvfp4", "fp8-block")
KERNELS = ("auto", "torch", "triton")
# relative Frobenius error of a product against float64 that each format must stay within
# (kernels.md measures ~0.3% for bf16, ~4% for FP8/MXFP8, ~14% for NVFP4 on Gaussian data)
BOUNDS = {"bf16": 0.005, "mxfp8": 0.045, "fp8-block": 0.045, "nvfp4": 0.15}
TRITON_FMTS = ("mxfp8", "nvfp4", "fp8-block")  # bf16 and fp32 are torch's own grouped_mm


def qdq(x: torch.Tensor, fmt: str, weight: bool = False) -> torch.Tensor:
    """Quantise along the last dimension and dequantise (float32 result). `weight` selects the
    weights' tiling where it differs from the activations' (128x128 blocks for fp8-block)."""
    if fmt == "fp8-block":
        return quantize_fp8_block(x, rows=128 if weight else 1).dequantize()
    if fmt == "fp32":
        return x.float()
    if fmt == "bf16":
        return x.to(torch.bfloat16).float()
    if fmt == "mxfp8":
        return quantize_mx(x, "e4m3").dequantize()
    if fmt == "nvfp4":
        return quantize_nvfp4(x.reshape(-1, x.shape[-1])).dequantize().reshape(x.shape)
    raise FormatError(f"unknown format {fmt!r} (have {FMTS})")


def _mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(a.contiguous(), b, offs=offsets)
    out, start = [], 0
    for g, end in enumerate(offsets.tolist()):
        out.append(a[start:end] @ b[g])
        start = end
    return torch.cat(out)


def fprop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fmt: str,
          index: torch.Tensor | None = None) -> torch.Tensor:
    """y (N, M) = x[index]_g @ w_g^T per expert; both quantised along K."""
    x = x if index is None else x[index]
    return _mm(qdq(x, fmt), qdq(w, fmt, weight=True).transpose(1, 2), offsets)


def dgrad(dy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fmt: str) -> torch.Tensor:
    """dx (N, K) = dy_g @ w_g; both quantised along M."""
    wt = qdq(w.transpose(1, 2).contiguous(), fmt, weight=True)
    return _mm(qdq(dy, fmt), wt.transpose(1, 2).contiguous(), offsets)


def wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, fmt: str) -> torch.Tensor:
    """dw (G, M, K) = dy_g^T @ x_g per expert; both quantised along that expert's tokens."""
    g = offsets.numel()
    out = x.new_zeros(g, dy.shape[1], x.shape[1], dtype=torch.float32)
    start = 0
    for e, end in enumerate(offsets.tolist()):  # a loop over experts (never over tokens)
        if end > start:
            out[e] = qdq(dy[start:end].T.contiguous(), fmt) @ qdq(x[start:end].T.contiguous(), fmt).T
        start = end
    return out


def reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
              dy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The products in float64, for error measurements: "fprop", and with `dy` also "dgrad" and
    "wgrad"."""
    ends = offsets.tolist()
    spans = list(zip([0, *ends[:-1]], ends))
    xd, wd = x.double(), w.double()
    out = {"fprop": torch.cat([xd[a:b] @ wd[e].T for e, (a, b) in enumerate(spans)])}
    if dy is not None:
        dyd = dy.double()
        out["dgrad"] = torch.cat([dyd[a:b] @ wd[e] for e, (a, b) in enumerate(spans)])
        out["wgrad"] = torch.stack([dyd[a:b].T @ xd[a:b] for a, b in spans])
    return out


def products(kernel: str, fmt: str, device: torch.device) -> ModuleType:
    """The module whose fprop/dgrad/wgrad (same signatures in both) run `fmt` on `kernel`:
    `triton_gemm` on a GPU (or when forced), this emulation otherwise."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if fmt in TRITON_FMTS and (kernel == "triton" or (kernel == "auto" and device.type == "cuda")):
        from opencomposer.kernels import triton_gemm  # imports triton: only when used

        return triton_gemm
    return sys.modules[__name__]


class LowPrecisionExperts(torch.autograd.Function):
    """The SwiGLU experts over the rows `token` of `x` (sorted by expert, cumulative `offsets`),
    with their forward in `fwd` and their backward in `bwd` (report §6.1: NVFP4 with per-token
    scales forward, MXFP8 backward). The gather of rows is fused into the first quantiser on the
    Triton path; only `x` and `token` are kept for the backward, not the gathered copy."""

    @staticmethod
    def forward(ctx, x, token, offsets, gate_up, down, fwd: str, bwd: str, kernel: str = "auto"):
        ops = products(kernel, fwd, x.device)
        h = ops.fprop(x, gate_up, offsets, fwd, index=token)  # the quantisers read x in its own dtype
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
        y = ops.fprop(a, down, offsets, fwd)
        ctx.save_for_backward(x, token, offsets, gate_up, down, g, u, a)
        ctx.bwd, ctx.kernel = bwd, kernel
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, token, offsets, gate_up, down, g, u, a = ctx.saved_tensors
        ops, fmt = products(ctx.kernel, ctx.bwd, dy.device), ctx.bwd
        dy = dy.contiguous().float()
        d_a = ops.dgrad(dy, down, offsets, fmt)
        d_down = ops.wgrad(a, dy, offsets, fmt)
        s = torch.sigmoid(g)
        d_g = d_a * u * s * (1 + g * (1 - s))
        d_u = d_a * F.silu(g)
        dh = torch.cat([d_g, d_u], dim=-1)
        dx_sorted = ops.dgrad(dh, gate_up, offsets, fmt)
        d_gate_up = ops.wgrad(x[token], dh, offsets, fmt)
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, dx_sorted)
        return (dx.to(x.dtype), None, None, d_gate_up.to(gate_up.dtype), d_down.to(down.dtype),
                None, None, None)


def experts_backend(fwd: str, bwd: str, kernel: str = "auto"):
    """An expert backend for `model/moe.py`'s EXPERT_BACKENDS seam:
    fn(x (T, D), token (N,), offsets (E,), gate_up, down) -> (N, D)."""
    def run(x, token, offsets, gate_up, down):
        return LowPrecisionExperts.apply(x, token, offsets, gate_up, down, fwd, bwd, kernel)
    return run
