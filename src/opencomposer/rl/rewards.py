"""Rollout rewards (report §3.2): the verifier's outcome, behaviour terms, and the concave effort
penalty. Each term is a small function of a trajectory (its dict or the object); `reward` weighs
them into one scalar per rollout. With self-summarisation, every segment of a chained rollout is
trained with this one reward (rl/sequences.py carries the segment index, not a reward of its own).

The effort penalty is the report's C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)), concave and
increasing (dC/dx = (1 + k x)^-q), over a weighted mix of the rollout's effort: tokens of turns
that call tools, tokens of the final message, tool-output tokens, tool calls and turns. This model
family writes no separate reasoning channel, so "thinking tokens" are the `<scratchpad>` part of
completions (0 when there is none). k, q and the weights are not disclosed by the report: they
are config fields with defaults chosen here (documented in docs/rl.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

BROKEN_CALLS = ("MalformedArguments", "UnknownTool", "InvalidArguments")
"""Error types that mean the model sent a call the harness could not run as written."""
EDIT_TOOLS = ("search_replace", "write_file", "delete_file")
FAILED_EDITS = ("NoMatch", "NotUnique", "NotFound")
"""Well-formed edits that changed nothing: text that is not in the file (or not once), a file
that is not there. A model that edits what it never read, or copies a line wrong, makes these."""
_SCRATCH = re.compile(r"<scratchpad>(.*?)(?:</scratchpad>|$)", re.S)


def effort_penalty(x: float, k: float = 1e-3, q: float = 0.5) -> float:
    """C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)); the q -> 1 limit is ln(1 + k x) / k."""
    if x < 0:
        raise ValueError(f"effort must be >= 0, got {x}")
    if k <= 0:
        raise ValueError(f"k must be > 0, got {k}")
    if abs(1.0 - q) < 1e-9:
        return math.log1p(k * x) / k
    return ((1.0 + k * x) ** (1.0 - q) - 1.0) / (k * (1.0 - q))


@dataclass(frozen=True, kw_only=True, slots=True)
class EffortWeights:
    thinking_tokens: float = 1.0
    tool_call_tokens: float = 1.0
    tool_output_tokens: float = 0.1
    final_tokens: float = 1.0
    tool_calls: float = 20.0
    turns: float = 50.0
    chars_per_token: float = 3.5
    """Tool outputs are counted in characters by the harness; this converts them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    verifier: float = 1.0
    """Weight of the verifier's outcome (1 passed, 0 not)."""
    effort: float = 0.1
    """The penalty at `effort_ref`: penalty = effort * C(x) / C(effort_ref) (more above it, concavely)."""
    effort_ref: float = 20_000.0
    """A long episode's weighted effort (tokens, with calls and turns weighted in)."""
    effort_k: float = 1e-3
    effort_q: float = 0.5
    weights: EffortWeights = field(default_factory=EffortWeights)
    broken_call: float = 0.05
    """Taken off per broken tool call (malformed JSON, unknown tool, invalid arguments)."""
    failed_edit: float = 0.0
    """Taken off per failed edit (`FAILED_EDITS`): the report's "penalties for poor tool calls"
    (§4.2). Off by default; on, every group gets a signal about how precisely the policy edits,
    even one whose rollouts all fail the tests (docs/rl.md)."""
    unfinished_todo: float = 0.05
    """Taken off per todo item left pending or in progress."""
    comment_dump: float = 0.1
    """Taken off when added code is mostly long comment runs (reasoning dumped into comments)."""
    terminal_collapse: float = 0.1
    """Taken off when (with at least 4 calls) all tool calls are terminal commands."""


def _get(obj: Any, key: str, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def _completions(traj) -> list:
    return [c for s in _get(traj, "segments", []) for c in _get(s, "completions", [])]


def effort(traj, w: EffortWeights = EffortWeights()) -> float:
    """The weighted effort x of a rollout."""
    x = 0.0
    for c in _completions(traj):
        usage = _get(c, "usage", {}) or {}
        tokens = float(_get(usage, "completion_tokens", 0) or 0)
        content = _get(c, "content") or ""
        thinking = sum(len(m) for m in _SCRATCH.findall(content)) / w.chars_per_token
        rest = max(0.0, tokens - thinking)
        x += w.thinking_tokens * min(thinking, tokens)
        x += (w.tool_call_tokens if _get(c, "tool_calls") else w.final_tokens) * rest
    calls = _get(traj, "tool_calls", []) or []
    x += w.tool_output_tokens * sum(float(_get(t, "observation_chars", 0) or 0) for t in calls) / w.chars_per_token
    x += w.tool_calls * len(calls) + w.turns * float(_get(traj, "turns", 0) or 0)
    return x


def _broken(call) -> bool:
    return _get(call, "error_type") in BROKEN_CALLS


def _failed_edit(call) -> bool:
    return _get(call, "name") in EDIT_TOOLS and _get(call, "error_type") in FAILED_EDITS


def broken_calls(traj) -> int:
    return sum(1 for t in _get(traj, "tool_calls", []) or [] if _broken(t))


def failed_edits(traj) -> int:
    return sum(1 for t in _get(traj, "tool_calls", []) or [] if _failed_edit(t))


def completions_with_failed_calls(traj) -> set[tuple[int, int]]:
    """(segment, completion index) of every policy call that issued a broken call or a failed edit
    (what `broken_calls` and `failed_edits` count): those `completion_calls` finds not ok.
    `ObjectiveConfig.failed_call_credit` and `failed_call_blame` use them."""
    return {key for key, (_, ok) in completion_calls(traj).items() if not ok}


def completion_calls(traj) -> dict[tuple[int, int], tuple[str, bool]]:
    """(segment, completion index) -> (the tool it called first, whether all its calls ran as
    written and every edit among them applied) for every policy call that issued a tool call,
    matched to the executed calls by the tool call's id within its segment (ids repeat across
    segments). `ObjectiveConfig.call_advantage` compares these verdicts between calls of the same tool."""
    records = {(_get(t, "segment", 0), _get(t, "id")): t for t in _get(traj, "tool_calls", []) or []}
    out = {}
    for si, seg in enumerate(_get(traj, "segments", []) or []):
        for ci, comp in enumerate(_get(seg, "completions", []) or []):
            calls = [records.get((si, _get(tc, "id"))) for tc in _get(comp, "tool_calls", []) or []]
            calls = [c for c in calls if c is not None]
            if calls:
                out[(si, ci)] = (str(_get(calls[0], "name", "")),
                                 not any(_broken(c) or _failed_edit(c) for c in calls))
    return out


def unfinished_todos(traj) -> int:
    return sum(1 for t in _get(traj, "todos", []) or [] if t.get("status") in ("pending", "in_progress"))


_COMMENT = re.compile(r"^\+\s*(#|//)")


def comment_dump(traj, min_run: int = 6, share: float = 0.5) -> bool:
    """Most added lines of the diff are comment runs of `min_run` or more lines: reasoning written
    into the code instead of code (report §4.2)."""
    added, in_runs, run = 0, 0, 0
    for line in (_get(traj, "diff", "") or "").splitlines() + [""]:
        is_added = line.startswith("+") and not line.startswith("+++")
        if is_added:
            added += 1
        if is_added and _COMMENT.match(line):
            run += 1
            continue
        if run >= min_run:
            in_runs += run
        run = 0
    return added > 0 and in_runs / added >= share


def terminal_collapse(traj, min_calls: int = 4) -> bool:
    """Every tool call of a rollout with at least `min_calls` is a terminal command (report §4.2)."""
    names = [_get(t, "name") for t in _get(traj, "tool_calls", []) or []]
    return len(names) >= min_calls and all(n == "run_terminal_cmd" for n in names)


@dataclass(frozen=True, slots=True)
class RewardBreakdown:
    total: float
    verifier: float
    effort: float
    effort_x: float
    broken_calls: int
    unfinished_todos: int
    comment_dump: bool
    terminal_collapse: bool
    failed_edits: int = 0


def reward(traj, passed: bool, cfg: RewardConfig = RewardConfig()) -> RewardBreakdown:
    """R = verifier - effort penalty - behaviour penalties (report §3.2)."""
    x = effort(traj, cfg.weights)
    pen = cfg.effort * effort_penalty(x, cfg.effort_k, cfg.effort_q) / effort_penalty(cfg.effort_ref, cfg.effort_k,
                                                                                     cfg.effort_q)
    b, u, d, t = broken_calls(traj), unfinished_todos(traj), comment_dump(traj), terminal_collapse(traj)
    f = failed_edits(traj)
    v = cfg.verifier * float(bool(passed))
    total = v - pen - cfg.broken_call * b - cfg.unfinished_todo * u - cfg.comment_dump * d - cfg.terminal_collapse * t \
        - cfg.failed_edit * f
    return RewardBreakdown(total, v, pen, x, b, u, d, t, f)
