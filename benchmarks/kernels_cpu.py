"""Low-precision formats and grouped GEMMs on CPU: reference throughput, for information only
(the kernels issue's speed goal is for GPUs: `benchmarks/kernels_gpu.py` when one is lent).

    .venv/bin/python benchmarks/kernels_cpu.py   # writes the "kernels" section of docs/benchmarks.md

Quantiser throughput (input GB/s) for MXFP8, FP8 1x128 and per-token NVFP4, and the emulated grouped Fprop
in each format against the float32 `grouped_mm` at a small MoE shape, with relative errors
against float64. Medians of 5 runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from corpus import timed, write_section

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from opencomposer.kernels import grouped_gemm as gg
    from opencomposer.kernels.mx import quantize_fp8_block, quantize_mx, quantize_nvfp4

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 1024, generator=g)
    gb = x.numel() * 4 / 1e9
    q = {"MXFP8 (E4M3, 1x32, ceil scales)": timed(lambda: quantize_mx(x)),
         "FP8 blocks (E4M3, FP32 per 1x128)": timed(lambda: quantize_fp8_block(x)),
         "NVFP4 (E2M1, E4M3 per 16, FP32 per token)": timed(lambda: quantize_nvfp4(x))}
    counts = [512, 256, 768, 512, 0, 1024, 512, 512]  # 8 experts, one empty
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    xs = torch.randn(sum(counts), 1024, generator=g)
    w = torch.randn(8, 512, 1024, generator=g)
    ref = gg.reference(xs, w, offs)["fprop"]
    rows = {}
    for fmt in ("fp32", "bf16", "mxfp8", "fp8-block", "nvfp4"):
        secs = timed(lambda: gg.fprop(xs, w, offs, fmt))
        err = float((gg.fprop(xs, w, offs, fmt).double() - ref).norm() / ref.norm())
        rows[fmt] = (secs, err)
    flops = 2 * sum(counts) * 1024 * 512
    lines = ["## Low-precision formats on CPU (`benchmarks/kernels_cpu.py`, for information)", "",
             f"Reproduce: `{' '.join(['.venv/bin/python', 'benchmarks/kernels_cpu.py', *sys.argv[1:]])}`. Pure-torch reference "
             "path (quantise, dequantise, float32 grouped product); the speed goal is for GPUs.", "",
             "| quantiser | GB/s of float32 input |", "|---|---|"]
    lines += [f"| {k} | {gb / v:.2f} |" for k, v in q.items()]
    lines += ["", f"Grouped Fprop, 8 experts (one empty), {sum(counts)} tokens, K=1024, M=512:", "",
              "| format | ms | GFLOP/s | relative error vs float64 |", "|---|---|---|---|"]
    lines += [f"| {k} | {s * 1e3:.1f} | {flops / s / 1e9:.1f} | {e:.2%} |" for k, (s, e) in rows.items()]
    md = "\n".join(lines)
    print(md)
    write_section(ROOT / "docs" / "benchmarks.md", "kernels", md)


if __name__ == "__main__":
    main()
