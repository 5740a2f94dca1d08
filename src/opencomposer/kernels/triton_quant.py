"""Triton quantisers for rows of activations, with the MoE permutation fused in: `quantize_rows(x,
fmt, index=idx)` reads row `idx[i]` of `x` and writes quantised row `i`, so the expert-sorted copy
of the activations is never written in high precision and read back (the "fused permute +
quantise" of Cursor's MXFP8 MoE kernels; it saves one write and one read of N x D bf16 per layer).

Formats, bit-identical to the pure-torch quantisers in `kernels/mx.py` (tests check it under
Triton's CPU interpreter, `benchmarks/kernels_gpu.py` on a GPU):

- "mxfp8": E4M3 (or E5M2) per 32 with E8M0 scales 2^ceil(log2(amax / max)); the exponent comes
  from the float32 bits of amax, not from an approximate log2;
- "fp8-block": E4M3 per 1x128 with a float32 scale amax / 448;
- "nvfp4": E2M1 per 16 with E4M3 block scales and one FP32 scale per row (report §6.1).

Two portability points, each a bug waiting to happen:
- Division is `tl.math.div_rn` (IEEE round-to-nearest), never `/`: on NVIDIA GPUs Triton's `/`
  on float32 may compile to an approximate division, the exact failure report §6.1 describes
  (an approximate division in the NVFP4 quantiser diverged after about a hundred RL steps).
- Elements are rounded to the format's grid in float32 (round-to-nearest-even by the add-and-
  subtract of a power-of-two constant, which IEEE addition makes exact) and then encoded into
  their float8 bits with integer arithmetic; no float-to-float8 conversion is involved. Triton
  3.6's interpreter converts without round-to-nearest-even (17.0 became 18, where the hardware and
  torch give 16), without saturation (464 became NaN) and turns NaN into 384; encoding by hand
  makes every backend agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opencomposer.kernels.mx import FORMATS, FormatError, MXTensor

F32_MAX = tl.constexpr(3.4028234663852886e38)
F32_HALF = tl.constexpr(1.7014117331926443e38)  # the torch quantiser caps MX amax here
# format: (mode, block, element); element: (max, mantissa bits, min normal exponent, exponent of max)
SPECS = {"mxfp8": (0, 32, "e4m3"), "mxfp8-e5m2": (0, 32, "e5m2"), "fp8-block": (1, 128, "e4m3"),
         "nvfp4": (2, 16, "e2m1")}
ELEMENTS = {"e4m3": (448.0, 3, -6, 8), "e5m2": (57344.0, 2, -14, 15), "e2m1": (6.0, 1, 0, 2)}


@triton.jit
def _pow2(e):
    """2^e as float32 for integer e in [-127, 127] (2^-127 is subnormal), built from its bits."""
    bits = tl.where(e >= -126, (e + 127) << 23, 0x400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_grid(v, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr):
    """Round to the nearest value of a float format (ties to even), saturating at +-FMAX; NaN
    stays NaN (its exponent is clamped like every other so the constant stays finite)."""
    v = tl.where(v > FMAX, FMAX, tl.where(v < -FMAX, -FMAX, v))
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = _pow2(tl.minimum(tl.maximum(e, EMIN), EMAX) - MBITS)
    magic = step * 12582912.0  # 1.5 x 2^23 steps: (v + magic) - magic rounds v to a multiple of step
    return (v + magic) - magic


@triton.jit
def _encode(r, v, BIAS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """float8 bits (sign, BIAS-biased exponent, MBITS mantissa bits) of r, a float32 already on
    the format's grid; the sign comes from v, the value before rounding (so -tiny gives -0)."""
    bits = r.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    normal = ((e + BIAS) << MBITS) | ((bits & 0x7FFFFF) >> (23 - MBITS))
    small = tl.where(e >= EMIN, 0.0, tl.abs(r))  # only subnormals (NaN has e = 128: not one)
    sub = (small * _pow2(tl.full(r.shape, MBITS - EMIN, tl.int32))).to(tl.int32)  # exact
    enc = tl.where(e >= EMIN, normal, sub)
    enc = tl.where(r != r, 0x7F, enc)
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (enc | sign).to(tl.uint8)


@triton.jit
def _load_block(x_ptr, src, rmask, kb, K, stride_x, BLOCK: tl.constexpr):
    ks = kb * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + src[:, None] * stride_x + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=1)  # NaN does not poison its block
    return x, amax


@triton.jit
def _quant_kernel(x_ptr, idx_ptr, q_ptr, s_ptr, t_ptr, N, K, NB, stride_x, stride_q, stride_s,
                  HAS_IDX: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr,
                  FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                  S_BIAS: tl.constexpr, S_MBITS: tl.constexpr, S_EMIN: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < N
    if HAS_IDX:
        src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    token = tl.full((BR,), 1.0, tl.float32)
    if MODE == 2:  # NVFP4: the row's FP32 scale needs the whole row first
        row_amax = tl.zeros((BR,), tl.float32)
        for kb in range(0, NB):
            _, amax = _load_block(x_ptr, src, rmask, kb, K, stride_x, BLOCK)
            row_amax = tl.maximum(row_amax, amax)
        row_amax = tl.minimum(row_amax, F32_MAX)
        token = tl.where(row_amax > 0, tl.math.div_rn(row_amax, 2688.0), 1.0)  # 448 x 6
        tl.store(t_ptr + rows, token, mask=rmask)
    for kb in range(0, NB):
        x, amax = _load_block(x_ptr, src, rmask, kb, K, stride_x, BLOCK)
        if MODE == 0:  # E8M0: 2^ceil(log2(amax / FMAX)), FMAX = 1.75 x 2^EMAX for E4M3 and E5M2
            amax = tl.minimum(amax, F32_HALF)
            bits = amax.to(tl.int32, bitcast=True)
            field = (bits >> 23) & 0xFF
            e = field - 127 - EMAX + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
            e = tl.where(field == 0, -127, tl.minimum(tl.maximum(e, -127), 127))
            scale = _pow2(e)
            v = x * _pow2(-e)[:, None]  # multiplying by an exact power of two is the exact division
        elif MODE == 1:
            amax = tl.minimum(amax, F32_MAX)
            scale = tl.where(amax > 0, tl.math.div_rn(amax, FMAX), 1.0)
            v = tl.math.div_rn(x, scale[:, None])
        else:
            scale = _round_grid(tl.math.div_rn(tl.math.div_rn(amax, 6.0), token), 448.0, 3, -6, 8)
            scale = tl.where(scale > 0, scale, 1.0)
            v = tl.math.div_rn(x, (scale * token)[:, None])
        q = _encode(_round_grid(v, FMAX, MBITS, EMIN, EMAX), v, S_BIAS, S_MBITS, S_EMIN)
        ks = kb * BLOCK + tl.arange(0, BLOCK)
        tl.store(q_ptr + rows[:, None] * stride_q + ks[None, :], q, mask=rmask[:, None])
        tl.store(s_ptr + rows * stride_s + kb, scale, mask=rmask)


def quantize_rows(x: torch.Tensor, fmt: str = "mxfp8", index: torch.Tensor | None = None, *,
                  rows_per_program: int = 16) -> MXTensor:
    """Quantise the rows of a matrix along its last dimension (zero-padded to the block), reading
    row `index[i]` for output row `i` when `index` is given. Elements are stored as float8 (E2M1
    values of NVFP4 are exact in E4M3)."""
    if fmt not in SPECS:
        raise FormatError(f"unknown format {fmt!r} (have {sorted(SPECS)})")
    if x.dim() != 2:
        raise FormatError(f"quantize_rows takes a matrix, got shape {tuple(x.shape)}")
    mode, block, elem = SPECS[fmt]
    fmax, mbits, emin, emax = ELEMENTS[elem]
    x = x.contiguous()
    n = x.shape[0] if index is None else index.numel()
    if index is not None and n and (int(index.min()) < 0 or int(index.max()) >= x.shape[0]):
        # the kernel would read outside x (garbage or a fault on a GPU): refuse, like x[index] does
        raise IndexError(f"row index out of range for a matrix of {x.shape[0]} rows "
                         f"(index spans {int(index.min())}..{int(index.max())})")
    k = x.shape[1]
    nb = triton.cdiv(k, block)
    stored = "e5m2" if elem == "e5m2" else "e4m3"  # E2M1 values are stored exactly as E4M3
    store = FORMATS[stored][3]
    s_bias, s_mbits, s_emin = {"e4m3": (7, 3, -6), "e5m2": (15, 2, -14)}[stored]
    q = torch.empty(n, nb * block, dtype=store, device=x.device)
    scale = torch.empty(n, nb, dtype=torch.float32, device=x.device)
    token = torch.empty(n, dtype=torch.float32, device=x.device) if mode == 2 else scale
    if n:
        idx = index.contiguous() if index is not None else scale  # unused pointer when no index
        grid = (triton.cdiv(n, rows_per_program),)
        _quant_kernel[grid](x, idx, q.view(torch.uint8), scale, token, n, k, nb, x.stride(0), q.stride(0), scale.stride(0),
                            HAS_IDX=index is not None, MODE=mode, BLOCK=block, BR=rows_per_program,
                            FMAX=fmax, MBITS=mbits, EMIN=emin, EMAX=emax,
                            S_BIAS=s_bias, S_MBITS=s_mbits, S_EMIN=s_emin)
    name = "nvfp4" if mode == 2 else elem
    return MXTensor(q, scale, k, block, name, token_scale=token if mode == 2 else None)
