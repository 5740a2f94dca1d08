"""Microscaling formats in pure torch (report §6.1; OCP Microscaling Formats spec v1.0).

MXFP8: blocks of 32 elements along the last dimension share one E8M0 scale (a power of two);
elements are FP8 E4M3 (max 448) or E5M2 (max 57344). The scale follows the recipe Cursor used
(Mishra et al., "Recipes for pre-training LLMs with MXFP8"): 2^ceil(log2(amax / max_elem)),
clamped to [2^-127, 2^127] — rounding *up* so no element overflows; the OCP spec's
2^(floor(log2(amax)) - emax_elem) is available as `scale_rounding="floor"` (elements beyond the
range then saturate). Elements round to nearest, ties to even, and saturate at the format's max.

FP8 with 1x128 / 128x128 block scales (DeepSeek-V3's recipe, `quantize_fp8_block`): E4M3
elements, one float32 scale amax/448 per 1x128 tile of activations and per 128x128 block of
weights. On Hopper, which has no MX instructions, the kernel applies scales in software after each
K step; a 128-deep step per scale costs less than MX's 32-deep one, and a 128x128 weight block
serves both W and W^T, so the backward does not re-quantise the weights.

NVFP4 with per-token scales (the report's variant for the MoE forward): FP4 E2M1 values
(0, 0.5, 1, 1.5, 2, 3, 4, 6), one FP8 E4M3 scale per 16 elements, and one FP32 scale per *token*
(row) instead of per tensor — per-tensor scaling made RL batch-variant (a token's quantisation
depended on the other tokens in the batch) and leaked future tokens into past ones. The
quantiser divides with IEEE division (`x / scale`, never `x * (1 / scale)`): an approximate
division diverged after about a hundred RL steps in the report.

Bad input has defined behaviour: the last dimension is zero-padded to the block size (and the
padding dropped on dequantisation); NaN propagates to its element; +-Inf and values beyond the
format saturate to +-max; an all-zero block gets the smallest scale. Every function has a float64
reference (`*_ref`) that never uses torch's float8 casts, and the tests check bit equality.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = {  # name: (exponent bits, mantissa bits, max normal, torch dtype)
    "e4m3": (4, 3, 448.0, torch.float8_e4m3fn),
    "e5m2": (5, 2, 57344.0, torch.float8_e5m2),
    "e2m1": (2, 1, 6.0, None),
}
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


class FormatError(ValueError):
    pass


@dataclass
class MXTensor:
    """Quantised data: `q` holds the element values (float8 for MXFP8 and FP8 blocks; values on
    the E2M1 grid for NVFP4, as float32 from torch or float8 from the Triton quantiser, which
    holds them exactly), `scale` the block scales as float32 (powers of two for MXFP8, E4M3 values
    for NVFP4, amax/448 for FP8 blocks), `token_scale` the NVFP4 per-row FP32 scale, `k` the
    unpadded last dimension, `rows` how many rows share a scale (128 for 128x128 weight blocks)."""
    q: torch.Tensor
    scale: torch.Tensor
    k: int
    block: int
    fmt: str
    token_scale: torch.Tensor | None = None
    rows: int = 1

    def dequantize(self) -> torch.Tensor:
        shape = self.q.shape
        scale = self.scale
        if self.rows > 1:
            scale = scale.repeat_interleave(self.rows, dim=-2)[..., : shape[-2], :]
        blocks = self.q.float().reshape(*shape[:-1], -1, self.block) * scale[..., None]
        out = blocks.reshape(shape)
        if self.token_scale is not None:
            out = out * self.token_scale[..., None]
        return out[..., : self.k]


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (compared in float64 on the CPU, so any dtypes and devices), NaN matching NaN:
    how quantisers are checked against their references."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _pad(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x, k


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _amax(b: torch.Tensor) -> torch.Tensor:
    """Block amax ignoring NaN (a NaN element stays NaN itself; it does not poison its block)."""
    return torch.nan_to_num(b.abs(), nan=0.0).amax(-1)


# -- element rounding ------------------------------------------------------------------------------

def round_to_format_ref(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 reference: round to the nearest value of the format (ties to even), saturating at
    its max; NaN stays NaN. Built from exponent arithmetic, not from torch's float8 casts."""
    ebits, mbits, fmax = FORMATS[fmt][:3]
    v = v.to(torch.float64)
    bias = 2 ** (ebits - 1) - 1
    emin = 1 - bias  # the smallest normal exponent; below it the step stays fixed (subnormals)
    a = v.abs().clamp(max=fmax)
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** (emin - 1)))).clamp(min=emin)
    step = torch.pow(2.0, e - mbits)
    q = torch.round(a / step) * step  # torch.round: half to even
    q = torch.minimum(q, torch.full_like(q, fmax))
    out = torch.copysign(q, v)
    return torch.where(torch.isnan(v), v, out)


def round_to_format(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Fast path: torch's float8 casts (RNE; saturating after the clamp) or the E2M1 grid."""
    ebits, mbits, fmax, dtype = FORMATS[fmt]
    v = v.float()
    if dtype is not None:
        return v.clamp(-fmax, fmax).to(dtype)  # clamp keeps NaN; the cast is round-to-nearest-even
    return _round_e2m1(v)


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value, ties to the even code, saturating at 6. The grid's step is 2^(e-1) for
    |v| in [2^e, 2^(e+1)) (0.5 below 1), so rounding |v| / step half-to-even lands on the even code:
    a division by a power of two and a rounding, both exact, with no table lookup."""
    a = v.abs().clamp(max=6.0)
    e = (torch.frexp(a).exponent - 1).clamp(min=0)  # floor(log2 a); 0 for a < 1, including 0
    step = torch.ldexp(torch.ones_like(a), e - 1)
    q = torch.round(a / step) * step
    return torch.where(torch.isnan(v), v, torch.copysign(q, v))


# -- MXFP8 ------------------------------------------------------------------------------------------

def _mx_exponent(amax: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    ebits, mbits, fmax = FORMATS[fmt][:3]
    # Inf saturates: amax is capped so that max_elem x scale stays a finite float32
    amax = amax.to(torch.float64).clamp(max=torch.finfo(torch.float32).max / 2)
    tiny = amax <= 0
    safe = torch.where(tiny, torch.ones_like(amax), amax)
    if rounding == "ceil":
        e = torch.ceil(torch.log2(safe / fmax))
    elif rounding == "floor":
        emax_elem = {"e4m3": 8, "e5m2": 15, "e2m1": 2}[fmt]  # the OCP spec's table
        e = torch.floor(torch.log2(safe)) - emax_elem
    else:
        raise FormatError(f"scale_rounding must be ceil or floor, got {rounding!r}")
    return torch.where(tiny, torch.full_like(e, -127.0), e).clamp(-127, 127)


def quantize_mx(x: torch.Tensor, fmt: str = "e4m3", block: int = 32, scale_rounding: str = "ceil") -> MXTensor:
    if fmt not in ("e4m3", "e5m2"):
        raise FormatError(f"MXFP8 elements are e4m3 or e5m2, got {fmt!r}")
    xp, k = _pad(x.float(), block)
    b = _blocks(xp, block)
    e = _mx_exponent(_amax(b), fmt, scale_rounding)
    scale = torch.pow(2.0, e).float()
    q = round_to_format(b / scale[..., None], fmt)  # division by a power of two: exact
    return MXTensor(q.reshape(xp.shape), scale, k, block, fmt)


def quantize_mx_ref(x: torch.Tensor, fmt: str = "e4m3", block: int = 32, scale_rounding: str = "ceil",
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference: (element values, block scales)."""
    xp, k = _pad(x.to(torch.float64), block)
    b = _blocks(xp, block)
    e = _mx_exponent(_amax(b), fmt, scale_rounding)
    scale = torch.pow(2.0, e)
    q = round_to_format_ref(b / scale[..., None], fmt)
    return q.reshape(xp.shape), scale


# -- FP8 with 1x128 / 128x128 block scales -------------------------------------------------------

def _tile_amax(xp: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """amax over rows x block tiles of the last two dimensions (rows = 1: per row)."""
    b = _blocks(xp, block)
    if rows == 1:
        return _amax(b)
    if xp.dim() < 2:
        raise FormatError(f"{rows}x{block} blocks need a matrix, got shape {tuple(xp.shape)}")
    a = _amax(b)                                                  # (..., R, nb)
    pad = (-a.shape[-2]) % rows
    a = torch.nn.functional.pad(a, (0, 0, 0, pad))                # zero rows do not raise amax
    return a.reshape(*a.shape[:-2], -1, rows, a.shape[-1]).amax(-2)


def _expand_rows(scale: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    return scale if rows == 1 else scale.repeat_interleave(rows, dim=-2)[..., :n, :]


def quantize_fp8_block(x: torch.Tensor, rows: int = 1, block: int = 128) -> MXTensor:
    """E4M3 with a float32 scale amax/448 per `rows` x `block` tile: 1x128 for activations,
    128x128 for weights. An all-zero tile gets scale 1; Inf saturates; NaN stays in its element."""
    if rows not in (1, block):
        raise FormatError(f"FP8 blocks are 1x{block} or {block}x{block}, got {rows}x{block}")
    xp, k = _pad(x.float(), block)
    amax = _tile_amax(xp, rows, block).clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    full = _expand_rows(scale, rows, xp.shape[-2] if xp.dim() > 1 else 1)
    q = round_to_format(_blocks(xp, block) / full[..., None], "e4m3")            # IEEE division
    return MXTensor(q.reshape(xp.shape), scale, k, block, "e4m3", rows=rows)


def quantize_fp8_block_ref(x: torch.Tensor, rows: int = 1, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference (float32 rounding points explicit): (element values, tile scales)."""
    f32 = lambda t: t.to(torch.float32).to(torch.float64)  # noqa: E731
    xp, k = _pad(x.to(torch.float64), block)
    amax = _tile_amax(xp, rows, block).clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(amax > 0, f32(amax / 448.0), torch.ones_like(amax))
    full = _expand_rows(scale, rows, xp.shape[-2] if xp.dim() > 1 else 1)
    q = round_to_format_ref(f32(_blocks(xp, block) / full[..., None]), "e4m3")
    return q.reshape(xp.shape), scale


# -- NVFP4 with per-token scales -------------------------------------------------------------------

def quantize_nvfp4(x: torch.Tensor, block: int = 16) -> MXTensor:
    """Rows are tokens: FP32 scale per row, E4M3 scale per 16 elements, E2M1 elements."""
    xp, k = _pad(x.float(), block)
    b = _blocks(xp, block)
    row_amax = _amax(b).amax(-1).clamp(max=torch.finfo(torch.float32).max)
    token = torch.where(row_amax > 0, row_amax / (448.0 * 6.0), torch.ones_like(row_amax))
    bscale = round_to_format(_amax(b) / 6.0 / token[..., None], "e4m3").float()  # IEEE division
    bscale = torch.where(bscale > 0, bscale, torch.ones_like(bscale))
    q = _round_e2m1(b / (bscale[..., None] * token[..., None, None]))            # IEEE division
    return MXTensor(q.reshape(xp.shape), bscale, k, block, "nvfp4", token_scale=token)


def quantize_nvfp4_ref(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 reference with the float32 rounding points of the fast path made explicit."""
    xp, k = _pad(x.to(torch.float64), block)
    b = _blocks(xp, block)
    f32 = lambda t: t.to(torch.float32).to(torch.float64)  # noqa: E731 - the fast path's fp32 steps
    row_amax = f32(_amax(b).amax(-1).clamp(max=torch.finfo(torch.float32).max))  # Inf saturates
    token = torch.where(row_amax > 0, f32(row_amax / f32(torch.tensor(448.0 * 6.0, dtype=torch.float64))),
                        torch.ones_like(row_amax))
    bscale = round_to_format_ref(f32(f32(_amax(b) / 6.0) / token[..., None]), "e4m3")
    bscale = torch.where(bscale > 0, bscale, torch.ones_like(bscale))
    denom = f32(bscale[..., None] * token[..., None, None])
    q = round_to_format_ref(f32(b / denom), "e2m1")
    return q.reshape(xp.shape), bscale, token
