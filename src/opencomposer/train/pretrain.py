"""`opencomposer pretrain -c recipe.toml`: continued pretraining on a code mix (report §2).

    model = "default"            # the embedded SmolLM2-135M-Instruct, or a model folder
    [mix]                        # sources, weights (adding up to 1), filters, held-out share
    [[mix.sources]]
    name = "stdlib"; path = "stdlib"; weight = 1.0
    [optim]                      # batch, accumulation, clipping, weight decay, bf16, checkpoints
    [[phases]]                   # bulk at a short context, then e.g. a long-context extension
    name = "bulk"; steps = 200; seq_len = 512; lr = 3e-4; schedule = "wsd"

The run folder holds the built dataset (`data/`), checkpoints (`checkpoints/step_*`), metrics, the
final model as a servable Hugging Face folder (`model/`, with its tokenizer) and `summary.json`
with held-out loss before and after each phase. Re-running the same command resumes from the
last checkpoint.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opencomposer.core.metrics import MetricsWriter
from opencomposer.core.rundir import RunDir
from opencomposer.train.data import MixConfig, PackedSampler, SourceConfig, build
from opencomposer.train.trainer import OptimConfig, PhaseConfig, Trainer, TrainError


def default_mix() -> MixConfig:
    return MixConfig(sources=(SourceConfig(name="stdlib", path="stdlib", weight=1.0,
                                           exclude=("**/test/**", "**/tests/**", "**/idlelib/**", "**/__pycache__/**",
                                                    "**/site-packages/**")),))


@dataclass(frozen=True, kw_only=True, slots=True)
class PretrainConfig:
    model: str = "default"
    """A model folder (config.json, safetensors, tokenizer.json) or "default"."""
    moe_backend: str = ""
    """The expert path of a MoE model (`nvfp4`, `mxfp8`, `fp8-block`, `bf16`, `torch`); "" keeps the
    model's own (float32 `torch`). See docs/kernels.md."""
    mix: MixConfig = field(default_factory=default_mix)
    dataset: Path | None = None
    """A built dataset folder to use instead of building `mix` into the run folder."""
    phases: tuple[PhaseConfig, ...] = (PhaseConfig(),)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 0
    max_steps: int | None = None
    """Stop (with a checkpoint) after this global step; running again continues from there."""
    eval_batches: int = 4
    """Held-out batches for the loss before/after each phase."""
    out_dir: Path = Path("runs")
    name: str = "pretrain"
    run_dir: Path | None = None
    """Resume (or write) this exact run folder."""


def load_base(spec: str, data_dir: Path, moe_backend: str = ""):
    """(model, tokenizer, folder) for "default" or a model folder, its experts on `moe_backend`."""
    from opencomposer.model.hf import load_model
    from opencomposer.model.interop import import_default
    from opencomposer.model.moe import use_backend
    from opencomposer.tokenizer.bpe import Tokenizer

    folder = data_dir / "models" / "smollm2-135m-instruct" if spec == "default" else Path(spec)
    if spec == "default" and not (folder / "config.json").exists():
        import_default(folder)
    model = load_model(folder)
    if moe_backend:
        try:
            use_backend(model, moe_backend)
        except ValueError as e:
            raise TrainError(f"{folder}: {e}") from None
    tok = Tokenizer.load(folder)
    if tok.vocab_size > model.config.vocab_size:
        raise TrainError(f"{folder}: tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size}")
    return model, tok, folder


@torch.no_grad()
def heldout_loss(model, dataset: Path, seq_len: int, batches: int, batch_size: int, seed: int) -> float | None:
    from opencomposer.model.loss import causal_lm_loss
    from opencomposer.train.data import DataError

    try:
        sampler = PackedSampler(dataset, "heldout", seq_len=seq_len, seed=seed + 10_000)
    except DataError:
        return None
    was = model.training
    model.eval()
    losses = []
    for _ in range(batches):  # every rank runs the same batches (FSDP forwards are collective)
        ids, seg = sampler.batch(batch_size)
        losses.append(float(causal_lm_loss(model, ids, segments=seg)))
    model.train(was)
    return sum(losses) / len(losses)


def export(model, tok_folder: Path, out: Path) -> Path:
    """The trained model as a servable folder (weights, config, tokenizer, chat template). Under
    FSDP every rank takes part in gathering the weights and rank 0 writes them."""
    from opencomposer.model.hf import save_model
    from opencomposer.train import distributed

    if distributed.setup()[1] > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not distributed.is_main():
            return out
        model = type(model)(model.config)
        model.load_state_dict(full)
    save_model(model, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tok_folder / name).exists():
            shutil.copy2(tok_folder / name, out / name)
    return out


def run(cfg: PretrainConfig, *, run_dir: RunDir | None = None, data_dir: Path = Path("data"),
        progress=None) -> dict:
    from opencomposer.train import distributed

    _, world = distributed.setup()
    if world > 1 and run_dir is None and cfg.run_dir is None:
        raise TrainError("a distributed run needs --run_dir (every rank must use the same folder)")
    if run_dir is None and cfg.run_dir is not None:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        run_dir = RunDir.open(cfg.run_dir)  # re-running resumes from its checkpoints
    elif run_dir is None:
        run_dir = RunDir.create(cfg.out_dir, cfg.name)
    main = distributed.is_main()
    if main:
        run_dir.write_config(cfg)
    torch.manual_seed(cfg.seed)
    model, tok, folder = load_base(cfg.model, data_dir, cfg.moe_backend)
    dataset = cfg.dataset
    if dataset is None:
        dataset = run_dir.root / "data"
        if main and not (dataset / "mix.json").exists():
            build(cfg.mix, tok, dataset)
        distributed.barrier()
    with MetricsWriter(run_dir.metrics if main else run_dir.root / f"metrics.rank{distributed.setup()[0]}.jsonl") \
            as metrics:
        trainer = Trainer(model, cfg.optim, cfg.phases, run_dir.root / "checkpoints", metrics,
                          tokenizer_json=folder / "tokenizer.json")
        position = trainer.resume()
        samplers: dict[int, PackedSampler] = {}

        def sampler_for(pi: int, phase: PhaseConfig) -> PackedSampler:
            if pi not in samplers:
                samplers.clear()  # one phase at a time
                s = PackedSampler(dataset, "train", seq_len=phase.seq_len, seed=cfg.seed + pi)
                if position.get("phase") == pi and position.get("sampler"):
                    s.load_state(position["sampler"])
                samplers[pi] = s
            return samplers[pi]

        def batches(pi: int, phase: PhaseConfig):
            from opencomposer.model.loss import IGNORE

            ids, seg = sampler_for(pi, phase).batch(cfg.optim.batch_size)
            labels = ids[:, 1:].masked_fill(seg[:, 1:] != seg[:, :-1], IGNORE)
            return ids, seg, labels

        def data_state() -> dict:
            for pi, s in samplers.items():  # at most one: the current phase's
                return {"phase": pi, "sampler": s.state()}
            return {}

        evals = []
        ev = cfg.phases[0].seq_len
        before = heldout_loss(model, dataset, ev, cfg.eval_batches, cfg.optim.batch_size, cfg.seed)
        evals.append({"step": trainer.step, "heldout_loss": before})
        history = trainer.run(batches, data_state, on_progress=progress, stop_at=cfg.max_steps)
        after = heldout_loss(model, dataset, ev, cfg.eval_batches, cfg.optim.batch_size, cfg.seed)
        evals.append({"step": trainer.step, "heldout_loss": after})
        metrics.log(step=trainer.step, heldout_loss_before=before, heldout_loss_after=after)
    out = export(model, folder, run_dir.root / "model")
    distributed.barrier()
    summary = {"base": str(folder), "model": str(out), "steps": trainer.step, "dataset": str(dataset),
               "heldout": evals, "final_loss": history[-1]["loss"] if history else None,
               "tokens": sum(h["tokens"] for h in history),
               "tokens_per_second": (sum(h["tokens_per_second"] for h in history) / len(history)) if history else None}
    if main:
        run_dir.write_json("summary.json", summary)
    return summary
