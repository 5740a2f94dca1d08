"""Triton grouped GEMM with MXFP8 operands: FP8 E4M3 tiles multiplied by the tensor cores, block
scales applied in the kernel after each 32-deep K step (the DeepGEMM pattern for Hopper, which has
no native MX instructions: `acc += dot(a, b) * (scale_a * scale_b)`).

One kernel computes C[rows, cols] = sum_k A[rows, k] * B[g, cols, k] over experts g with variable
row counts, where A and B carry one E8M0-valued scale per 32 elements along k. Fprop is
(x, W); Dgrad is (dy quantised along M, W^T quantised along M); Wgrad runs the same kernel once
per expert on (dy_g^T, x_g^T), both quantised along that expert's tokens. On a CPU the kernel runs
under Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported), which is
how the tests check it against the pure-torch emulation at small sizes; on a GPU it compiles to
FP8 wgmma (sm_90).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opencomposer.kernels.mx import MXTensor, quantize_mx

BLOCK = 32


@triton.jit
def _mx_grouped_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, offs_ptr, K, M,
                       stride_am, stride_sam, stride_bg, stride_bm, stride_sbg, stride_sbm, stride_cm,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    g = tl.program_id(0)
    pm = tl.program_id(1)
    pn = tl.program_id(2)
    start = tl.where(g == 0, 0, tl.load(offs_ptr + g - 1, mask=g > 0, other=0))
    end = tl.load(offs_ptr + g)
    rows = start + pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rmask = rows < end
    cmask = cols < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ks = kb * BK + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=rmask[:, None], other=0.0)
        b = tl.load(b_ptr + g * stride_bg + cols[None, :] * stride_bm + ks[:, None], mask=cmask[None, :], other=0.0)
        sa = tl.load(sa_ptr + rows * stride_sam + kb, mask=rmask, other=0.0)
        sb = tl.load(sb_ptr + g * stride_sbg + cols * stride_sbm + kb, mask=cmask, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


def mx_grouped(qa: MXTensor, qb: MXTensor, offsets: torch.Tensor, *, bm: int = 64, bn: int = 64) -> torch.Tensor:
    """C (N, M) from A (N, K) and B (G, M, K), both MXFP8-quantised along K (padded to 32)."""
    a, sa, b, sb = qa.q.contiguous(), qa.scale.contiguous(), qb.q.contiguous(), qb.scale.contiguous()
    n, kp = a.shape
    g, m, kb = b.shape
    if kb != kp or qa.block != BLOCK or qb.block != BLOCK:
        raise ValueError(f"operands disagree: A has K={kp}, B has K={kb} (blocks of {qa.block}/{qb.block})")
    c = torch.zeros(n, m, dtype=torch.float32, device=a.device)
    counts = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1).to(torch.int64))
    rows = int(counts.max()) if counts.numel() else 0
    if n == 0 or rows == 0:
        return c
    grid = (g, triton.cdiv(rows, bm), triton.cdiv(m, bn))
    _mx_grouped_kernel[grid](a, sa, b, sb, c, offsets.to(torch.int32).contiguous(), kp, m,
                             a.stride(0), sa.stride(0), b.stride(0), b.stride(1), sb.stride(0), sb.stride(1),
                             c.stride(0), BM=bm, BN=bn, BK=BLOCK)
    return c


def fprop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, **tiles) -> torch.Tensor:
    return mx_grouped(quantize_mx(x), quantize_mx(w), offsets, **tiles)


def dgrad(dy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, **tiles) -> torch.Tensor:
    return mx_grouped(quantize_mx(dy), quantize_mx(w.transpose(1, 2).contiguous()), offsets, **tiles)


def wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, **tiles) -> torch.Tensor:
    g = offsets.numel()
    out = torch.zeros(g, dy.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    one = torch.tensor([dy.shape[1]], dtype=torch.int32, device=x.device)
    for e, end in enumerate(offsets.tolist()):  # one launch per expert: the reduction is its tokens
        if end > start:
            qa = quantize_mx(dy[start:end].T.contiguous())   # (M, n_e), blocks along the tokens
            qx = quantize_mx(x[start:end].T.contiguous())    # (K, n_e)
            qb = MXTensor(qx.q[None], qx.scale[None], qx.k, qx.block, qx.fmt)
            out[e] = mx_grouped(qa, qb, one, **tiles)
        start = end
    return out
