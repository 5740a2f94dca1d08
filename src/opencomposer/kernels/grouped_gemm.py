"""Grouped GEMMs over experts with variable token counts, in bf16 and the low-precision formats
(report §6.1; Cursor's MXFP8 MoE kernels blog): the forward product (Fprop) and the two backward
products (Dgrad: gradient of the input, Wgrad: gradient of the weights).

Layouts follow `nn.Linear`: tokens `x` (N, K) sorted by expert with cumulative `offsets` (G,)
int32, weights `w` (G, M, K). Each operand is quantised along the product's reduction dimension —
K for Fprop, M for Dgrad, the tokens of each expert for Wgrad (blocks never straddle experts) —
then multiplied. This pure-torch path emulates the kernels exactly up to float32 accumulation
order: a fused GPU kernel multiplies the FP8/FP4 values and applies the same scales. A Triton path
for Hopper is the GPU issue's work (`benchmarks/kernels_gpu.py` when a GPU is lent).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opencomposer.kernels.mx import FormatError, quantize_mx, quantize_nvfp4

FMTS = ("fp32", "bf16", "mxfp8", "nvfp4")


def qdq(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantise along the last dimension and dequantise (float32 result)."""
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


def fprop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fmt: str) -> torch.Tensor:
    """y (N, M) = x_g @ w_g^T per expert; both quantised along K."""
    return _mm(qdq(x, fmt), qdq(w, fmt).transpose(1, 2), offsets)


def dgrad(dy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fmt: str) -> torch.Tensor:
    """dx (N, K) = dy_g @ w_g; both quantised along M."""
    return _mm(qdq(dy, fmt), qdq(w.transpose(1, 2).contiguous(), fmt).transpose(1, 2).contiguous(), offsets)


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


def reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """float64 Fprop, for error measurements."""
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        out.append(x[start:end].double() @ w[e].double().T)
        start = end
    return torch.cat(out)


class LowPrecisionExperts(torch.autograd.Function):
    """The SwiGLU experts with their forward in `fwd` and their backward in `bwd` (report §6.1:
    NVFP4 with per-token scales forward, MXFP8 backward)."""

    @staticmethod
    def forward(ctx, x, offsets, gate_up, down, fwd: str, bwd: str):
        h = fprop(x, gate_up, offsets, fwd)
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
        y = fprop(a, down, offsets, fwd)
        ctx.save_for_backward(x, offsets, gate_up, down, g, u, a)
        ctx.bwd = bwd
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, offsets, gate_up, down, g, u, a = ctx.saved_tensors
        fmt = ctx.bwd
        dy = dy.contiguous().float()
        d_a = dgrad(dy, down, offsets, fmt)
        d_down = wgrad(a, dy, offsets, fmt)
        s = torch.sigmoid(g)
        d_g = d_a * u * s * (1 + g * (1 - s))
        d_u = d_a * F.silu(g)
        dh = torch.cat([d_g, d_u], dim=-1)
        dx = dgrad(dh, gate_up, offsets, fmt)
        d_gate_up = wgrad(x, dh, offsets, fmt)
        return dx.to(x.dtype), None, d_gate_up.to(gate_up.dtype), d_down.to(down.dtype), None, None


def experts_backend(fwd: str, bwd: str):
    """An expert backend for `model/moe.py`'s EXPERT_BACKENDS seam."""
    def run(x, offsets, gate_up, down):
        return LowPrecisionExperts.apply(x, offsets, gate_up, down, fwd, bwd)
    return run
