"""The RL trainer's step: groups of G graded rollouts -> one Adam step on all parameters under the
Dr. GRPO objective (`rl/objective.py`), plus the step checkpoint that makes a restart exact.

Per group: rewards (with beta * sum k1 taken off when the KL sits in the reward; k1 from the
sampler's logprobs against the frozen reference model's, at the sampled tokens), A = R - mean R;
a group whose advantages are all zero carries no gradient and is counted, not trained, and so is a
rollout whose advantage is zero. Per trained
token: the trainer's logprob in training mode (router replay for MoE) against the sampler's,
summed over every token of every rollout and divided by the constant normaliser.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from opencomposer.kernels.bf16 import resolve_bf16
from opencomposer.rl.copy_blame import token_copy_blame
from opencomposer.rl.forward import SharedPromptForward, sequence_logprobs, shared_prefix
from opencomposer.rl.objective import ObjectiveConfig, call_advantages, group_advantages, rewards_with_kl, token_loss
from opencomposer.rl.rollout import Sample


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    lr: float = 1e-5
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)
    share_prompt: bool = True
    """Compute a group's shared prompt once in the training forward (and the reference model's) and
    accumulate its gradient from all G rollouts: exact, and the prompt's cost paid once (`rl/forward.py`)."""
    frozen: tuple[str, ...] = ()
    """Parameters RL leaves as they are, by name or name prefix (`("embed_tokens",)`: SmolLM2's
    embedding, which is also its tied output head). Their gradient is not computed and Adam holds
    no state for them. Default: none (the report's Adam on all parameters). Why one might: Adam's
    first steps move every weight whose gradient is not ~0 by about lr, and through the softmax
    every row of a tied head has such a gradient, tokens never sampled included. Measured once on
    the embedded default: freezing the embedding left RL's held-out result where all parameters
    took it (5 of 36 from 11; docs/rl.md). A run resumed with a different list cannot load its
    Adam state."""
    bf16: bool | Literal["auto"] = False
    """The training (and reference) forward under bf16 autocast: the blocks' products in bfloat16,
    the head's logprobs, the loss, the weights and Adam in float32. "auto": where the CPU multiplies
    bf16 in hardware (`kernels.bf16.native_bf16`). Measured on SmolLM2-135M, a 2,000-token forward and
    backward: 13.8 s against 19.7 s in float32 (AMD EPYC, AVX-512 BF16), and the trainer's logprobs then
    differ from the float32 sampler's by 0.015 nats a token in the mean (0.10 at the 99th percentile),
    against < 1e-4 in float32 (the conformance tests): the importance ratio (`ObjectiveConfig.correction`)
    sees that as off-policy noise. Default off: float32 keeps the trainer's logprobs equal to the sampler's."""
    checkpoint_tokens: int | None = 1024
    """Forwards of at least this many tokens recompute each block's activations in the backward
    instead of keeping them (activation checkpointing; None: never). Without it the step's memory
    grows by about 1.5 MB per token on SmolLM2-135M (5.6 GB for a 4,000-token rollout, measured), and
    long agent rollouts OOM-killed a 24 GB machine; with it a forward keeps its blocks' inputs (~70 KB per token, computed), for
    one more forward of those sequences only (2,000 tokens, forward + backward: 19 s -> 22 s,
    measured once each; docs/rl.md)."""


def call_terms(group: list[Sample], coef: float) -> dict[int, dict[tuple[int, int], float]]:
    """`ObjectiveConfig.call_advantage`: rollout -> {(segment, completion): its call's advantage},
    only where nonzero (empty when the term is off or every call of each tool got the same verdict)."""
    if not coef:
        return {}
    verdicts = [((si, seq.segment, ci), tool, ok) for si, s in enumerate(group)
                for seq in s.sequences for ci, tool, ok in seq.call_verdicts()]
    out: dict[int, dict[tuple[int, int], float]] = {}
    for (si, segment, ci), a in call_advantages(verdicts, coef).items():
        if a:
            out.setdefault(si, {})[(segment, ci)] = a
    return out


def sampled(seq) -> torch.Tensor:
    return torch.tensor([lp for lp, m in zip(seq.logprobs, seq.loss_mask) if m], dtype=torch.float32)


def trained_parameters(model: torch.nn.Module, frozen: tuple[str, ...]) -> list[torch.nn.Parameter]:
    """The parameters a step trains: all but those named (or prefixed) in `frozen`, which stop
    requiring a gradient. A name that matches no parameter is an error, not a silent no-op."""
    names = dict(model.named_parameters())  # a tied weight appears once, under its first name
    def hit(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix.rstrip(".") + ".")
    for prefix in frozen:
        if not any(hit(n, prefix) for n in names):
            raise ValueError(f"TrainerConfig.frozen: {prefix!r} names no parameter of the model "
                             f"(its parameters begin {sorted({n.split('.')[0] for n in names})})")
    out = []
    for n, p in names.items():
        if any(hit(n, prefix) for prefix in frozen):
            p.requires_grad_(False)
        else:
            out.append(p)
    return out


class RLTrainer:
    def __init__(self, model: torch.nn.Module, objective: ObjectiveConfig, config: TrainerConfig,
                 model_dir: Path | None = None):
        """`model_dir`: the model's folder, whose tokenizer the copy blame decodes sampled ids with
        (needed only with `objective.copy_blame` > 0)."""
        self.model = model
        self.objective = objective
        self.config = config
        self.tokenizer = None
        if objective.copy_blame:
            from opencomposer.tokenizer.bpe import Tokenizer

            if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
                raise ValueError(f"copy_blame needs the model folder's tokenizer.json (model_dir: {model_dir})")
            self.tokenizer = Tokenizer.load(Path(model_dir) / "tokenizer.json")
        self.ref = copy.deepcopy(model).eval() if objective.kl_coef > 0 else None
        if self.ref is not None:
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.opt = torch.optim.Adam(trained_parameters(model, config.frozen), lr=config.lr, betas=config.betas)
        self.bf16 = resolve_bf16(config.bf16)
        self.device_type = next(model.parameters()).device.type
        self.between: Callable[[], None] | None = None
        """Called before each forward or backward pass of a step, where torch's thread count may
        change (the loop's `ThreadShare.borrower`, `rl/threads.py`)."""

    def _between(self) -> None:
        if self.between is not None:
            self.between()

    def _shared(self, model, group: list[Sample], grad: bool) -> SharedPromptForward | None:
        """The group's first sequences share the system prompt and the task: their forward once."""
        firsts = [s.sequences[0] for s in group if s.sequences]
        if not self.config.share_prompt or len(firsts) < 2:
            return None
        n = shared_prefix(firsts)
        return (SharedPromptForward(model, firsts, n, grad=grad, checkpoint=self.config.checkpoint_tokens)
                if n > 0 else None)

    def _group_refs(self, group: list[Sample]) -> list[list[torch.Tensor]]:
        with torch.no_grad():
            shared = self._shared(self.ref, group, grad=False)
            try:
                return [[(shared.logprobs(q) if shared is not None and qi == 0 else sequence_logprobs(self.ref, q))
                         .detach() for qi, q in enumerate(s.sequences)] for s in group]
            finally:
                if shared is not None:
                    shared.close()

    def _train_group(self, group: list[Sample], stats: dict) -> bool:
        """One group's forwards and backwards into the step's gradient, its counts into `stats`;
        whether it backpropagated anything."""
        cfg = self.objective
        calls = call_terms(group, cfg.call_advantage)
        # per rollout, per sequence: the copy blame's tokens (`rl/copy_blame.py`), a term of its own like calls'
        copies = {si: blame for si, s in enumerate(group)
                  if (blame := {qi: b for qi, q in enumerate(s.sequences)
                                if (b := token_copy_blame(q, self.tokenizer, cfg.copy_blame)) is not None})}
        unsolved = cfg.unsolved_groups == "skip" and not any(s.passed for s in group)
        solved = cfg.solved_groups == "skip" and all(s.passed for s in group)
        skipped = unsolved or solved
        # skipped by the outcome; the call term or copy blame may still train it (`call_only_groups`)
        if skipped:
            stats["unsolved_groups_skipped" if unsolved else "solved_groups_skipped"] += 1
            if not calls and not copies:
                return False
        # a group the outcome skips trains no reward, so a KL in the reward has nothing to act on there
        self._between()
        refs = self._group_refs(group) if self.ref is not None and not (skipped and cfg.kl_place == "reward") \
            else None
        kl_sums = [sum(float((sampled(q) - r).sum()) for q, r in zip(s.sequences, rs))
                   for s, rs in zip(group, refs)] if refs is not None else [0.0] * len(group)
        stats["kl"] += sum(kl_sums)
        adv, zero = group_advantages(rewards_with_kl([s.reward for s in group], kl_sums, cfg), cfg.group_size,
                                     cfg.negative_advantages,
                                     tokens=[s.trained_tokens for s in group]
                                     if cfg.baseline == "token_mean" else None)
        if skipped or zero:
            # no outcome signal: only the per-call terms (`call_advantage`, `copy_blame`) train, where
            # they apply
            if zero and not skipped:
                stats["zero_advantage_groups"] += 1
            if not calls and not copies:
                return False
            adv = [0.0] * len(group)
            stats["call_only_groups"] = stats.get("call_only_groups", 0) + 1
        # A rollout at advantage 0 (every one below the mean under `negative_advantages = 0`)
        # has a gradient of exactly 0 under every correction: its forward and backward are skipped,
        # unless the KL sits in the loss, where it still has one, or a call or copy of it has a term of its own.
        live = [i for i, a in enumerate(adv)
                if a != 0.0 or (refs is not None and cfg.kl_place == "loss") or i in calls or i in copies]
        stats["zero_advantage_rollouts"] += len(group) - len(live)
        if not live:
            return False
        self._between()
        shared = self._shared(self.model, [group[i] for i in live], grad=True)
        for si in live:
            s, a = group[si], adv[si]
            for qi, seq in enumerate(s.sequences):
                self._between()
                logp = (shared.logprobs(seq) if shared is not None and qi == 0
                        else sequence_logprobs(self.model, seq, checkpoint=self.config.checkpoint_tokens))
                ref = refs[si][qi] if (refs is not None and cfg.kl_place == "loss") else None
                scale = cfg.failed_call_credit if a > 0 else cfg.failed_call_blame
                factors = seq.token_factors(scale) if a != 0 else None
                if factors is not None:  # failed calls: less (or no) share of the rollout's advantage
                    advantage = a * torch.tensor(factors)
                    stats["scaled_tokens"] = stats.get("scaled_tokens", 0) + sum(f != 1.0 for f in factors)
                else:
                    advantage = torch.tensor(a)
                per_call = seq.token_call_advantages(
                    {ci: c for (g, ci), c in calls.get(si, {}).items() if g == seq.segment})
                if per_call is not None:  # each tool call's own verdict, on its own tokens
                    per_call = torch.tensor(per_call)
                    advantage = advantage.expand_as(per_call) + per_call
                    mass = stats.setdefault("call_mass", [0.0, 0.0])
                    mass[0] += float(per_call.clamp(min=0).sum())
                    mass[1] += float(per_call.clamp(max=0).sum())
                if qi in copies.get(si, {}):  # the token where each failed edit's copy left the file
                    blame, hits = copies[si][qi]
                    advantage = advantage.expand(len(blame)) + torch.tensor(blame)
                    stats["copy_blamed_tokens"] = stats.get("copy_blamed_tokens", 0) + hits
                loss, st = token_loss(logp, sampled(seq), advantage, cfg, logp_ref=ref)
                # the advantages summed over trained tokens, rewarded and blamed apart: under the
                # token sum (Dr. GRPO) a group's longer failures blame more tokens than its passes
                # reward (40% more at f9c8ead's default run, docs/rl.md)
                mass = float(advantage.sum()) if advantage.dim() else a * st["tokens"]
                stats["advantage_mass"][0 if mass >= 0 else 1] += mass
                loss.backward()
                stats["loss"] += float(loss.detach())
                stats["trained_tokens"] += st["tokens"]
                stats["ratio_max"] = max(stats["ratio_max"], st["ratio_max"])
                stats["truncated"] += st.get("truncated", 0)
        if shared is not None:
            self._between()
            shared.backward()  # the prompt's backward once, with every rollout's gradient
            stats["shared_prompt_tokens"] = stats.get("shared_prompt_tokens", 0) + shared.length
        return True

    def step(self, groups: list[list[Sample]]) -> dict:
        t0 = time.perf_counter()
        stats = {"groups": len(groups), "zero_advantage_groups": 0, "unsolved_groups_skipped": 0,
                 "solved_groups_skipped": 0, "trained": [],
                 "zero_advantage_rollouts": 0, "trained_tokens": 0, "advantage_mass": [0.0, 0.0],
                 "kl": 0.0, "ratio_max": 1.0, "truncated": 0, "loss": 0.0, "bf16": self.bf16}
        self.opt.zero_grad(set_to_none=True)
        # bf16 autocast (`TrainerConfig.bf16`): the blocks' products; the head and the loss stay float32
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
            for gi, group in enumerate(groups):
                if self._train_group(group, stats):
                    stats["trained"].append(gi)
        grads = [p for p in self.model.parameters() if p.grad is not None]
        stats["updated"] = bool(grads)  # no gradient, no Adam step: the weights are what they were
        if grads:
            stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(grads, self.config.grad_clip))
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        stats["seconds"] = time.perf_counter() - t0
        tokens = sum(s.trained_tokens for g in groups for s in g)
        stats["kl_per_token"] = stats["kl"] / tokens if tokens else 0.0
        return stats

    # -- step checkpoints ---------------------------------------------------------------------------
    def save(self, path: Path, version: int, trained_groups: list[int]) -> None:
        """Model, optimiser, version and the groups this state has trained on, written whole
        (tmp + rename): a restart either sees all of a step or none of it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict(), "version": version,
                    "trained_groups": sorted(trained_groups)}, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: Path) -> tuple[int, list[int]]:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optim"])
        return int(ckpt["version"]), list(ckpt["trained_groups"])
