"""The speedrun's CPT and SFT stages on the embedded default (SmolLM2-135M), sized for minutes.

CPT: a small mix of standard-library code (the base-model evals' repository, `tomllib`, is not in
it), a few optimizer steps, and the base-model evals — codebase perplexity on the held-out
repository and state tracking — before and after. SFT: the trajectories it is given (the speedrun
gives demonstrations of the train split: search, read, edit, compile, answer through the harness's
tools), rendered by the one chat renderer with the loss on assistant tokens only, from the CPT model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from opencomposer.core.metrics import MetricsWriter
from opencomposer.core.rundir import RunDir


@dataclass(frozen=True, kw_only=True, slots=True)
class CPTStageConfig:
    enabled: bool = True
    include: tuple[str, ...] = ("json/*.py", "email/*.py", "http/*.py", "csv.py", "textwrap.py", "shlex.py",
                                "graphlib.py", "colorsys.py", "difflib.py", "string.py")
    max_docs: int = 40
    steps: int = 6
    seq_len: int = 256
    batch_size: int = 2
    lr: float = 2e-5
    eval_repo: str = "stdlib:tomllib"
    eval_tokens: int = 1024
    state_cases: int = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class SFTStageConfig:
    enabled: bool = True
    steps: int = 2
    seq_len: int = 2304
    """The harness's system prompt with its tool schemas is ~1,900 tokens before the first reply;
    a step at this length is ~2.5 TFLOP for SmolLM2 (about 25 s on two cores)."""
    batch_size: int = 1
    """Demonstrations a step; more than one computes the prompt they share once (`train/shared_prefix.py`)."""
    lr: float = 1e-5
    span_edits: bool = False
    """The speedrun's demonstrations edit with the smallest unique part of a changed line as the old
    text (`def read(`, `'escape'`) instead of whole lines with their indentation
    (`evals/demonstration.py`, `minimal_edits`), where that says the change. Off in every preset:
    from one CPT model, SFT held out 12 of 36 with either, and RL from the span model went to 19 of
    36 under seed 0 but 10 (its control 14) under seed 1 (docs/rl.md, "Edits that copy a span")."""
    bf16: bool | Literal["auto"] = False
    """Products and attention under CPU bf16 autocast (`OptimConfig.bf16`; weights, optimiser and
    loss stay float32). "auto": where the CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX;
    `kernels.bf16.native_bf16`): a 2,304-token step took 12.6 s against 21.4 s in float32 on an AMD
    EPYC with AVX-512 BF16, while on an AVX2-only CPU bf16 products are ~4x slower than float32
    (docs/train.md). The summary records what ran. SFT has no train/serve contract to keep (the
    exported weights are the float32 master copy). Held out after the default's SFT, bf16 against
    float32 with the same recipe and seeds: 14 against 12 of 36 on an AMX Xeon (654 s against
    1,236), 8 against 11 on that EPYC (from one CPT model), 13 against 15 in an earlier probe: inside
    the noise each time, so the `default` and `renames-small` presets run "auto"."""


def _base_evals(folder: Path, cfg: CPTStageConfig) -> dict:
    from opencomposer.model.hf import load_model
    from opencomposer.tokenizer.bpe import Tokenizer
    from opencomposer.train import base_evals

    ev = base_evals.BaseEvalConfig(repo=cfg.eval_repo, window=256, stride=128, max_tokens=cfg.eval_tokens,
                                   state_cases=cfg.state_cases, state_diffs=2, state_lines=10)
    model, tok = load_model(folder).eval(), Tokenizer.load(folder)
    return base_evals.run(model, tok, ev)


def run_cpt(cfg: CPTStageConfig, run_dir: RunDir, metrics: MetricsWriter, base: Path, progress=None) -> dict:
    from opencomposer.train import pretrain
    from opencomposer.train.data import MixConfig, SourceConfig
    from opencomposer.train.trainer import OptimConfig, PhaseConfig

    if not (base / "config.json").exists():
        from opencomposer.model.interop import import_default

        import_default(base)
    before = _base_evals(base, cfg)
    mix = MixConfig(sources=(SourceConfig(name="stdlib", path="stdlib", include=cfg.include, max_docs=cfg.max_docs,
                                          weight=1.0),), heldout_fraction=0.1)
    pcfg = pretrain.PretrainConfig(
        model=str(base), mix=mix, run_dir=run_dir.stage("cpt"),
        phases=(PhaseConfig(name="bulk", steps=cfg.steps, seq_len=cfg.seq_len, lr=cfg.lr, warmup=1, schedule="wsd"),),
        optim=OptimConfig(batch_size=cfg.batch_size, ckpt_every=10**6, checkpoint_at_end=False), eval_batches=2)
    summary = pretrain.run(pcfg, progress=progress)
    after = _base_evals(Path(summary["model"]), cfg)
    out = {**summary, "base_evals_before": before, "base_evals_after": after,
           "perplexity_before": before["codebase_perplexity"]["perplexity"],
           "perplexity_after": after["codebase_perplexity"]["perplexity"]}
    run_dir.write_json("cpt/summary.json", out)
    metrics.log(stage="cpt", perplexity_before=out["perplexity_before"], perplexity_after=out["perplexity_after"])
    return out


def run_sft(cfg: SFTStageConfig, run_dir: RunDir, metrics: MetricsWriter, base: Path, data: list[Path],
            progress=None) -> dict:
    """SFT of `base` on the trajectories in `data` (the speedrun passes demonstrations of the train split)."""
    from opencomposer.kernels.bf16 import resolve_bf16
    from opencomposer.train import sft
    from opencomposer.train.trainer import OptimConfig, PhaseConfig

    bf16 = resolve_bf16(cfg.bf16)
    scfg = sft.SFTConfig(model=str(base), data=tuple(map(str, data)),
                         phases=(PhaseConfig(name="sft", steps=cfg.steps, seq_len=cfg.seq_len, lr=cfg.lr, warmup=1,
                                             schedule="constant"),),
                         optim=OptimConfig(batch_size=cfg.batch_size, bf16=bf16, ckpt_every=10**6,
                                           checkpoint_at_end=False))
    summary = {**sft.run(scfg, run_dir=RunDir.open(run_dir.stage("sft")), progress=progress), "bf16": bf16}
    run_dir.write_json("sft/summary.json", summary)
    metrics.log(stage="sft", loss_before=summary["loss_before"], loss_after=summary["loss_after"])
    return summary
