"""GPU check for the low-precision kernels: one self-timed script (under 10 minutes on one H200)
that checks every kernel against its reference on the GPU, then times them against bf16
`torch.nn.functional.grouped_mm` at MoE shapes, and the whole MoE layer forward + backward against
the bf16 layer, writing a table.

    python benchmarks/kernels_gpu.py [--budget-s 420]   # writes the "kernels-gpu" section
    TRITON_INTERPRET=1 python benchmarks/kernels_gpu.py --cpu-smoke   # the script's own plumbing,
                                                                       # at toy sizes, on a CPU

Checks: the Triton quantisers (MXFP8 E4M3/E5M2, FP8 1x128, NVFP4) bit-identical to the torch
ones, gathered rows included; the torch quantisers on the GPU bit-identical to the float64
references; Triton Fprop/Dgrad/Wgrad in each format equal to the emulation up to float32
summation order; the MoE layer on the kernels equal to the layer on the emulation. Each check and
each timing runs on its own, so one failure is reported in the table instead of ending the run.
Written without a GPU at hand: the kernel logic is tested on CPU under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch
from corpus import write_section

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [  # (experts, tokens per expert, K, M): a small-MoE layer, DeepSeek-V3-like experts
    (8, 2048, 2048, 1408),
    (32, 1024, 4096, 2048),
    (64, 512, 7168, 2048),
]
FORMATS = ("mxfp8", "fp8-block", "nvfp4")
TILES = [{"bm": 128, "bn": 128, "warps": 8, "stages": 3}, {"bm": 128, "bn": 128, "warps": 4, "stages": 4},
         {"bm": 64, "bn": 128, "warps": 4, "stages": 4}, {"bm": 128, "bn": 64, "warps": 4, "stages": 3}]


SMOKE_SHAPES = [(2, 32, 64, 48)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn, budget_s: float) -> float:
    """Mean seconds per call over `budget_s` after one warm-up call (at least 3 calls). A budget of 0
    (the smoke run: plumbing, not timing) makes one call and no warm-up."""
    if budget_s > 0:
        fn()
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s or n < (3 if budget_s > 0 else 1):
        fn()
        n += 1
    sync()
    return (time.perf_counter() - t0) / n


class Report:
    def __init__(self, budget_s: float):
        self.start, self.budget = time.perf_counter(), budget_s
        self.checks: list[tuple[str, str]] = []
        self.errors: list[str] = []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def check(self, name: str, fn) -> None:
        try:
            ok = fn()
            self.checks.append((name, "yes" if ok is True else f"**NO** ({ok})" if ok not in (False, None) else "**NO**"))
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            self.checks.append((name, f"**error**: {type(e).__name__}: {str(e)[:120]}"))
            self.errors.append(traceback.format_exc())

    def attempt(self, fn, default=None):
        try:
            return fn()
        except Exception:  # noqa: BLE001
            self.errors.append(traceback.format_exc())
            return default


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: this script is for the GPU machine (the CPU tests cover the kernel logic)")
    import torch.nn.functional as F

    from opencomposer.kernels import grouped_gemm as gg
    from opencomposer.kernels import mx
    from opencomposer.kernels import triton_gemm as tg
    from opencomposer.kernels.triton_quant import quantize_rows
    from opencomposer.model.moe import torch_experts

    rep = Report(args.budget_s)
    dev = torch.device("cpu" if smoke else "cuda")
    shapes = SMOKE_SHAPES if smoke else SHAPES
    size = (lambda n: max(8, n // 64)) if smoke else (lambda n: n)  # toy sizes for the smoke run
    g = torch.Generator(device=dev).manual_seed(0)
    # 1,040 columns: 8 blocks of 128 and a tail of 16 (FP8 1x128; MX's blocks of 32 end in a half
    # block). The smoke run's 272 keeps that (2 x 128 + 16) at a quarter of the interpreter's time.
    width = 272 if smoke else 1040
    x = torch.randn(size(4096), width, device=dev, generator=g) * torch.logspace(-4, 4, size(4096), device=dev)[:, None]
    x[3, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 17.0, 464.0, -0.0], device=dev)
    xc = x.cpu()

    torch_q = {"mxfp8": mx.quantize_mx, "mxfp8-e5m2": lambda t: mx.quantize_mx(t, "e5m2"),
               "fp8-block": mx.quantize_fp8_block, "nvfp4": mx.quantize_nvfp4}
    index = torch.randint(0, size(4096), (size(6000),), device=dev, generator=g)
    for fmt, fn in torch_q.items():
        def quant_check(fmt=fmt, fn=fn):
            got, want = quantize_rows(x, fmt, index=index), fn(x[index])
            return mx.identical(got.q.float(), want.q.float()) and torch.equal(got.scale, want.scale)
        rep.check(f"Triton {fmt} quantiser (fused gather) == torch quantiser", quant_check)
    def matches_reference(quantize, reference):
        q, ref = quantize(x), reference(xc)  # reference: (values, block scales[, token scales])
        ok = mx.identical(q.q.float(), ref[0]) and torch.equal(q.scale.cpu().double(), ref[1])
        return ok and (len(ref) < 3 or torch.equal(q.token_scale.cpu().double(), ref[2]))
    for label, quantize, reference in (("MXFP8", mx.quantize_mx, mx.quantize_mx_ref),
                                       ("NVFP4", mx.quantize_nvfp4, mx.quantize_nvfp4_ref),
                                       ("FP8 1x128", mx.quantize_fp8_block, mx.quantize_fp8_block_ref)):
        rep.check(f"torch {label} on the device == float64 reference",
                  lambda quantize=quantize, reference=reference: matches_reference(quantize, reference))

    # products against the emulation at a moderate shape (the emulation is float32 matmuls)
    counts = torch.tensor([size(c) for c in (300, 0, 1000, 77, 512, 129)])
    offs = counts.cumsum(0).to(torch.int32).to(dev)
    kk, mm = (80, 48) if smoke else (1040, 784)
    xs = torch.randn(int(counts.sum()), kk, device=dev, generator=g)
    w = torch.randn(6, mm, kk, device=dev, generator=g)
    dy = torch.randn(int(counts.sum()), mm, device=dev, generator=g)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    for fmt in FORMATS:
        rep.check(f"Triton {fmt} Fprop/Dgrad/Wgrad == emulation (1e-4)", lambda fmt=fmt: max(
            rel(tg.fprop(xs, w, offs, fmt), gg.fprop(xs, w, offs, fmt)),
            rel(tg.dgrad(dy, w, offs, fmt), gg.dgrad(dy, w, offs, fmt)),
            rel(tg.wgrad(xs, dy, offs, fmt), gg.wgrad(xs, dy, offs, fmt))) < 1e-4)

    def layer_check():
        n, d, i = (24, 64, 32) if smoke else (2048, 1024, 704)
        xt = torch.randn(n, d, device=dev, generator=g)
        idx = torch.randint(0, 8, (n, 2), device=dev, generator=g)
        token = idx.reshape(-1).argsort(stable=True) // 2
        o = torch.bincount(idx.reshape(-1), minlength=8).cumsum(0).to(torch.int32)
        gu, dn = torch.randn(8, 2 * i, d, device=dev) * 0.03, torch.randn(8, d, i, device=dev) * 0.03
        a = gg.experts_backend("nvfp4", "mxfp8", kernel="triton")(xt, token, o, gu, dn)
        b = gg.experts_backend("nvfp4", "mxfp8", kernel="torch")(xt, token, o, gu, dn)
        return rel(a, b) < 1e-4
    rep.check("MoE layer (NVFP4 fwd) on Triton == on emulation", layer_check)

    # timing: products at MoE shapes
    rows, layer_rows = [], []
    per = 0.0 if smoke else max(2.0, (rep.left() - 150) / (len(shapes) * 7))
    tiles = [{"bm": 32, "bn": 32}] if smoke else TILES
    best_tiles = {}
    for e, t, k, m in shapes:
        if rep.left() < 120 and not smoke:
            break
        o = torch.full((e,), t).cumsum(0).to(torch.int32).to(dev)
        xb = torch.randn(e * t, k, device=dev, dtype=torch.bfloat16)
        wb = torch.randn(e, m, k, device=dev, dtype=torch.bfloat16)
        flops = 2 * e * t * k * m
        t_bf16 = bench(lambda: F.grouped_mm(xb, wb.transpose(1, 2), offs=o), per)
        row = [f"{e} x {t} tokens, K={k}, M={m}", flops / t_bf16 / 1e12]
        for fmt in FORMATS:
            qa = rep.attempt(lambda fmt=fmt: quantize_rows(xb, fmt))
            qb = rep.attempt(lambda fmt=fmt: tg.quantize_experts(wb, fmt))
            if qa is None or qb is None:
                row += [None, None]
                continue
            if fmt not in best_tiles:  # a small sweep on the first shape, kept for the others
                timed = {i: rep.attempt(lambda c=c: bench(lambda: tg.grouped(qa, qb, o, **c), 0.5 * (not smoke)))
                         for i, c in enumerate(tiles)}
                timed = {i: s for i, s in timed.items() if s is not None}
                best_tiles[fmt] = tiles[min(timed, key=timed.get)] if timed else tiles[0]
            c = best_tiles[fmt]
            tk = rep.attempt(lambda: bench(lambda: tg.grouped(qa, qb, o, **c), per))
            tq = rep.attempt(lambda fmt=fmt: bench(lambda: tg.grouped(quantize_rows(xb, fmt), qb, o, **c), per))
            row += [t_bf16 / tk if tk else None, t_bf16 / tq if tq else None]
        rows.append(row)

    # timing: the fused permute + quantise against gathering the bf16 rows first, then quantising
    fused_rows = []
    for e, t, k, _ in shapes[:2]:
        if rep.left() < 90 and not smoke:
            break
        n = e * t // 2
        xb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        order = torch.randperm(e * t, device=dev) // 2  # top-2: every token twice, in expert order
        row = [f"{n} tokens x 2 slots, D={k}"]
        for fmt in FORMATS:
            t_two = rep.attempt(lambda fmt=fmt: bench(lambda: quantize_rows(xb[order], fmt), per / 2))
            t_one = rep.attempt(lambda fmt=fmt: bench(lambda: quantize_rows(xb, fmt, index=order), per / 2))
            row.append(t_two / t_one if (t_one and t_two) else None)
        fused_rows.append(row)

    # timing: the whole MoE layer, forward + backward, against the bf16 layer (torch grouped_mm)
    for e, t, k, m in shapes[:2]:
        if rep.left() < 40 and not smoke:
            break
        n = e * t // 2  # top-2 routing: tokens x 2 slots = e x t rows
        xt = torch.randn(n, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        first = torch.arange(n, device=dev) % e
        idx = torch.stack([first, (first + 1) % e], dim=1)  # balanced: t rows per expert
        token = idx.reshape(-1).argsort(stable=True) // 2
        o = torch.bincount(idx.reshape(-1), minlength=e).cumsum(0).to(torch.int32)
        gu = (torch.randn(e, 2 * m, k, device=dev) * 0.02).bfloat16().requires_grad_()
        dn = (torch.randn(e, k, m, device=dev) * 0.02).bfloat16().requires_grad_()
        up = torch.randn(e * t, k, device=dev, dtype=torch.bfloat16)

        def step(fn):
            (fn(xt, token, o, gu, dn) * up).sum().backward()
            xt.grad = gu.grad = dn.grad = None
        t_bf16 = rep.attempt(lambda: bench(lambda: step(torch_experts), per))
        row = [f"{e} experts, {n} tokens top-2, D={k}, I={m}", t_bf16 * 1e3 if t_bf16 else None]
        for fwd, bwd in (("nvfp4", "mxfp8"), ("mxfp8", "mxfp8"), ("fp8-block", "fp8-block")):
            fn = gg.experts_backend(fwd, bwd, kernel="triton")
            tl_ = rep.attempt(lambda fn=fn: bench(lambda: step(fn), per))
            row.append(t_bf16 / tl_ if (tl_ and t_bf16) else None)
        layer_rows.append(row)

    def fmt_x(v):
        return "—" if v is None else f"**{v:.2f}x**"

    name = "CPU (smoke run, Triton interpreter)" if smoke else torch.cuda.get_device_name()
    lines = [f"## Kernels on {name} (`benchmarks/kernels_gpu.py`)", "",
             f"Reproduce: `python benchmarks/kernels_gpu.py {' '.join(sys.argv[1:])}`".rstrip() + ".", "",
             "| check | ok |", "|---|---|"] + [f"| {c} | {ok} |" for c, ok in rep.checks]
    lines += ["", "Grouped Fprop, speed-up over bf16 `grouped_mm` (quantised operands; \"+q\": with the "
              "activation quantiser in the timed loop). Tiles: " + ", ".join(f"{f}: {c}" for f, c in best_tiles.items()), "",
              "| shape | bf16 TFLOP/s | MXFP8 | +q | FP8 1x128 | +q | NVFP4 (bf16 MMA) | +q |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]:.0f} | " + " | ".join(fmt_x(v) for v in r[2:]) + " |" for r in rows]
    lines += ["", "Fused permute + quantise (`quantize_rows(x, fmt, index=...)`), speed-up over gathering the bf16 "
              "rows and then quantising them:", "", "| activations | MXFP8 | FP8 1x128 | NVFP4 |", "|---|---|---|---|"]
    lines += [f"| {r[0]} | " + " | ".join(fmt_x(v) for v in r[1:]) + " |" for r in fused_rows]
    lines += ["", "MoE layer forward + backward, speed-up over the bf16 layer (torch `grouped_mm` with autograd):", "",
              "| shape | bf16 ms | NVFP4 fwd / MXFP8 bwd | MXFP8 | FP8 1x128 |", "|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {'—' if r[1] is None else f'{r[1]:.1f}'} | " + " | ".join(fmt_x(v) for v in r[2:]) + " |"
              for r in layer_rows]
    lines += ["", f"Total {time.perf_counter() - rep.start:.0f} s; {len(rep.errors)} errors."]
    md = "\n".join(lines)
    print(md)
    for err in rep.errors[:5]:
        print(err, file=sys.stderr)
    if not smoke:
        write_section(ROOT / "docs" / "benchmarks.md", "kernels-gpu", md)


if __name__ == "__main__":
    main()
