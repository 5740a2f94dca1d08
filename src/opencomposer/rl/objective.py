"""The policy-gradient objective (report §3.1): Dr. GRPO with a k1 KL regulariser.

- G rollouts per prompt, G fixed; advantage A_i = R_i - mean_j R_j, no division by the standard
  deviation (it upweights tiny behavioural differences in groups that are all right or all wrong).
  `baseline = "token_mean"` takes the mean weighted by each rollout's trained tokens instead,
  b = sum_j R_j L_j / sum_j L_j, so that the advantages summed over a group's tokens are zero: a
  token every rollout emits at the same rate gets no net push. Why it exists: under the token sum
  below, a group whose failures are longer than its passes blames such tokens (call syntax, tool
  names) more than it rewards them; at f9c8ead's default run the mixed groups blamed 40% more than
  they rewarded and the policy came out calling tools by invented names (docs/rl.md). Measured once
  on the default speedrun: the two sums came out equal, and the held-out rate still fell (11 -> 6 of
  36). Its cost: a decision made once a rollout (stopping) gets sum_i A_i, which is > 0 when the
  passes are the shorter rollouts, where the plain mean gives 0. Not the default.
- The token loss is summed over every trained token of every rollout and divided by a constant
  (`normalizer`), never by a sequence's own length (Dr. GRPO: per-sequence 1/|y| is a length bias).
- k1 = log pi(x) - log pi_ref(x) per sampled token (the report: KL(q||p) = E_q[-log r], r = p/q).
  Where it goes is a config choice the report leaves open: `kl_place = "reward"` (default) takes
  beta * sum_t k1_t off a rollout's reward before the group baseline; `"loss"` adds beta * k1 to
  the token loss (note: under on-policy samples its expected gradient is zero, which is why the
  reward placement is the default).
- Off-policy correction against the sampler's logprobs (`correction`): `"tis"` (default) weighs
  each token's gradient by min(pi/pi_sampler, cap), detached (truncated importance sampling);
  `"ppo"` uses the clipped surrogate min(r A, clip(r, 1-eps, 1+eps) A); `"none"` assumes on-policy.
- No overlong masking. Single epoch (no prompt twice) is the reconciler's plan (`rl/loop.py`); Adam
  on all parameters is the trainer's (`rl/trainer.py`).
- `negative_advantages` scales the advantages below the group mean (1 = Dr. GRPO as the report has it;
  0 = reinforce only what beat the mean, the positive-sample half of REINFORCE that Zhu et al. 2025,
  "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning", call PSR). Why it
  exists: on `renames-small` (docs/rl.md), at lr 3e-5, Dr. GRPO collapsed the policy into repeated
  edits within two steps (rollouts of 214 tokens grew to 1,130); our guess was the negative half
  pushing down the tokens with which failed attempts stopped. At 0 and the same lr the policy
  collapsed the other way (no edits at all from step 16), so it is not a fix for a step too large.
- `call_advantage` adds a per-call term from the environment's verdict on each tool call, compared
  among the group's calls of the same tool (`call_advantages`; off by default).
Groups whose rewards are all equal carry no outcome gradient: `group_advantages` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveConfig:
    group_size: int = 8
    normalizer: float = 4096.0
    """The constant every loss is divided by (Dr. GRPO); a group's expected trained tokens is a fit."""
    kl_coef: float = 1e-3
    kl_place: Literal["reward", "loss"] = "reward"
    correction: Literal["tis", "ppo", "none"] = "tis"
    tis_cap: float = 2.0
    clip_eps: float = 0.2
    unsolved_groups: Literal["train", "skip"] = "train"
    """A group in which no rollout passed the verifier: "train" on whatever the effort and behaviour
    terms tell its rollouts apart by (the report's rewards as they are), or "skip" it like a group
    whose rewards are all equal, so that those terms only rank attempts within groups the policy
    can solve. Why it exists: in the renames runs of docs/rl.md, groups that passed nothing were most of
    the groups, and training on their behaviour terms alone moved the policy away from SFT."""
    solved_groups: Literal["train", "skip"] = "train"
    """A group in which every rollout passed the verifier: "train" on what the behaviour terms and a
    KL in the reward tell its rollouts apart by, or "skip" it. DAPO's dynamic sampling drops the
    groups whose accuracy is 1 as well as those at 0; with `unsolved_groups = "skip"` as well, only
    groups that split between passes and failures train. Why it exists: at temperature 0.7 on
    `renames-small` (docs/rl.md) 9 of 18 groups all passed, and the trainer, not the rollouts, sets
    the pace there, so each of those steps cost a reference and a policy forward for no outcome signal."""
    baseline: Literal["group_mean", "token_mean"] = "group_mean"
    """What a rollout's reward is measured against: the group's mean reward (Dr. GRPO, the default),
    or its mean weighted by trained tokens, under which a group's advantages sum to zero over its
    tokens (module docstring)."""
    negative_advantages: float = 1.0
    """The factor on advantages below the group mean: 1 keeps Dr. GRPO's (the default), 0 trains only
    on rollouts that beat their group's mean (PSR), between them weighs failures down."""
    failed_call_credit: float = 1.0
    """The factor on a positive advantage for the tokens of a policy call that issued a broken call
    or a failed edit (`rl/rewards.py`); the rest of the rollout keeps its advantage, and a negative
    advantage is never scaled. 1 keeps Dr. GRPO's sequence-level credit (the default); 0 reinforces
    none of a passing rollout's failed calls. Why it exists: at lr 3e-5 on `renames-small`
    (docs/rl.md) passing rollouts that repeated an edit until it failed were reinforced token by
    token, failed calls included, and the policy collapsed into repeating them (rollouts of ~270
    tokens grew to ~1,000 in 6 steps, 82 broken calls in a step), with one group a step and with
    two; the reward's per-call terms lower such a rollout's advantage but leave it positive
    wherever its group has a failure. At 0 the two-group run did not collapse, and still ended
    below its start (docs/rl.md)."""

    failed_call_blame: float = 1.0
    """The factor on a negative advantage for the tokens of a policy call that issued a broken call
    or a failed edit: the counterpart of `failed_call_credit` for rollouts below their group's mean.
    1 keeps Dr. GRPO's credit (the default); 0 (with `failed_call_credit = 0`) leaves such calls out
    of the outcome's credit either way. Why: a broken call or an edit that matched nothing leaves the
    workspace as it was, so it did not cause the outcome; under the token sum its only share of it
    is that failures repeat such calls more than passes do. Read back from the mixed groups of a
    run with `call_advantage = 0.5` and this at 1 (docs/rl.md): the outcome term's advantages summed
    over edit calls came to -11 (applied edits +7.5, failed ones -18.5) against +4.1 on final
    answers, and the policy learned to edit less and answer sooner. What a failed call does wrong is
    then left to `call_advantage`. At 0 (with the credit at 0 and the call term at 0.5) the next run
    kept editing and failed fewer edits on held-out tasks, but broke more; with both at 0 and no call
    term, held out fell 11 -> 3 of 36 and the policy collapsed onto repeated compiles (docs/rl.md)."""
    call_advantage: float = 0.0
    """The weight c of a per-call advantage from the environment's verdict on each tool call:
    every policy call that called a tool gets c (ok - m) on its own tokens, on top of its rollout's
    advantage, where ok is 1 unless it broke a call or failed an edit (`rl/rewards.py`) and m is the
    share of ok calls among the group's calls of the same tool (`call_advantages`). It applies in
    every group, also in one whose outcomes are all equal or that passed nothing (there it is the
    only term). 0 (the default) is Dr. GRPO as the report has it. Why it exists: the outcome reward
    gives every token of a rollout one advantage, and in the renames family's groups what tells a
    pass from a failure is task by task (docs/rl.md: the trained groups' gradients were nearly
    orthogonal to the held-out tasks'), while whether an edit's `old_string` is in the file is the
    same skill in every task and is known per call; the report's reward already penalises poor tool
    calls (§3.2), this gives that penalty its own credit assignment. Comparing a call with calls
    of its own tool keeps an edit from being blamed against reads and searches, which rarely
    break and cannot fail as an edit does."""

    copy_blame: float = 0.0
    """The advantage -c given to the one sampled token that wrote the first character of a failed
    edit's `old_string` past its longest prefix found in the file (`rl/copy_blame.py`), on top of its
    rollout's advantage, in every group (like `call_advantage`, also in one with no outcome signal).
    0 (the default) is Dr. GRPO as the report has it. Why it exists: copying an `old_string`
    exactly is the skill RL carried to held-out tasks here, and the per-call term, which blames every
    token of a failed call alike, pushed the policy from failed edits into broken calls (docs/rl.md)."""

    def __post_init__(self):
        _check_negative(self.negative_advantages)
        if self.call_advantage < 0.0:
            raise ValueError(f"call_advantage is {self.call_advantage}; it must be >= 0")
        if self.copy_blame < 0.0:
            raise ValueError(f"copy_blame is {self.copy_blame}; it must be >= 0")
        if self.baseline not in ("group_mean", "token_mean"):
            raise ValueError(f"baseline is {self.baseline!r}; it must be 'group_mean' or 'token_mean'")
        if not 0.0 <= self.failed_call_blame <= 1.0:
            raise ValueError(f"failed_call_blame is {self.failed_call_blame}; it must be in [0, 1]")
        if not 0.0 <= self.failed_call_credit <= 1.0:
            raise ValueError(f"failed_call_credit is {self.failed_call_credit}; it must be in [0, 1]")


def _check_negative(factor: float) -> None:
    if not 0.0 <= factor <= 1.0:
        raise ValueError(f"negative_advantages is {factor}; it must be in [0, 1]")


def group_advantages(rewards: list[float], group_size: int, negative: float = 1.0,
                     tokens: list[int] | None = None) -> tuple[list[float], bool]:
    """(A_i = R_i - b, whether the group carries no signal). The size must be the fixed G.
    b is the mean reward, or, given each rollout's trained `tokens`, the mean weighted by them
    (`ObjectiveConfig.baseline = "token_mean"`). `negative` multiplies the advantages below the
    baseline (`ObjectiveConfig.negative_advantages`)."""
    if len(rewards) != group_size:
        raise ValueError(f"a group has {len(rewards)} rollouts; the group size is fixed at {group_size}")
    _check_negative(negative)
    if tokens is not None and len(tokens) != len(rewards):
        raise ValueError(f"{len(tokens)} token counts for a group of {len(rewards)}")
    if tokens is not None and min(tokens) < 0:
        raise ValueError(f"a token count is negative: {tokens}")
    if tokens is not None and sum(tokens) > 0:
        mean = sum(r * n for r, n in zip(rewards, tokens)) / sum(tokens)
    else:
        mean = sum(rewards) / len(rewards)
    adv = [r - mean for r in rewards]
    zero = all(abs(a) < 1e-12 for a in adv)
    return [a * negative if a < 0 else a for a in adv], zero


def call_advantages(verdicts: list[tuple[object, str, bool]], coef: float) -> dict[object, float]:
    """`ObjectiveConfig.call_advantage`: per (key, tool, ok) verdict of one group's policy calls,
    key -> coef (ok - m_tool), m_tool the share of ok among the group's calls of that tool; calls of
    a tool whose verdicts all agree get 0."""
    share: dict[str, list[int]] = {}
    for _, tool, ok in verdicts:
        share.setdefault(tool, []).append(int(ok))
    mean = {t: sum(v) / len(v) for t, v in share.items()}
    return {key: coef * (int(ok) - mean[tool]) for key, tool, ok in verdicts}


def k1(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(pi || pi_ref) at sampled tokens: log pi - log pi_ref."""
    return logp - logp_ref


def token_loss(logp: torch.Tensor, logp_sampler: torch.Tensor, advantage: torch.Tensor,
               cfg: ObjectiveConfig, logp_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Summed (not averaged) loss of one sequence's trained tokens, divided by the constant.

    `logp`: the trainer's logprobs (differentiable); `logp_sampler`: the sampler's; `advantage`:
    one value per token (the rollout's A, broadcast) or a scalar."""
    adv = advantage.expand_as(logp) if advantage.dim() == 0 else advantage
    ratio = torch.exp(logp - logp_sampler)
    if cfg.correction == "ppo":
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
    elif cfg.correction == "tis":
        surrogate = torch.clamp(ratio.detach(), max=cfg.tis_cap) * adv * logp
    else:
        surrogate = adv * logp
    loss = -surrogate.sum()
    stats = {"tokens": int(logp.numel()), "ratio_mean": float(ratio.detach().mean()) if logp.numel() else 1.0,
             "ratio_max": float(ratio.detach().max()) if logp.numel() else 1.0}
    if logp_ref is not None:
        kl = k1(logp, logp_ref)
        stats["kl"] = float(kl.detach().sum())
        if cfg.kl_place == "loss":
            loss = loss + cfg.kl_coef * kl.sum()
    if cfg.correction == "tis":
        stats["truncated"] = int((ratio.detach() > cfg.tis_cap).sum())
    return loss / cfg.normalizer, stats


def rewards_with_kl(rewards: list[float], kl_sums: list[float], cfg: ObjectiveConfig) -> list[float]:
    """With `kl_place = "reward"`: R_i - beta * sum_t k1_t (before the group baseline)."""
    if cfg.kl_place != "reward":
        return list(rewards)
    return [r - cfg.kl_coef * k for r, k in zip(rewards, kl_sums, strict=True)]
