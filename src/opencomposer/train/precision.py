"""The speedrun's kernels stage: the low-precision MoE path on this machine (report §6.1).

1. The quantisers (MXFP8, FP8 1x128, per-token NVFP4) bit-exact against their float64 references
   on random and adversarial values, run on the stage's device.
2. Grouped Fprop / Dgrad / Wgrad in each format against float64, with the bound of kernels.md.
3. A tiny DeepSeek-style MoE trained on real code (the bytes of standard-library modules: its
   vocabulary covers every byte) once per expert backend, from the same initial weights on the
   same batches; the loss curves (`kernels/loss.svg`) and each backend's held-out loss against
   float32's.

On a GPU the low-precision backends run on the Triton kernels; on a CPU on the exact emulation
(the same numerics up to float32 summation order), which is what the report card says it used.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

from opencomposer.core.metrics import MetricsWriter
from opencomposer.core.plot import chart
from opencomposer.core.rundir import RunDir, write_atomic

FORMATS = {"torch": ("float32", "float32"), "bf16": ("bf16", "bf16"), "nvfp4": ("nvfp4", "mxfp8"),
           "mxfp8": ("mxfp8", "mxfp8"), "fp8-block": ("fp8-block", "fp8-block")}


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelsStageConfig:
    enabled: bool = True
    backends: tuple[str, ...] = ("torch", "bf16", "nvfp4", "mxfp8", "fp8-block")
    """Expert backends to train with (`moe_backend`); "torch" (float32) is the baseline."""
    preset: str = "tiny-moe"
    modules: tuple[str, ...] = ("textwrap", "string", "difflib", "shlex")
    """Standard-library modules whose source bytes are the training text (last 10% held out)."""
    steps: int = 40
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    device: str = "auto"
    """"auto": CUDA when present (the Triton kernels), else the CPU (the emulation)."""


def _code_bytes(modules: tuple[str, ...]) -> bytes:
    out = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise FileNotFoundError(f"standard-library module {name!r} has no Python source here")
        out.append(Path(spec.origin).read_bytes())
    return b"\n".join(out)


def exactness(device) -> dict[str, bool]:
    """Each quantiser on `device` equals its float64 reference on random values at six magnitudes
    plus NaN, +-Inf, round-to-even ties, values past the format's range and all-zero rows."""
    import torch

    from opencomposer.kernels import mx

    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 272, generator=g) * torch.logspace(-5, 5, 96)[:, None]
    x[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 17.0, 1.5 * 2.0 ** -9, 464.0, 1e30, -0.0])
    x[1] = 0.0
    xd = x.to(device)

    out = {}
    for name, fast, ref in (("mxfp8", mx.quantize_mx, mx.quantize_mx_ref),
                            ("fp8-block", mx.quantize_fp8_block, mx.quantize_fp8_block_ref),
                            ("nvfp4", mx.quantize_nvfp4, mx.quantize_nvfp4_ref)):
        q, r = fast(xd), ref(x)
        ok = mx.identical(q.q.float(), r[0]) and mx.identical(q.scale, r[1])
        out[name] = ok and (q.token_scale is None or mx.identical(q.token_scale, r[2]))
    return out


def gemm_errors(device) -> dict[str, dict]:
    """Relative Frobenius error against float64 of the three grouped products per format, on the
    kernels the MoE layer uses on `device`, with an empty expert and uneven counts."""
    import torch

    from opencomposer.kernels import grouped_gemm as gg

    g = torch.Generator().manual_seed(1)
    counts = [96, 0, 160, 64]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    x, w, dy = (torch.randn(*s, generator=g).to(device) for s in ((320, 256), (4, 128, 256), (320, 128)))
    refs = gg.reference(x, w, offs, dy)
    out = {}
    for fmt, bound in gg.BOUNDS.items():
        ops = gg.products("auto", fmt, x.device)
        got = {"fprop": ops.fprop(x, w, offs, fmt), "dgrad": ops.dgrad(dy, w, offs, fmt),
               "wgrad": ops.wgrad(x, dy, offs, fmt)}
        errs = {k: float((got[k].double() - refs[k]).norm() / refs[k].norm()) for k in refs}
        out[fmt] = {**errs, "bound": bound, "within": all(e < bound for e in errs.values()),
                    "kernel": "triton" if ops.__name__.endswith("triton_gemm") else "emulation"}
    return out


def train_curves(cfg: KernelsStageConfig, device, progress=None) -> dict[str, dict]:
    import torch

    from opencomposer.model.deepseek import DeepseekModel, preset
    from opencomposer.model.loss import causal_lm_loss

    data = torch.frombuffer(bytearray(_code_bytes(cfg.modules)), dtype=torch.uint8).long()
    cut = int(len(data) * 0.9)
    train, held = data[:cut], data[cut:]
    g = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(0, len(train) - cfg.seq_len - 1, (cfg.steps, cfg.batch_size), generator=g)
    batches = [torch.stack([train[s:s + cfg.seq_len + 1] for s in row.tolist()]) for row in starts]
    n_eval = min(16, (len(held) - 1) // (cfg.seq_len + 1))
    evals = held[: n_eval * (cfg.seq_len + 1)].reshape(n_eval, cfg.seq_len + 1)
    torch.manual_seed(cfg.seed)
    init = DeepseekModel(preset(cfg.preset, num_nextn_predict_layers=0)).state_dict()
    out = {}
    for backend in cfg.backends:
        model = DeepseekModel(preset(cfg.preset, moe_backend=backend, num_nextn_predict_layers=0))
        model.load_state_dict(init)
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        losses, t0 = [], time.perf_counter()
        for batch in batches:
            loss = causal_lm_loss(model, batch.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if progress:
                progress()
        with torch.no_grad():
            held_loss = float(causal_lm_loss(model.eval(), evals.to(device)))
        out[backend] = {"formats": FORMATS.get(backend, (backend, backend)), "losses": losses,
                        "heldout_loss": held_loss, "seconds": time.perf_counter() - t0}
    return out


def run(cfg: KernelsStageConfig, run_dir: RunDir, metrics: MetricsWriter, progress=None) -> dict:
    import torch

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    stage = run_dir.stage("kernels")
    curves = train_curves(cfg, device, progress)
    base = curves.get("torch", next(iter(curves.values())))["heldout_loss"]
    for name, c in curves.items():
        c["heldout_vs_float32"] = c["heldout_loss"] / base - 1
        metrics.write({"stage": "kernels", "backend": name, "heldout_loss": c["heldout_loss"],
                       "final_loss": c["losses"][-1]})
    summary = {"device": str(device), "kernels": "triton" if device.type == "cuda" else "emulation",
               "quantisers_exact": exactness(device), "gemm_errors": gemm_errors(device), "training": curves,
               "config": {"preset": cfg.preset, "steps": cfg.steps, "batch_size": cfg.batch_size,
                          "seq_len": cfg.seq_len, "modules": list(cfg.modules)}}
    write_atomic(stage / "loss.svg", chart({n: list(enumerate(c["losses"], 1)) for n, c in curves.items()},
                                           "step", "training loss (nats/byte)"))
    run_dir.write_json("kernels/summary.json", summary)
    return summary
