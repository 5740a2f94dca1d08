"""Triton grouped GEMMs over experts with variable row counts, from quantised operands:
C[rows of g] = A_g B_g^T, A (N, K) and B (G, M, K) both quantised along K.

- MXFP8 (1x32 E8M0 scales) and FP8 blocks (1x128 activations, 128x128 weights, float32 scales):
  FP8 E4M3 tiles go to `tl.dot` (FP8 wgmma on sm_90) and the two operands' scales are applied in
  the kernel after each K step, one step per scale block (`acc += dot(a, b) * (sa * sb)`: the
  DeepGEMM pattern; Hopper has no native MX instructions).
- NVFP4 with per-token scales: Hopper has no FP4 instructions either, so the kernel dequantises
  each tile in registers (E2M1 x E4M3 has at most six significant bits: exact in bf16) and runs a
  bf16 `tl.dot`; the per-row FP32 scales of both operands multiply the accumulator at the end.
  The numerics are the report's NVFP4; the FP4 speed needs Blackwell. (Triton 3.6's interpreter
  mis-converts float32 to bf16 and multiplies bf16 tiles wrongly, so on a CPU the same exact
  values go to a float32 `tl.dot`; the GPU check script covers the bf16 branch.)

Fprop is (x, W); Dgrad is (dy quantised along M, W^T quantised along M); Wgrad reduces over each
expert's tokens: dy^T and x^T are laid out with every expert's stretch padded to the block (so no
scale block straddles two experts), quantised along the tokens, and one launch computes every
expert's dW over its own stretch (NVFP4, whose per-row scale would span experts, loops). `fprop` takes an
optional row index and then quantises the gathered rows in one pass (`triton_quant`), the fused
permute + quantise. On a CPU everything runs under Triton's interpreter (`TRITON_INTERPRET=1`, set
before this module is imported): that is how the tests check it against the pure-torch emulation
at small sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opencomposer.kernels.mx import FormatError, MXTensor, quantize_fp8_block
from opencomposer.kernels.triton_quant import SPECS, quantize_rows

FORMATS = ("mxfp8", "fp8-block", "nvfp4")
SPECS_BLOCK = {fmt: SPECS[fmt][1] for fmt in FORMATS}


@triton.jit
def _grouped_kernel(a_ptr, sa_ptr, ta_ptr, b_ptr, sb_ptr, tb_ptr, c_ptr, offs_ptr, K, M,
                    stride_am, stride_sam, stride_bg, stride_bm, stride_sbg, stride_sbm, stride_tbg, stride_cm,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SK: tl.constexpr,
                    B_ROWS: tl.constexpr, DEQUANT: tl.constexpr, BF16_DOT: tl.constexpr):
    g = tl.program_id(0)
    pm = tl.program_id(1)
    pn = tl.program_id(2)
    start = tl.where(g == 0, 0, tl.load(offs_ptr + g - 1, mask=g > 0, other=0))
    end = tl.load(offs_ptr + g)
    rows = start + pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rmask = rows < end
    cmask = cols < M
    b_base = b_ptr + g * stride_bg
    sb_base = sb_ptr + g * stride_sbg
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        ks = kb * BK + tl.arange(0, BK)
        kmask = ks < K
        amask = rmask[:, None] & kmask[None, :]
        bmask = cmask[None, :] & kmask[:, None]
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=amask, other=0.0)
        b = tl.load(b_base + cols[None, :] * stride_bm + ks[:, None], mask=bmask, other=0.0)
        if DEQUANT:  # scales per SK elements inside the tile, gathered element-wise
            sa = tl.load(sa_ptr + rows[:, None] * stride_sam + (ks // SK)[None, :], mask=amask, other=0.0)
            sb = tl.load(sb_base + (cols // B_ROWS)[None, :] * stride_sbm + (ks // SK)[:, None], mask=bmask, other=0.0)
            a = a.to(tl.float32) * sa
            b = b.to(tl.float32) * sb
            if BF16_DOT:
                acc += tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
            else:
                acc += tl.dot(a, b)
        else:  # BK == SK: one scale per row of A and per row block of B in this step
            sa = tl.load(sa_ptr + rows * stride_sam + kb, mask=rmask, other=0.0)
            sb = tl.load(sb_base + (cols // B_ROWS) * stride_sbm + kb, mask=cmask, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    if DEQUANT:
        ta = tl.load(ta_ptr + rows, mask=rmask, other=0.0)
        tb = tl.load(tb_ptr + g * stride_tbg + cols, mask=cmask, other=0.0)
        acc = acc * ta[:, None] * tb[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


def grouped(qa: MXTensor, qb: MXTensor, offsets: torch.Tensor, *, bm: int = 64, bn: int = 64,
            warps: int = 4, stages: int = 3) -> torch.Tensor:
    """C (N, M) float32 from A (N, K) and B (G, M, K), both quantised along K in one format.
    `bm`/`bn` are the output tile, `warps`/`stages` Triton's launch options (the GPU script
    sweeps them)."""
    a, sa, b, sb = qa.q.contiguous(), qa.scale.contiguous(), qb.q.contiguous(), qb.scale.contiguous()
    n, kp = a.shape
    g, m, kb = b.shape
    if kb != kp or qa.block != qb.block or qa.fmt != qb.fmt or qa.rows != 1:
        raise ValueError(f"operands disagree: A is {qa.fmt} K={kp} in 1x{qa.block} blocks, "
                         f"B is {qb.fmt} K={kb} in {qb.rows}x{qb.block} blocks")
    dequant = qa.fmt == "nvfp4"
    ta = qa.token_scale.contiguous() if dequant else sa
    tb = qb.token_scale.contiguous() if dequant else sb
    c = torch.zeros(n, m, dtype=torch.float32, device=a.device)
    counts = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1).to(torch.int64))
    most = int(counts.max()) if counts.numel() else 0
    if n == 0 or most == 0:
        return c
    bk = 64 if dequant else qa.block
    grid = (g, triton.cdiv(most, bm), triton.cdiv(m, bn))
    _grouped_kernel[grid](a, sa, ta, b, sb, tb, c, offsets.to(torch.int32).contiguous(), kp, m,
                          a.stride(0), sa.stride(0), b.stride(0), b.stride(1), sb.stride(0), sb.stride(1),
                          tb.stride(0) if dequant else 0, c.stride(0),
                          BM=bm, BN=bn, BK=bk, SK=qa.block, B_ROWS=qb.rows, DEQUANT=dequant,
                          BF16_DOT=a.device.type == "cuda", num_warps=warps, num_stages=stages)
    return c


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise FormatError(f"the Triton grouped GEMM runs {FORMATS}, not {fmt!r}")


def quantize_experts(w: torch.Tensor, fmt: str) -> MXTensor:
    """Weights (G, M, K) quantised along K: rows of every expert at once, or 128x128 blocks."""
    _check(fmt)
    if fmt == "fp8-block":
        return quantize_fp8_block(w, rows=128)
    g, m, k = w.shape
    q = quantize_rows(w.reshape(g * m, k), fmt)
    token = None if q.token_scale is None else q.token_scale.reshape(g, m)
    return MXTensor(q.q.reshape(g, m, -1), q.scale.reshape(g, m, -1), k, q.block, q.fmt, token)


def fprop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fmt: str = "mxfp8",
          index: torch.Tensor | None = None, **tiles) -> torch.Tensor:
    """y = x[index]_g W_g^T; the gather is fused into the activation quantiser."""
    _check(fmt)
    return grouped(quantize_rows(x, fmt, index=index), quantize_experts(w, fmt), offsets, **tiles)


def dgrad(dy: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, fmt: str = "mxfp8", **tiles) -> torch.Tensor:
    _check(fmt)
    return grouped(quantize_rows(dy, fmt), quantize_experts(w.transpose(1, 2).contiguous(), fmt), offsets, **tiles)


@triton.jit
def _wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, poffs_ptr, M, N,
                  stride_am, stride_sam, stride_bn, stride_sbn, stride_cg, stride_cm,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """C[g] (M, N) = A[:, tokens of g] B[:, tokens of g]^T: the reduction runs over expert g's
    stretch of the padded token axis, whose start and end are multiples of BK (one scale each)."""
    g = tl.program_id(0)
    pm = tl.program_id(1)
    pn = tl.program_id(2)
    start = tl.where(g == 0, 0, tl.load(poffs_ptr + g - 1, mask=g > 0, other=0))
    end = tl.load(poffs_ptr + g)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    rmask = rows < M
    cmask = cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(start // BK, end // BK):
        ks = kb * BK + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=rmask[:, None], other=0.0)
        b = tl.load(b_ptr + cols[None, :] * stride_bn + ks[:, None], mask=cmask[None, :], other=0.0)
        sa = tl.load(sa_ptr + rows * stride_sam + kb, mask=rmask, other=0.0)
        sb = tl.load(sb_ptr + cols * stride_sbn + kb, mask=cmask, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    tl.store(c_ptr + g * stride_cg + rows[:, None] * stride_cm + cols[None, :], acc,
             mask=rmask[:, None] & cmask[None, :])


def pad_experts(t: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `t` (sorted by expert) laid out with every expert's stretch zero-padded to a
    multiple of `block`, transposed: (features, padded tokens), and the padded cumulative ends. A
    quantisation block along the tokens then never straddles two experts."""
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block - 1) // block * block
    pends = padded.cumsum(0)
    total = int(pends[-1]) if pends.numel() else 0
    expert = torch.repeat_interleave(torch.arange(len(counts), device=t.device), counts, output_size=t.shape[0])
    dest = torch.arange(t.shape[0], device=t.device) - (ends - counts)[expert] + (pends - padded)[expert]
    out = t.new_zeros(total, t.shape[1]).index_copy_(0, dest, t)
    return out.T.contiguous(), pends.to(torch.int32)


def wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, fmt: str = "mxfp8", **tiles) -> torch.Tensor:
    """dW[g] = dy_g^T x_g, both quantised along expert g's tokens. FP8 formats: one launch for all
    experts over the padded token axis; NVFP4, whose per-row scale would span experts in that
    layout, runs one launch per expert."""
    _check(fmt)
    g = offsets.numel()
    out = torch.zeros(g, dy.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    if fmt != "nvfp4":
        block = SPECS_BLOCK[fmt]
        dyt, pends = pad_experts(dy, offsets, block)
        xt, _ = pad_experts(x, offsets, block)
        if dyt.shape[1] == 0:
            return out
        qa, qb = quantize_rows(dyt, fmt), quantize_rows(xt, fmt)
        bm, bn = tiles.get("bm", 64), tiles.get("bn", 64)
        grid = (g, triton.cdiv(out.shape[1], bm), triton.cdiv(out.shape[2], bn))
        _wgrad_kernel[grid](qa.q, qa.scale, qb.q, qb.scale, out, pends, out.shape[1], out.shape[2],
                            qa.q.stride(0), qa.scale.stride(0), qb.q.stride(0), qb.scale.stride(0),
                            out.stride(0), out.stride(1), BM=bm, BN=bn, BK=block,
                            num_warps=tiles.get("warps", 4), num_stages=tiles.get("stages", 3))
        return out
    start = 0
    one = torch.tensor([dy.shape[1]], dtype=torch.int32, device=x.device)
    for e, end in enumerate(offsets.tolist()):  # one launch per expert: the reduction is its tokens
        if end > start:
            qa = quantize_rows(dy[start:end].T, fmt)   # (M, n_e), blocks along the tokens
            qx = quantize_rows(x[start:end].T, fmt)    # (K, n_e)
            tok = None if qx.token_scale is None else qx.token_scale[None]
            qb = MXTensor(qx.q[None], qx.scale[None], qx.k, qx.block, qx.fmt, tok)
            out[e] = grouped(qa, qb, one, **tiles)
        start = end
    return out
