"""`opencomposer study cpt-vs-rl`: does lower loss after SFT predict higher reward after RL?
(report §2, Fig. 2).

For each of several log-spaced continued-pretraining budgets the study runs CPT from the same base,
then the identical SFT recipe, and records the SFT held-out loss together with the CPT compute
(tokens x parameters x 6). The RL step — the same RL recipe from every SFT model, then reward —
belongs to the RL capability; until it exists the table's reward column says so and the plot shows
SFT loss against CPT compute. Output: `<run>/study.json`, `<run>/study.md` and `<run>/study.svg`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from opencomposer.core.rundir import RunDir, write_atomic
from opencomposer.train import pretrain, sft
from opencomposer.train.trainer import TrainError


@dataclass(frozen=True, kw_only=True, slots=True)
class StudyConfig:
    pretrain: pretrain.PretrainConfig = field(default_factory=pretrain.PretrainConfig)
    """The CPT recipe; its single phase's `steps` is replaced by each level."""
    sft: sft.SFTConfig = field(default_factory=sft.SFTConfig)
    """The identical SFT recipe applied to every CPT model (its `model` is set per level)."""
    levels: tuple[int, ...] = (4, 16, 64)
    """CPT steps per level (log-spaced compute)."""
    out_dir: Path = Path("runs")
    name: str = "study-cpt-vs-rl"


def svg(points: list[tuple[float, float]], xlabel: str, ylabel: str) -> str:
    """A small inline-SVG scatter plot (log x axis); no plotting dependency."""
    import math

    w, h, pad = 420, 280, 48
    xs = [math.log10(max(x, 1e-12)) for x, _ in points]
    ys = [y for _, y in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def px(x, y):
        return pad + (x - x0) / (x1 - x0) * (w - 2 * pad), h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad)

    dots = "".join(f'<circle cx="{px(x, y)[0]:.1f}" cy="{px(x, y)[1]:.1f}" r="4" fill="#3366cc"/>'
                   f'<text x="{px(x, y)[0] + 6:.1f}" y="{px(x, y)[1] - 6:.1f}" font-size="10">{y:.3f}</text>'
                   for x, y in zip(xs, ys))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}">'
            f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>'
            f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>{dots}'
            f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle" font-size="12">{xlabel}</text>'
            f'<text x="14" y="{h / 2}" font-size="12" transform="rotate(-90 14 {h / 2})" text-anchor="middle">'
            f'{ylabel}</text></svg>')


def run(cfg: StudyConfig, *, data_dir: Path = Path("data"), progress=None) -> dict:
    if len(cfg.pretrain.phases) != 1:
        raise TrainError("the study's CPT recipe must have exactly one phase (its steps are the levels)")
    if not cfg.sft.data:
        raise TrainError("the study needs SFT data (trajectories or JSONL): --sft.data=[...]")
    root = RunDir.create(cfg.out_dir, cfg.name)
    root.write_config(cfg)
    rows = []
    for steps in sorted(cfg.levels):
        phase = replace(cfg.pretrain.phases[0], steps=steps)
        level = root.root / f"cpt-{steps:05d}"
        p = pretrain.run(replace(cfg.pretrain, phases=(phase,), run_dir=level), data_dir=data_dir, progress=progress)
        s = sft.run(replace(cfg.sft, model=p["model"]), run_dir=RunDir.open(root.stage(f"sft-{steps:05d}")),
                    data_dir=data_dir, progress=progress)
        params = json.loads((Path(p["model"]) / "config.json").read_text())
        from opencomposer.model.hf import build

        n_params = sum(t.numel() for t in build(params).parameters())
        rows.append({"cpt_steps": steps, "cpt_tokens": p["tokens"], "cpt_flops": 6 * p["tokens"] * n_params,
                     "cpt_heldout_loss": p["heldout"][-1]["heldout_loss"], "sft_loss": s["loss_after"],
                     "rl_reward": None})
    result = {"rows": rows, "rl": "pending: the RL capability runs the same RL recipe from each SFT model"}
    root.write_json("study.json", result)
    md = ["# CPT vs RL study", "", "| CPT steps | CPT tokens | CPT FLOPs | CPT held-out loss | SFT loss | RL reward |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['cpt_steps']} | {r['cpt_tokens']} | {r['cpt_flops']:.2e} | {r['cpt_heldout_loss']:.4f} | "
           f"{r['sft_loss']:.4f} | pending (RL) |" for r in rows]
    write_atomic(root.root / "study.md", "\n".join(md) + "\n")
    write_atomic(root.root / "study.svg", svg([(r["cpt_flops"], r["sft_loss"]) for r in rows],
                                              "CPT compute (FLOPs, log)", "SFT loss"))
    result["folder"] = str(root.root)
    return result
