"""The speedrun's RL stage: the asynchronous loop (`rl/loop.py`) on the SFT model, over the task
family's train split, with the agent settings every agent stage shares. The loop writes its own
files into `rl/` (events, metrics, group and step checkpoints, weights); a resumed speedrun resumes
the loop from them. The trained policy is exported to `rl/model` for the agent eval after it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from opencomposer.core.metrics import MetricsWriter, read_jsonl
from opencomposer.core.rundir import RunDir


@dataclass(frozen=True, kw_only=True, slots=True)
class RLStageConfig:
    steps: int = 8
    minutes: float | None = None
    """A wall-clock budget for the loop's training (`RLConfig.minutes`): it stops at `steps` or
    when this runs out, whichever comes first."""
    epochs: int = 1
    """Passes over the train split (`RLConfig.epochs`). 1: the report's single epoch, no prompt
    trained twice; the run also ends when the split is used up, before `steps` or `minutes` if
    it comes first. 0: as many passes as `steps` needs (a family smaller than `steps`)."""
    groups_per_step: int = 1
    group_size: int = 4
    max_inflight_groups: int = 2
    max_staleness: int = 2
    workers: int = 2
    sync: bool = False
    """True: the synchronous baseline (staleness 0; deterministic with workers = 1)."""
    lr: float = 1e-6
    frozen: tuple[str, ...] = ()
    """Parameters RL does not train, by name prefix (`TrainerConfig.frozen`; `["embed_tokens"]` for
    SmolLM2's tied embedding and head)."""
    kl_coef: float = 0.001
    normalizer: float = 4096.0
    effort: float = 0.1
    """Weight of the concave effort penalty (report §4.2)."""
    failed_edit: float = 0.0
    """Taken off per edit that changed nothing (`RewardConfig.failed_edit`)."""
    broken_call: float = 0.05
    """Taken off per broken tool call (`RewardConfig.broken_call`). In the `renames` run of
    e856465 (effort 0) 13 of 15 groups passed nothing and trained on this term alone; at 0, such a group
    carries a gradient only where the other behaviour terms (todos, comment dumps, terminal
    collapse; `RewardConfig`) tell its rollouts apart."""
    unsolved_groups: Literal["train", "skip"] = "train"
    """A group where no rollout passed: trained on the effort and behaviour terms ("train"), or
    not trained at all ("skip"; `ObjectiveConfig.unsolved_groups`)."""
    solved_groups: Literal["train", "skip"] = "train"
    """A group where every rollout passed: trained on the behaviour terms and the KL ("train"), or
    not trained at all ("skip"; `ObjectiveConfig.solved_groups`)."""
    baseline: Literal["group_mean", "token_mean"] = "group_mean"
    """A rollout's reward against its group's mean (Dr. GRPO) or against the mean weighted by
    trained tokens, under which a group's advantages sum to zero over its tokens
    (`ObjectiveConfig.baseline`)."""
    negative_advantages: float = 1.0
    """The factor on advantages below the group mean (`ObjectiveConfig.negative_advantages`): 1 is
    Dr. GRPO, 0 trains only on the rollouts that beat their group."""
    failed_call_credit: float = 1.0
    """The factor on a positive advantage for the tokens of a policy call that broke a call or
    failed an edit (`ObjectiveConfig.failed_call_credit`): 1 is Dr. GRPO's credit, 0 none."""
    failed_call_blame: float = 1.0
    """The factor on a negative advantage for the tokens of a policy call that broke a call or
    failed an edit (`ObjectiveConfig.failed_call_blame`): 1 is Dr. GRPO's credit, 0 none."""
    call_advantage: float = 0.0
    """A per-call advantage from the environment's verdict on each tool call, compared among the
    group's calls of the same tool (`ObjectiveConfig.call_advantage`); 0 is off."""
    copy_blame: float = 0.0
    """A negative advantage on the one token where a failed edit's copy left the file
    (`ObjectiveConfig.copy_blame`, `rl/copy_blame.py`); 0 is off."""
    bf16: bool | Literal["auto"] = False
    """The trainer's forwards under bf16 autocast (`TrainerConfig.bf16`; "auto": where the CPU
    multiplies bf16 in hardware). Faster steps; its logprobs then differ from the float32 sampler's."""
    checkpoint_tokens: int | None = 1024
    """Forwards of at least this many tokens recompute their activations in the backward
    (`TrainerConfig.checkpoint_tokens`; None, from Python, never). A group's shared prompt (~1,200
    tokens with the recipes' four tools) is one such forward at the default; at 2,048 it keeps them
    (with `borrow_threads`, trainer steps 1.21x faster in one pair of runs, docs/rl.md)."""
    lend_threads: bool = True
    """The replica takes the trainer's threads while the trainer waits (`RLConfig.lend_threads`)."""
    borrow_threads: bool = True
    """The trainer takes the replica's threads while no rollout is in flight (`RLConfig.borrow_threads`)."""
    skip_settled: bool = False
    """Tasks whose earlier group all passed or all failed go behind those that split
    (`CurriculumConfig.skip_settled`, `rl/curriculum.py`)."""
    services: Literal["processes", "threads", "ray"] = "processes"
    """Where the replica and rollout workers run (`RLConfig.services`): "ray" puts them on a Ray
    cluster (`RAY_ADDRESS`, or a local one for the stage). The speedrun's agent evaluations run
    on this machine whatever this says."""


def staleness(steps: list[dict]) -> dict[str, int]:
    """Trained tokens by versions behind the trainer, summed over a run's `metrics.jsonl` records."""
    out: dict[str, int] = {}
    for rec in steps:
        for k, v in rec.get("staleness", {}).items():
            out[k] = out.get(k, 0) + v
    return out


def loop_config(cfg: RLStageConfig, agent, model: Path, tasks: Path, split: str, epochs: int,
                task_ids: tuple[str, ...] = ()):
    """The loop's `RLConfig` for this stage: its own settings plus the harness every agent stage
    shares (`agent`), so RL rolls out exactly as the evals measure."""
    from opencomposer.rl.curriculum import CurriculumConfig
    from opencomposer.rl.loop import RLConfig
    from opencomposer.rl.objective import ObjectiveConfig
    from opencomposer.rl.rewards import RewardConfig
    from opencomposer.rl.trainer import TrainerConfig

    return RLConfig(model=model, tasks=tasks, split=split, task_ids=task_ids, evaluate=False, steps=cfg.steps,
                    minutes=cfg.minutes,
                    groups_per_step=cfg.groups_per_step, max_inflight_groups=cfg.max_inflight_groups,
                    max_staleness=cfg.max_staleness, sync=cfg.sync, workers=cfg.workers, epochs=epochs,
                    seed=agent.seed, temperature=agent.temperature, turn_tokens=agent.turn_tokens,
                    max_turns=agent.max_turns, rollout_timeout_s=agent.episode_timeout_s, tools=agent.tools,
                    slots=agent.slots, trainer=TrainerConfig(lr=cfg.lr, frozen=cfg.frozen, bf16=cfg.bf16,
                                                                  checkpoint_tokens=cfg.checkpoint_tokens),
                    objective=ObjectiveConfig(group_size=cfg.group_size, normalizer=cfg.normalizer,
                                              kl_coef=cfg.kl_coef, unsolved_groups=cfg.unsolved_groups,
                                              solved_groups=cfg.solved_groups,
                                              baseline=cfg.baseline,
                                              negative_advantages=cfg.negative_advantages,
                                              failed_call_credit=cfg.failed_call_credit,
                                              failed_call_blame=cfg.failed_call_blame,
                                              call_advantage=cfg.call_advantage, copy_blame=cfg.copy_blame),
                    rewards=RewardConfig(effort=cfg.effort, failed_edit=cfg.failed_edit,
                                         broken_call=cfg.broken_call), services=cfg.services,
                    lend_threads=cfg.lend_threads, borrow_threads=cfg.borrow_threads,
                    curriculum=CurriculumConfig(skip_settled=cfg.skip_settled, settle_after=cfg.group_size))


def plan_epochs(cfg: RLStageConfig, n_tasks: int) -> int:
    """Passes over a train split of `n_tasks`: `cfg.epochs`, or (0) enough for `cfg.steps` groups."""
    return cfg.epochs or max(1, math.ceil(cfg.steps * cfg.groups_per_step / n_tasks))


def run(cfg: RLStageConfig, agent, run_dir: RunDir, metrics: MetricsWriter, model: Path, tasks: Path,
        split: str = "train", progress=None, task_ids: tuple[str, ...] = ()) -> dict:
    """The RL loop on `split` of `tasks` (only `task_ids` of it where given)."""
    from opencomposer.rl.loop import run as run_loop
    from opencomposer.tasks.format import load_dataset

    if not (model / "config.json").exists():
        raise FileNotFoundError(f"rl: no model at {model} (did SFT fail?)")
    keep = set(task_ids)
    n = len([t for t in load_dataset(tasks, split) if not keep or t.id in keep])
    if not n:
        raise RuntimeError(f"rl: no tasks in split {split!r} of {tasks}"
                           + (" among those kept for RL" if keep else ""))
    epochs = plan_epochs(cfg, n)
    rcfg = loop_config(cfg, agent, model, tasks, split, epochs, task_ids)
    out = run_dir.stage("rl")
    summary = run_loop(rcfg, out, progress=progress)
    steps = summary.pop("steps")
    curve = list(read_jsonl(out / "metrics.jsonl"))  # every step of the run, resumed ones included
    result = {**summary, "model": str(out / "model"), "train_tasks": n, "epochs": epochs, "steps_this_call": len(steps),
              "curve": [{k: rec[k] for k in ("step", "version", "reward", "pass_rate", "kl_per_token", "loss",
                                              "tokens_per_rollout", "turns_per_rollout", "zero_advantage_groups",
                                              "broken_calls", "edit_rate", "train_seconds", "publish_seconds",
                                              "delta_bytes", "full_bytes")}
                        | {"updated": rec.get("updated", True),
                           **{k: rec.get(k, 0) for k in ("unsolved_groups_skipped", "solved_groups_skipped")}}
                        for rec in curve],
              "staleness": staleness(curve)}
    run_dir.write_json("rl/summary.json", result)
    metrics.log(stage="rl", steps=len(curve), reward_first=curve[0]["reward"] if curve else None,
                reward_last=curve[-1]["reward"] if curve else None)
    return result
