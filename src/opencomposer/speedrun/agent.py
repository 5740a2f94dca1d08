"""The speedrun's agent stages: a model served by our server, acting through the real harness on
the task family's held-out split, graded in sandboxes (`agent_base`, `agent_sft`, `agent_rl` all
measure the same way); and the demonstrations SFT learns from (grep, read, edit, compile, answer,
built from the train split's gold changes through the same restricted tool set).

Every episode samples from its own seed (task, pass), so a rerun, or a resumed run, draws the same
tokens; with `concurrency` 1 the batches the engine forms are the same too, and the numbers repeat
exactly (the smoke preset relies on it)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from opencomposer.core.metrics import MetricsWriter, read_jsonl
from opencomposer.core.rundir import RunDir


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentSettings:
    """How the agent runs in every agent stage (demonstrations, evals, RL rollouts): one harness."""
    tools: tuple[str, ...] = ("grep", "read_file", "search_replace", "run_terminal_cmd")
    """Fewer tools, a shorter prompt (report §4 removes tools in training for steerability)."""
    turn_tokens: int = 256
    """max_tokens per policy call: the embedded default rambles to the limit otherwise."""
    max_turns: int = 6
    temperature: float = 1.0
    seed: int = 0
    episode_timeout_s: float = 900.0
    slots: int = 8
    """Engine slots of the served model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentEvalConfig:
    split: str = "held_out"
    samples: int = 4
    """K: passes per task (mean pass rate over all of them, best-of-K per task)."""
    max_tasks: int | None = None
    concurrency: int = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentControlConfig:
    """`agent_control`: the lr = 0 control of RL (issue 13's proof). RL at learning rate 0 computes
    every gradient and changes no weight, bit for bit (`tests/unit/test_rl_trainer.py`), so what
    such a run would export is the SFT model itself, and its agent eval, with the same seeds, is
    this stage: the SFT model evaluated once more, exactly as `agent_rl` evaluates RL's model. The
    difference from `agent_sft` is then the noise of evaluating one policy twice (the engine's
    batches differ with concurrent episodes), which is what a rise after RL must clear."""
    enabled: bool = False


def harness(agent: AgentSettings):
    from opencomposer.harness.agent import harness_config

    return harness_config(agent.tools, agent.max_turns, agent.episode_timeout_s)


def run_agent_eval(name: str, cfg: AgentEvalConfig, agent: AgentSettings, run_dir: RunDir, metrics: MetricsWriter,
                   model: Path, tasks: Path, progress=None) -> dict:
    from opencomposer.evals.runner import EvalConfig, policy_factory, run_eval
    from opencomposer.harness.openai_policy import OpenAIPolicyConfig
    from opencomposer.inference.server import ServeConfig, Server, load_served

    if not (model / "config.json").exists():
        raise FileNotFoundError(f"{name}: no model at {model} (did the stage that makes it fail?)")
    engine, tok = load_served(model, slots=agent.slots)
    server = Server(engine, tok, "policy", ServeConfig(port=0, default_max_tokens=agent.turn_tokens)).start()
    out = run_dir.stage(name)
    try:
        ecfg = EvalConfig(tasks=tasks, split=cfg.split, passes=cfg.samples, concurrency=cfg.concurrency,
                          max_tasks=cfg.max_tasks, agent=harness(agent),
                          policy=OpenAIPolicyConfig(temperature=agent.temperature, max_tokens=agent.turn_tokens,
                                                    seed=agent.seed, timeout_s=agent.episode_timeout_s, max_retries=0))
        s = run_eval(ecfg, policy_factory(server.url, "policy", ecfg.policy), out, progress=progress)
        engine_stats = {k: v for k, v in engine.stats.items() if isinstance(v, (int, float))}
    finally:
        server.stop()
    summary = {"model": str(model), "split": cfg.split, "samples": cfg.samples, "tasks": s["tasks"],
               "episodes": s["episodes"], "infra_errors": s["infra_errors"], "accuracy": s["accuracy"],
               "accuracy_ci95": s["accuracy_ci95"], "pass@1": s["pass@1"],
               f"best_of_{cfg.samples}": s[f"best_of_{cfg.samples}"], "best_of_k": s[f"best_of_{cfg.samples}"],
               "tool_error_rate": s["tool_error_rate"], **episode_stats(out)}
    summary["engine"] = engine_stats
    run_dir.write_json(f"{name}/summary.json", summary)
    metrics.log(stage=name, accuracy=summary["accuracy"], best_of_k=summary["best_of_k"])
    return summary


def episode_stats(out: Path) -> dict:
    """Per-task and mean tokens, turns, cost and the tool-use mix, from the eval's own files."""
    latest = {(r["task"], r["pass"]): r for r in read_jsonl(out / "results.jsonl")}
    records = [r for r in latest.values() if r["status"] != "infra_error"]
    mix: Counter = Counter()
    for r in records:
        path = out / "trajectories" / f"{r['task']}.{r['pass']}.json"
        if path.exists():
            mix.update(c["name"] for c in json.loads(path.read_text()).get("tool_calls", []))
    per_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        per_task[r["task"]].append(r)
    n = max(1, len(records))

    def mean(rs, k):
        return sum(r[k] for r in rs) / max(1, len(rs))

    return {
        "mean_turns": mean(records, "turns"), "mean_prompt_tokens": mean(records, "prompt_tokens"),
        "mean_completion_tokens": mean(records, "completion_tokens"), "mean_tool_calls": mean(records, "tool_calls"),
        "mean_cost_usd": mean(records, "cost_usd"), "mean_seconds": mean(records, "seconds"),
        "tool_mix": {k: v / n for k, v in sorted(mix.items())},
        "per_task": {t: {"passed": sum(r["passed"] for r in rs), "episodes": len(rs), "turns": mean(rs, "turns"),
                         "completion_tokens": mean(rs, "completion_tokens"), "tool_calls": mean(rs, "tool_calls"),
                         "cost_usd": mean(rs, "cost_usd")} for t, rs in sorted(per_task.items())},
    }


TURN_CHARS_PER_TOKEN = 1.5
"""Characters of tool-call arguments a demonstration puts in one turn, per token of `turn_tokens`:
with SmolLM2's tokenizer an edit's JSON-escaped code takes about 0.5 tokens a character plus ~20 a
call, so 1.5 x 256 = 384 characters rendered to at most 228 tokens on the rename family."""


def kept_for_rl(tasks: Path, split: str, share: float) -> tuple[str, ...]:
    """The tasks of `split` that SFT does not see and RL draws its groups from (`SpeedrunConfig.rl_share`):
    those whose sha1 of "rl:<id>" falls in the lowest `share` of its range, a partition independent
    of the held-out split's hash. Empty when `share` is 0."""
    if share <= 0:
        return ()
    from opencomposer.tasks.format import load_dataset

    ids = [t.id for t in load_dataset(tasks, split)]
    kept = tuple(i for i in ids if int(hashlib.sha1(f"rl:{i}".encode()).hexdigest(), 16) % 1000 / 1000 < share)
    if not kept:  # an empty set would mean "every task" to RL: say so instead
        raise ValueError(f"rl_share = {share:g} keeps none of the {len(ids)} tasks of split {split!r} for RL; "
                         "raise it, or set it to 0 to give SFT and RL every task")
    return kept


def run_demonstrations(agent: AgentSettings, tasks: Path, split: str, out: Path,
                       exclude: tuple[str, ...] = (), spans: bool = False) -> list[Path]:
    """Demonstrations of the train split through the harness (`evals/demonstration.py`), with the
    agent stages' tool set, so SFT renders the same system prompt the policy will see. Only
    episodes that pass go to SFT, and none of the tasks in `exclude` (those kept for RL). `spans`:
    edits whose old text is the smallest unique part of a line (`evals/demonstration.py`)."""
    import dataclasses

    from opencomposer.evals.demonstration import demonstration_policy
    from opencomposer.evals.runner import EvalConfig, run_eval

    # The demonstration's own turns, whatever the agent stages' turn budget; but each of its turns
    # must fit the policy's `turn_tokens`, or SFT teaches calls the policy is cut off writing.
    demo = dataclasses.replace(agent, max_turns=max(agent.max_turns, 16))
    chars = int(TURN_CHARS_PER_TOKEN * agent.turn_tokens)
    s = run_eval(EvalConfig(tasks=tasks, split=split, passes=1, concurrency=2, agent=harness(demo)),
                 lambda task, k=0: demonstration_policy(task, k, max_turn_chars=chars, spans=spans), out)
    skip = set(exclude)
    passed = [out / "trajectories" / f"{r['task']}.{r['pass']}.json" for r in read_jsonl(out / "results.jsonl")
              if r["passed"] and r["task"] not in skip]
    if not passed:
        raise RuntimeError(f"no demonstration of split {split!r} passed ({s['statuses']}"
                           + (f", {len(exclude)} tasks kept for RL" if exclude else "") + "); SFT would learn nothing")
    return sorted(set(passed))
