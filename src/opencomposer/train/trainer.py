"""The training loop shared by continued pretraining and SFT.

A recipe is a list of phases (report §2: bulk pretraining at a short context, a long-context
extension, then SFT); each phase has its steps, sequence length, learning-rate schedule (linear
warm-up, then cosine, WSD — warm-up/stable/decay — or constant), an optional larger RoPE base for
context extension, and an optional MTP self-distillation weight. AdamW with weight decay on
matrices only, gradient clipping and accumulation, optional bf16 autocast; a checkpoint every N
steps with the model, optimiser, RNG and data position, so an interrupted run resumes to the same
numbers (tested bit for bit).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from opencomposer.core.errors import UserError
from opencomposer.core.metrics import MetricsWriter
from opencomposer.model import checkpoint as ckpt
from opencomposer.model.loss import IGNORE, cross_entropy
from opencomposer.train import distributed, shared_prefix
from opencomposer.train.shared_prefix import SharedPrefixBatch

log = logging.getLogger(__name__)


class TrainError(ValueError, UserError):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseConfig:
    name: str = "bulk"
    steps: int = 100
    seq_len: int = 512
    lr: float = 3e-4
    warmup: int = 10
    schedule: str = "cosine"
    """cosine | wsd | constant (after the linear warm-up)."""
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    """wsd: the share of the phase spent decaying."""
    rope_theta: float | None = None
    """A larger RoPE base for this phase (context extension by adjusted base frequency)."""
    mtp_weight: float = 0.0
    """MTP self-distillation: weight of KL(main head || MTP head) (models with MTP heads)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    batch_size: int = 4
    grad_accum: int = 1
    clip: float = 1.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    bf16: bool = False
    ckpt_every: int = 50
    keep_checkpoints: int = 2
    checkpoint_at_end: bool = True
    """Also checkpoint at the last step (a short run that only exports its model can skip it)."""


def lr_at(step: int, phase: PhaseConfig) -> float:
    """Learning rate at `step` (0-based within the phase)."""
    if phase.schedule not in ("cosine", "wsd", "constant"):
        raise TrainError(f"unknown schedule {phase.schedule!r} (cosine, wsd, constant)")
    if phase.warmup and step < phase.warmup:
        return phase.lr * (step + 1) / phase.warmup
    lo = phase.lr * phase.min_lr_ratio
    if phase.schedule == "constant":
        return phase.lr
    if phase.schedule == "cosine":
        span = max(1, phase.steps - phase.warmup)
        frac = min(1.0, (step - phase.warmup) / span)
        return lo + (phase.lr - lo) * 0.5 * (1 + math.cos(math.pi * frac))
    decay = max(1, int(phase.steps * phase.decay_fraction))  # wsd
    start = phase.steps - decay
    if step < start:
        return phase.lr
    return phase.lr + (lo - phase.lr) * (step - start + 1) / decay


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(cfg.beta1, cfg.beta2))


def mtp_distill_loss(model, ids: torch.Tensor, segments: torch.Tensor | None, labels: torch.Tensor,
                     weight: float) -> tuple[torch.Tensor, float]:
    """Main-head cross-entropy plus `weight` x KL(main || MTP-1): the MTP head at position i
    learns the main head's full distribution at position i+1 (both predict token i+2), the
    self-distillation of report §3.1. Returns (loss, kl)."""
    out = model(ids, segments=segments, mtp=True)
    logits = out.logits[:, :-1]
    main = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=IGNORE)
    student = torch.log_softmax(out.mtp_logits[0].float(), -1)                  # (B, T-1, V): predicts i+2
    teacher = torch.log_softmax(out.logits[:, 1:].detach().float(), -1)        # position i+1 predicts i+2
    kl = (teacher.exp() * (teacher - student)).sum(-1)                          # (B, T-1)
    # position i is distilled when tokens i+1 and i+2 are both real targets in i's document
    valid = torch.zeros_like(kl, dtype=torch.bool)
    valid[:, :-1] = (labels[:, :-1] != IGNORE) & (labels[:, 1:] != IGNORE)
    kl_mean = (kl * valid).sum() / valid.sum().clamp(min=1)
    return main + weight * kl_mean, float(kl_mean.detach())


# ids, segments, labels (aligned to ids[:, 1:]); or rows that begin with the same prompt, whose prefix
# is computed once (SFT: `train/shared_prefix.py`)
Batch = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | SharedPrefixBatch


class Trainer:
    """Runs phases over a batch source; owns the optimiser, checkpoints and metrics."""

    def __init__(self, model, optim: OptimConfig, phases: tuple[PhaseConfig, ...], ckpt_dir: Path,
                 metrics: MetricsWriter | None = None, *, tokenizer_json: Path | None = None):
        if not phases:
            raise TrainError("a recipe needs at least one phase")
        for p in phases:
            lr_at(0, p)  # validates the schedule name
            if p.mtp_weight and not len(getattr(model, "mtp", ())):
                raise TrainError(f"phase {p.name!r}: mtp_weight needs a model with MTP heads")
        self.rank, self.world = distributed.setup()
        if self.world > 1:
            distributed.shard(model)
        self.model, self.optim_cfg, self.phases = model, optim, phases
        self.ckpt_dir, self.tokenizer_json = Path(ckpt_dir), tokenizer_json
        self.metrics = metrics if self.rank == 0 else None
        self.opt = make_optimizer(model, optim, phases[0].lr)
        self.step = 0
        self.base_rope = getattr(model.config, "rope_theta", None)

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def phase_of(self, step: int) -> tuple[int, int]:
        """(phase index, step within the phase) of a global step."""
        for i, p in enumerate(self.phases):
            if step < p.steps:
                return i, step
            step -= p.steps
        return len(self.phases), 0

    def resume(self) -> dict:
        """Load the latest checkpoint if any; returns its data position ({} when starting)."""
        path = ckpt.latest(self.ckpt_dir)
        if path is None:
            return {}
        if self.world > 1:
            state = distributed.load(self, path)
        else:
            state = ckpt.load(path, self.model, self.opt, tokenizer_json=self.tokenizer_json)
        self.step = state.step
        log.info("resumed from %s (step %d)", path, self.step)
        return state.data_position

    def _set_rope(self, phase: PhaseConfig) -> None:
        theta = phase.rope_theta or self.base_rope
        if theta is not None and getattr(self.model.config, "rope_theta", None) != theta:
            self.model.config = dataclasses.replace(self.model.config, rope_theta=theta)
            for m in self.model.modules():  # attention modules keep a reference to the config
                if hasattr(m, "cfg"):
                    m.cfg = self.model.config

    def run(self, batches: Callable[[int, PhaseConfig], Batch], data_state: Callable[[], dict],
            on_progress: Callable[[int, dict], None] | None = None, stop_at: int | None = None) -> list[dict]:
        """Train from `self.step` to the end (or `stop_at`). `batches(phase_index, phase)` gives
        one micro-batch; `data_state()` the data position to checkpoint."""
        model, cfg = self.model, self.optim_cfg
        model.train()
        history = []
        end = min(self.total_steps, stop_at if stop_at is not None else self.total_steps)
        while self.step < end:
            pi, local = self.phase_of(self.step)
            phase = self.phases[pi]
            self._set_rope(phase)
            lr = lr_at(local, phase)
            for g in self.opt.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            total, tokens, kl = 0.0, 0, None
            for _ in range(cfg.grad_accum):
                batch = batches(pi, phase)
                if isinstance(batch, SharedPrefixBatch):
                    if self.world > 1 or phase.mtp_weight:
                        raise TrainError("a shared-prefix batch trains in one process without MTP; "
                                         "give this run padded batches")
                    count = batch.labelled()
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                        loss_value = shared_prefix.backward(model, batch, 1.0 / cfg.grad_accum)
                    if not math.isfinite(loss_value):
                        raise TrainError(f"step {self.step}: loss is {loss_value} — the gradient is not applied "
                                         "(the last checkpoint is intact)")
                    total += loss_value / cfg.grad_accum
                    tokens += count
                    continue
                ids, seg, labels = batch
                count = int((labels != IGNORE).sum())  # labelled tokens of the global batch
                if self.world > 1:  # this rank's rows; the loss scaled to the global mean's gradient
                    ids, labels = ids[self.rank::self.world], labels[self.rank::self.world]
                    seg = None if seg is None else seg[self.rank::self.world]
                local = int((labels != IGNORE).sum())
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                    if phase.mtp_weight:
                        loss, kl = mtp_distill_loss(model, ids, seg, labels, phase.mtp_weight)
                    else:
                        h = model(ids, logits=False, segments=seg).hidden
                        loss = cross_entropy(h[:, :-1], model.lm_head.weight, labels)
                if not torch.isfinite(loss):
                    raise TrainError(f"step {self.step}: loss is {loss.item()} — stopping before it reaches the "
                                     "weights (the last checkpoint is intact)")
                share = local / max(count, 1)  # this rank's part of the global mean
                (loss * share * self.world / cfg.grad_accum).backward()
                total += loss.item() * share / cfg.grad_accum
                tokens += count
            if self.world > 1:
                total = distributed.all_sum(total)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip) if cfg.clip else torch.tensor(0.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            secs = time.perf_counter() - t0
            rec = {"step": self.step, "phase": phase.name, "loss": total, "lr": lr, "grad_norm": float(norm),
                   "tokens": tokens, "tokens_per_second": tokens / secs if secs else 0.0}
            if kl is not None:
                rec["mtp_kl"] = kl
            history.append(rec)
            if self.metrics is not None:
                self.metrics.log(**rec)
            if on_progress:
                on_progress(self.step, rec)
            if self.step % cfg.ckpt_every == 0 or (self.step == end and cfg.checkpoint_at_end):
                self.save(data_state())
        return history

    def save(self, data_position: dict) -> Path | None:
        if self.world > 1:
            path = distributed.save(self, data_position)
            if self.rank != 0:
                return path
        else:
            path = ckpt.save(self.ckpt_dir, self.model, self.opt, ckpt.TrainState(step=self.step,
                                                                              data_position=data_position),
                             tokenizer_json=self.tokenizer_json)
        old = sorted(self.ckpt_dir.glob("step_*"))[: -self.optim_cfg.keep_checkpoints]
        for p in old:
            import shutil

            shutil.rmtree(p, ignore_errors=True)
        return path
