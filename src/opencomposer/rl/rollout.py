"""One rollout: a task run through the real harness in a sandbox against the served policy, graded
in a clean fork with the hidden tests, scored (verifier + behaviour terms + effort penalty), and
turned into token-exact RL sequences. This is the rollout worker's whole job; it never raises for
the episode's own failures: those come back as a failed sample with the reason."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opencomposer.evals.runner import EvalConfig, run_episode
from opencomposer.harness.agent import AgentConfig
from opencomposer.harness.trajectory import Trajectory
from opencomposer.rl.copy_blame import copy_errors
from opencomposer.rl.rewards import RewardConfig, completion_calls, reward
from opencomposer.rl.sequences import RLSequence, SequenceError, build_sequences
from opencomposer.tasks.format import Task


@dataclass
class Sample:
    id: str
    group: int
    index: int
    task: str
    passed: bool = False
    reward: float = 0.0
    breakdown: dict = field(default_factory=dict)
    sequences: list[RLSequence] = field(default_factory=list)
    error: str | None = None
    turns: int = 0
    tool_calls: dict = field(default_factory=dict)
    trained_tokens: int = 0
    min_version: int | None = None
    merge_rate: float = 1.0
    trajectory: str = ""
    sandbox_restarts: int = 0
    """Times the sandbox's tool server died during the episode and was started again."""
    graded_at: float | None = None
    """Wall-clock time (epoch seconds) at which the hidden tests began, in the worker."""
    seconds: dict = field(default_factory=dict)
    """Where the rollout's time went: `episode` (the harness, start to end), of it `policy` (waiting
    for completions) and `tools`, then `grade` (hidden tests in a clean fork)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Sample:
        d = dict(d)
        d["sequences"] = [RLSequence(**s) for s in d.get("sequences", [])]
        return cls(**d)


def run_rollout(task: Task, sample: Sample, policy, pool, agent: AgentConfig, rewards: RewardConfig,
                traj_dir: Path, stop: threading.Event | None = None) -> Sample:
    cfg = EvalConfig(tasks=task.root.parent, agent=agent)
    traj_dir.mkdir(parents=True, exist_ok=True)
    rec = run_episode(task, sample.index, policy, cfg, pool, traj_dir, "train", stop=stop)
    sample.trajectory = str(traj_dir / f"{task.id}.{sample.index}.json")
    if rec["status"] in ("infra_error", "interrupted"):
        sample.error = f"{rec['status']}: {rec['detail']}"[:500]
        return sample
    sample.graded_at = time.time() - rec.get("grade_seconds", 0.0)  # grading ends the episode
    sample.sandbox_restarts = int(rec.get("sandbox_restarts", 0))
    try:
        traj = Trajectory.load(sample.trajectory)
        seqs, stats = build_sequences(traj)
    except (OSError, ValueError, SequenceError) as e:
        sample.error = f"sequences: {type(e).__name__}: {e}"[:500]
        return sample
    sample.seconds = {"episode": round(rec["seconds"], 3), "policy": round(traj.policy_seconds, 3),
                      "tools": round(traj.tool_seconds, 3), "grade": round(rec.get("grade_seconds", 0.0), 3)}
    r = reward(traj, rec["passed"], rewards)
    called = completion_calls(traj)  # (segment, completion) -> (tool, ok)
    copies = copy_errors(traj)  # (segment, completion) -> where its failed edits' copies left the file
    for seq in seqs:
        verdicts = [called.get((seq.segment, ci), ("", True)) for ci in seq.completions]
        seq.failed_calls = [ci for ci, (_, ok) in zip(seq.completions, verdicts) if not ok]
        seq.calls = [tool for tool, _ in verdicts]
        seq.copy_errors = [[ci, *e] for ci in seq.completions for e in copies.get((seq.segment, ci), [])]
    names = [c.name for c in traj.tool_calls]
    sample.passed, sample.reward, sample.breakdown = bool(rec["passed"]), r.total, asdict(r)
    sample.sequences, sample.turns, sample.merge_rate = seqs, traj.turns, stats.merge_rate
    sample.tool_calls = {n: names.count(n) for n in sorted(set(names))}
    sample.trained_tokens = sum(s.trained_tokens for s in seqs)
    versions = [v for s in seqs for v, m in zip(s.versions, s.loss_mask) if m]
    sample.min_version = min(versions) if versions else None
    if not seqs:
        sample.error = "the episode made no completion with recorded tokens"
    return sample
