"""The agent loop: messages -> policy -> tool calls (in parallel) -> observations -> ... until the
policy answers without tool calls or a limit is reached. One loop for the CLI agent, evals and RL.

Context management (report §3.3). Before each policy call the context size is checked against
`ContextConfig.budget_tokens * trigger`. When it is over:

- `self` (Composer's self-summarisation): a summarise request is appended, the *policy itself*
  writes the summary (it may think in a scratchpad first), and the context is replaced by the task,
  the summary, the remaining todos and the number of earlier summaries. The summary tokens belong
  to the segment that ends there, so RL rewards good summaries through the final reward.
- `prompted` (the baseline): a separate summariser call with a fixed prompt writes the summary from
  a transcript; its tokens are not part of any segment.
- `truncate`: old tool outputs are replaced by a placeholder (the naive baseline).

Each reset ends a segment; a segment's completions were all generated from prefixes of its
messages, which is what makes every segment trainable.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from opencomposer.core.errors import UserError
from opencomposer.harness import prompt, schedule
from opencomposer.harness.policy import Completion, Policy, PolicyError
from opencomposer.harness.tools import ALL_TOOLS, ToolConfig, ToolContext, build_toolset
from opencomposer.harness.tools.shell import render_todos
from opencomposer.harness.trajectory import Segment, ToolCallRecord, Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ContextConfig:
    budget_tokens: int = 32_768
    """The context the policy serves; the trigger fires before it is reached. A policy that reports
    its served context length (`context_length()`: our server's and vLLM's `max_model_len`) lowers
    it to that."""
    trigger: float = 0.8
    """Fraction of the budget at which the context is reset."""
    mode: Literal["self", "prompted", "truncate"] = "self"
    max_resets: int = 16
    chars_per_token: float = 3.5
    """Estimate used when the server reports no token usage."""
    reserve_tokens: int = 512
    """Room kept free after a turn's tool outputs for the next request (the self-summary prompt and
    the start of its answer): a turn's outputs are cut, head and tail kept, to fit the budget less
    this, so no single observation can push the context past what the server accepts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    max_turns: int = 50
    max_total_tokens: int | None = None
    """Prompt plus completion tokens over all calls."""
    max_wall_s: float | None = 3600.0
    max_cost_usd: float | None = None
    parallel_tool_calls: bool = True
    max_parallel: int = 8
    tools: ToolConfig = field(default_factory=ToolConfig)
    context: ContextConfig = field(default_factory=ContextConfig)


class HarnessConfigError(ValueError, UserError):
    """A harness setting that names what the harness does not have (a tool)."""


def harness_config(tools: tuple[str, ...], max_turns: int, max_wall_s: float) -> AgentConfig:
    """The harness as RL, its evals and the speedrun run it: only `tools` enabled (all when empty)."""
    unknown = set(tools) - {t.name for t in ALL_TOOLS}
    if unknown:
        raise HarnessConfigError(f"unknown tool(s) {sorted(unknown)}; the harness has "
                                 f"{sorted(t.name for t in ALL_TOOLS)}")
    enabled = ToolConfig(disabled=tuple(t.name for t in ALL_TOOLS if t.name not in tools)) if tools else ToolConfig()
    return AgentConfig(max_turns=max_turns, max_wall_s=max_wall_s, tools=enabled)


Event = Callable[[str, dict], None]


class Agent:
    def __init__(self, policy: Policy, sandbox: Any, config: AgentConfig | None = None, *, index: Any = None,
                 summarizer: Policy | None = None, on_event: Event | None = None,
                 stop: threading.Event | None = None):
        self.policy = policy
        self.sandbox = sandbox
        self.config = config or AgentConfig()
        self.toolset = build_toolset(self.config.tools)
        self.index = index
        self.summarizer = summarizer
        self.on_event = on_event or (lambda kind, payload: None)
        self.stop = stop
        """Set by another thread (an eval being interrupted): the episode ends before its next call."""
        self.trajectory: Trajectory | None = None
        self._budget = self.config.context.budget_tokens
        self._cpt = self.config.context.chars_per_token
        """Characters per token of what tools return, measured from the server's usage as the episode
        goes (code tokenizes denser than prose); the configured estimate until then."""
        self._since: tuple[int, int] | None = None  # (context tokens, characters added since) for that

    # ------------------------------------------------------------------------------------------
    def run(self, task: str, *, history: Sequence[str] = (), recent: Sequence[str] | None = None,
            save_to: str | Path | None = None) -> Trajectory:
        """Run the episode. Whatever ends it — the policy, a limit, Ctrl-C (KeyboardInterrupt), a
        stop event, a bug — the trajectory so far is finished (segments, todos, best-effort diff)
        and, with `save_to`, written there before the exception goes on; `self.trajectory` holds it."""
        if not task or not task.strip():
            raise ValueError("empty task")
        traj = Trajectory(id=uuid.uuid4().hex[:12], task=task, policy=self.policy.name,
                          workspace=str(getattr(getattr(self.sandbox, "workspace", None), "source", "")))
        self.trajectory = traj
        self._state: dict = {}
        try:
            self._run(traj, task, history, recent)
        except BaseException as e:
            traj.stop_reason = "interrupted" if isinstance(e, KeyboardInterrupt) else \
                f"error: {type(e).__name__}: {e}"
            self._finish(traj)
            if save_to is not None:
                traj.save(save_to)
            raise
        self._finish(traj)
        if save_to is not None:
            traj.save(save_to)
        return traj

    def _finish(self, traj: Trajectory) -> None:
        seg, messages = self._state.get("seg"), self._state.get("messages")
        if seg is not None and not any(s is seg for s in traj.segments):
            seg.messages = messages or seg.messages
            seg.ended_by = traj.stop_reason
            traj.segments.append(seg)
        ctx = self._state.get("ctx")
        traj.todos = [dict(t) for t in ctx.todos] if ctx is not None else []
        try:
            traj.diff = final_diff(self.sandbox)
        except Exception as e:  # noqa: BLE001 - a dead sandbox must not lose the rest
            log.warning("final diff failed: %s", e)
        traj.ended_at = time.time()
        self.on_event("done", {"stop_reason": traj.stop_reason})

    def _run(self, traj: Trajectory, task: str, history: Sequence[str], recent: Sequence[str] | None) -> None:
        cfg = self.config
        if hasattr(self.sandbox, "start_server"):
            self.sandbox.start_server()
        traj.extra["git_initialized"] = ensure_git_baseline(self.sandbox)
        ctx = ToolContext(self.sandbox, cfg.tools, self.index)
        rules = prompt.read_rules(self.sandbox)
        recent = list(recent) if recent is not None else prompt.recent_files(self.sandbox)
        system = prompt.system_message(self.sandbox.config.workdir, rules, tuple(self.toolset.tools))
        messages = [system, prompt.task_message(task, recent=recent, history=history)]
        schemas = self.toolset.schemas()
        traj.extra["tools"] = schemas  # what every call of every segment was rendered with (SFT reads it)
        self._schemas = schemas
        budget = self._budget = context_budget(self.policy, cfg.context.budget_tokens)
        traj.extra["context_budget"] = budget
        seg = Segment(0)
        st = self._state
        st.update(seg=seg, messages=messages, ctx=ctx)
        t0 = time.monotonic()
        context_tokens = self._estimate(messages)
        while True:
            stop = self._limit(traj, t0)
            if stop:
                traj.stop_reason = stop
                break
            if context_tokens > budget * cfg.context.trigger:
                if len(traj.summaries) >= cfg.context.max_resets:
                    traj.stop_reason = "context_resets_exhausted"
                    break
                messages, seg = self._reset(messages, seg, traj, ctx, system, task, history, context_tokens)
                st.update(seg=seg, messages=messages)
                context_tokens = self._estimate(messages)
                self._since = None
                if context_tokens > budget * cfg.context.trigger:  # nothing more to drop: no call would fit
                    traj.stop_reason = "context_exhausted"
                    break
                continue
            comp = self._call(messages, schemas, traj, seg)
            if comp is None:
                break
            messages.append(comp.to_message())
            self.on_event("assistant", {"content": comp.content, "tool_calls": len(comp.tool_calls)})
            if not comp.tool_calls:
                traj.final_message = comp.content
                traj.stop_reason = "done"
                break
            before = comp.usage.total if comp.usage.total else self._estimate(messages)
            new = self._run_tools(comp, ctx, traj, seg.index, room_tokens=budget - cfg.context.reserve_tokens - before)
            messages += new
            context_tokens = before + self._estimate(new)
            self._since = (before, _chars(new))

    # ------------------------------------------------------------------------------------------
    def _limit(self, traj: Trajectory, t0: float) -> str | None:
        cfg = self.config
        if self.stop is not None and self.stop.is_set():
            return "interrupted"
        if traj.turns >= cfg.max_turns:
            return "max_turns"
        if cfg.max_total_tokens is not None and traj.prompt_tokens + traj.completion_tokens >= cfg.max_total_tokens:
            return "max_tokens"
        if cfg.max_wall_s is not None and time.monotonic() - t0 >= cfg.max_wall_s:
            return "max_wall_time"
        if cfg.max_cost_usd is not None and traj.cost_usd >= cfg.max_cost_usd:
            return "max_cost"
        return None

    def _estimate(self, messages: Sequence[dict]) -> int:
        return int(_chars(messages) / self._cpt)

    def _calibrate(self, prompt_tokens: int) -> None:
        """The prompt the server counted, against the context before the last tool outputs: how many
        characters of those outputs made a token."""
        if self._since is None or not prompt_tokens:
            return
        before, chars = self._since
        self._since = None
        if chars >= 200 and prompt_tokens > before:
            self._cpt = min(8.0, max(1.0, chars / (prompt_tokens - before)))

    def _call(self, messages: list[dict], tools: list[dict], traj: Trajectory, seg: Segment | None,
              policy: Policy | None = None) -> Completion | None:
        policy = policy or self.policy
        t = time.perf_counter()
        try:
            comp = policy.complete(messages, tools)
        except PolicyError as e:
            traj.stop_reason = f"policy_error: {e}"
            log.warning("policy error: %s", e)
            return None
        traj.policy_seconds += time.perf_counter() - t
        self._calibrate(comp.usage.prompt_tokens)
        traj.turns += 1
        traj.prompt_tokens += comp.usage.prompt_tokens
        traj.completion_tokens += comp.usage.completion_tokens
        traj.cost_usd += comp.cost_usd
        if seg is not None:
            seg.completions.append(comp.to_dict())
        return comp

    def _run_tools(self, comp: Completion, ctx: ToolContext, traj: Trajectory, segment: int,
                   room_tokens: int | None = None) -> list[dict]:
        calls = comp.tool_calls
        for tc in calls:
            self.on_event("tool_call", {"name": tc.name, "arguments": tc.arguments})
        t = time.perf_counter()
        if self.config.parallel_tool_calls and len(calls) > 1:
            # Parallel only where calls cannot conflict: same-path calls keep their order, a shell
            # command is a barrier (harness/schedule.py), so the outcome equals running them in order.
            workdir = self.sandbox.config.workdir
            accesses = [schedule.access_of(self.toolset.tools, tc.name, tc.arguments, workdir) for tc in calls]
            results = schedule.run_ordered(calls, accesses, lambda tc: self.toolset.call(ctx, tc.name, tc.arguments),
                                           self.config.max_parallel)
        else:
            results = [self.toolset.call(ctx, tc.name, tc.arguments) for tc in calls]
        traj.tool_seconds += time.perf_counter() - t
        if room_tokens is not None:
            results = fit_observations(results, int(max(0, room_tokens) * self._cpt))
        out = []
        for tc, res in zip(calls, results):
            traj.tool_calls.append(ToolCallRecord(traj.turns, segment, tc.id, tc.name, tc.arguments, res.ok,
                                                  res.error_type, res.duration_s, len(res.content), res.detail))
            self.on_event("tool_result", {"name": tc.name, "ok": res.ok, "content": res.content})
            out.append({"role": "tool", "tool_call_id": tc.id, "content": res.content})
        return out

    def _reset(self, messages, seg, traj, ctx, system, task, history, tokens):
        mode = self.config.context.mode
        summary = None
        if mode == "self":
            messages = messages + [{"role": "user", "content": prompt.SUMMARIZE_PROMPT}]
            # The same tools as the segment's other calls: the summary's prompt then extends the
            # segment's prompts token for token (one trainable sequence, prefix-cache hits), and
            # SFT renders the segment with one tool list. Tool calls in the answer are ignored.
            comp = self._call(messages, self._schemas, traj, seg)
            if comp is not None:
                messages.append(comp.to_message())
                summary = prompt.extract_summary(comp.content)
        elif mode == "prompted":
            transcript = "\n\n".join(f"[{m['role']}] {m.get('content') or ''}"
                                     + (f" {json.dumps(m['tool_calls'])}" if m.get("tool_calls") else "")
                                     for m in messages[1:])
            req = [{"role": "system", "content": prompt.PROMPTED_SUMMARIZER_SYSTEM},
                   {"role": "user", "content": transcript[-self._budget * 3:]}]
            comp = self._call(req, [], traj, None, policy=self.summarizer or self.policy)
            summary = prompt.extract_summary(comp.content) if comp is not None else None
        seg.messages = messages
        seg.ended_by = "summary" if mode == "self" else "compaction"
        traj.segments.append(seg)
        new_seg = Segment(seg.index + 1)
        if mode == "truncate" or summary is None:
            kept = [dict(m) for m in messages if not (m["role"] == "user" and m["content"] == prompt.SUMMARIZE_PROMPT)]
            tool_idx = [i for i, m in enumerate(kept) if m["role"] == "tool"]
            # Old outputs go first; the newest four too, oldest first, while the context is still
            # over the trigger (a failed summary must not leave a context no call fits in).
            for n, i in enumerate(tool_idx):
                if n >= len(tool_idx) - 4 and \
                        self._estimate(kept) <= self._budget * self.config.context.trigger:
                    break
                kept[i]["content"] = "[output omitted to save context]"
            new_messages = kept
        else:
            new_messages = [system, prompt.task_message(task, history=history, summary=summary,
                                                        todos=render_todos(ctx.todos) if ctx.todos else None,
                                                        summaries=len(traj.summaries) + 1)]
        traj.summaries.append({"turn": traj.turns, "mode": mode, "tokens_before": tokens,
                               "tokens_after": self._estimate(new_messages), "summary": summary})
        self.on_event("summary", traj.summaries[-1])
        return new_messages, new_seg


def _chars(messages: Sequence[dict]) -> int:
    return sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or [])) for m in messages)


def context_budget(policy: Policy, configured: int) -> int:
    """The context the agent plans for: `configured`, or less when the policy reports that its
    server serves less (a request past it would be refused, and the episode lost)."""
    ask = getattr(policy, "context_length", None)
    try:
        served = ask() if callable(ask) else None
    except Exception as e:  # noqa: BLE001 - a server that cannot say keeps the configured budget
        log.warning("could not read the served context length: %s", e)
        served = None
    return min(configured, int(served)) if served else configured


MIN_OBSERVATION_CHARS = 200
"""What a cut observation keeps at least (head and tail), however full the context."""


def fit_observations(results: list, room_chars: int) -> list:
    """A turn's tool results cut to `room_chars` in all: the ones under an equal share are kept
    whole, and what they leave is shared among the rest, each keeping its head and tail."""
    import dataclasses

    from opencomposer.harness.tools.base import truncate

    total = sum(len(r.content) for r in results)
    if total <= room_chars:
        return results
    order = sorted(range(len(results)), key=lambda i: len(results[i].content))
    left, limits = room_chars, {}
    for k, i in enumerate(order):
        share = left // (len(order) - k)
        limits[i] = max(MIN_OBSERVATION_CHARS, min(len(results[i].content), share))
        left -= min(len(results[i].content), share)
    return [dataclasses.replace(r, content=truncate(r.content, limits[i])) if len(r.content) > limits[i] else r
            for i, r in enumerate(results)]


def ensure_git_baseline(sandbox) -> bool:
    """Diffs are taken with git; a workspace without a repository gets one (inside the sandbox only)."""
    r = sandbox.exec("git rev-parse --is-inside-work-tree", timeout_s=30)
    if r.exit_code == 0 and r.stdout.strip() == "true":
        return False
    sandbox.exec("git init -q && git add -A && git -c user.name=opencomposer -c user.email=agent@opencomposer "
                 "commit -qm baseline --allow-empty", timeout_s=120)
    return True


EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def final_diff(sandbox) -> str:
    """Everything the agent changed (new, modified, deleted, binary) against the baseline commit."""
    # Through a file in .git, not stdout: a large diff must not meet the output cap.
    out = ".git/opencomposer-final.diff"
    r = sandbox.exec(f"git add -A >/dev/null 2>&1; base=$(git rev-parse -q --verify HEAD || echo {EMPTY_TREE}); "
                     f"git diff --cached --binary --no-color --no-ext-diff $base > {out}; rc=$?; "
                     "git reset -q >/dev/null 2>&1; exit $rc", timeout_s=120)
    if r.exit_code != 0:
        return ""
    diff = sandbox.read_file(out).decode("utf-8", "replace")
    sandbox.delete(out)
    return diff
