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

from opencomposer.core.plot import chart
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
    write_atomic(root.root / "study.svg", chart({"SFT loss": [(r["cpt_flops"], r["sft_loss"]) for r in rows]},
                                                "CPT compute (FLOPs, log)", "SFT loss", log_x=True, lines=False,
                                                labels=True))
    result["folder"] = str(root.root)
    return result
