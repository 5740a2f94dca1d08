"""Trajectories: one JSON record per episode, enough to replay it and to train on it.

An episode is a list of *segments*. A segment is one context window: the messages the policy saw
plus every completion it produced there (with token ids, logprobs, policy versions and routed
experts when the server returned them). Self-summarisation ends a segment and starts the next
from the summary; RL gives every segment the episode's final reward (report §3.3).

`to_atif()` exports the Harbor Agent Trajectory Interchange Format (ATIF v1.4) for other tools.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opencomposer.core.errors import UserError


@dataclass
class ToolCallRecord:
    turn: int
    segment: int
    id: str
    name: str
    arguments: str
    ok: bool
    error_type: str | None
    duration_s: float
    observation_chars: int
    detail: dict | None = None
    """What the tool recorded about a failure: for a `search_replace` that matched nothing,
    `matched`, the length of the longest prefix of its `old_string` that occurs in the file."""


@dataclass
class Segment:
    index: int
    messages: list[dict] = field(default_factory=list)
    """The context as the policy last saw it, plus its final completion."""
    completions: list[dict] = field(default_factory=list)
    """Completion.to_dict() of every policy call in this segment, in order (trainable tokens)."""
    ended_by: str = ""
    """'summary' (self-summarisation), 'compaction', or the episode's stop reason."""


@dataclass
class Trajectory:
    id: str
    task: str
    policy: str
    workspace: str = ""
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    summaries: list[dict] = field(default_factory=list)
    """Each context reset: turn, mode (self/prompted/truncate), tokens before, summary text."""
    stop_reason: str = ""
    final_message: str | None = None
    diff: str = ""
    started_at: float = field(default_factory=time.time)
    ended_at: float = 0.0
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    policy_seconds: float = 0.0
    tool_seconds: float = 0.0
    todos: list[dict] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_errors(self) -> int:
        return sum(not c.ok for c in self.tool_calls)

    @property
    def error_types(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.tool_calls:
            if not c.ok:
                out[c.error_type or "?"] = out.get(c.error_type or "?", 0) + 1
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tool_errors"] = self.tool_errors
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        d = {k: v for k, v in d.items() if k != "tool_errors"}
        d["segments"] = [Segment(**s) for s in d.get("segments", [])]
        d["tool_calls"] = [ToolCallRecord(**c) for c in d.get("tool_calls", [])]
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        """`path` (JSON) plus, when there are token-level arrays, `<stem>.tokens.safetensors` beside it:
        prompt and completion ids, logprobs, policy versions and routed experts as typed arrays
        (routed experts at Kimi-K2 scale are millions of ints per turn: as indented JSON that is
        gigabytes). The JSON refers to each array by key; both files are replaced atomically,
        arrays first."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        d = self.to_dict()
        arrays = _offload(d)
        side = tokens_path(p)
        if arrays:
            from safetensors.numpy import save_file

            tmp_side = side.with_name(side.name + ".tmp")
            save_file(arrays, str(tmp_side))
            tmp_side.replace(side)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> "Trajectory":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise TrajectoryError(f"{p}: not JSON ({e})") from None
        _restore(d, tokens_path(p))
        return cls.from_dict(d)

    def to_atif(self, agent_name: str = "opencomposer", agent_version: str = "0.1.0") -> dict:
        """Harbor ATIF v1.4: user/agent/system steps; agent steps carry tool calls, observations and
        per-step metrics (token ids and logprobs when recorded)."""
        steps: list[dict] = []
        records = {c.id: c for c in self.tool_calls}

        def add(source: str, message: Any, **kw: Any) -> dict:
            step = {"step_id": len(steps) + 1, "source": source, "message": message or ""}
            step.update({k: v for k, v in kw.items() if v is not None})
            steps.append(step)
            return step

        for seg in self.segments:
            comp_iter = iter(seg.completions)
            msgs = seg.messages
            i = 0
            while i < len(msgs):
                m = msgs[i]
                if m["role"] in ("system", "user"):
                    add(m["role"] if m["role"] == "user" else "system", m.get("content"))
                    i += 1
                    continue
                if m["role"] == "assistant":
                    comp = next(comp_iter, None)
                    calls = [{"tool_call_id": tc["id"], "function_name": tc["function"]["name"],
                              "arguments": _args(tc["function"]["arguments"])} for tc in m.get("tool_calls") or []]
                    results = []
                    j = i + 1
                    while j < len(msgs) and msgs[j]["role"] == "tool":
                        results.append({"source_call_id": msgs[j].get("tool_call_id"),
                                        "content": msgs[j].get("content")})
                        j += 1
                    metrics = None
                    if comp is not None:
                        metrics = {"prompt_tokens": comp["usage"]["prompt_tokens"],
                                   "completion_tokens": comp["usage"]["completion_tokens"],
                                   "cost_usd": comp.get("cost_usd") or None}
                        if comp.get("token_ids") is not None:
                            metrics["completion_token_ids"] = comp["token_ids"]
                        if comp.get("logprobs") is not None:
                            metrics["logprobs"] = comp["logprobs"]
                    extra = {"errors": {c["tool_call_id"]: records[c["tool_call_id"]].error_type
                                        for c in calls if c["tool_call_id"] in records
                                        and not records[c["tool_call_id"]].ok}} if calls else None
                    add("agent", m.get("content"), model_name=comp.get("model") if comp else None,
                        tool_calls=calls or None, observation={"results": results} if results else None,
                        metrics=metrics, extra=extra or None)
                    i = j
                    continue
                i += 1
        return {
            "schema_version": "ATIF-v1.4",
            "session_id": self.id,
            "agent": {"name": agent_name, "version": agent_version, "model_name": self.policy},
            "steps": steps,
            "final_metrics": {"total_prompt_tokens": self.prompt_tokens,
                              "total_completion_tokens": self.completion_tokens,
                              "total_cost_usd": self.cost_usd, "total_steps": len(steps)},
            "extra": {"stop_reason": self.stop_reason, "tool_errors": self.tool_errors,
                      "summaries": len(self.summaries)},
        }


class TrajectoryError(ValueError, UserError):
    """A trajectory file (or its token arrays) is missing, corrupt or inconsistent."""


ARRAY_FIELDS = ("prompt_token_ids", "token_ids", "logprobs", "policy_versions", "routed_experts")


def tokens_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".json") + ".tokens.safetensors")


def _as_array(key: str, value):
    import numpy as np

    try:
        arr = np.asarray(value)
    except ValueError:  # ragged: stays in the JSON
        return None
    if arr.dtype == object or arr.size == 0:
        return None
    if key == "logprobs":
        lossless = np.array_equal(arr.astype(np.float32).astype(np.float64), arr.astype(np.float64))
        return arr.astype(np.float32 if lossless else np.float64)
    if arr.dtype.kind not in "iu":
        return None
    lo, hi = int(arr.min()), int(arr.max())
    for narrow in ((np.int16, np.int32) if key == "routed_experts" else (np.int32,)):
        if np.iinfo(narrow).min <= lo and hi <= np.iinfo(narrow).max:
            return arr.astype(narrow)
    return arr.astype(np.int64)


def _offload(d: dict) -> dict:
    """Move token-level lists out of `d` (in place) into named arrays; leave {"array": key}."""
    arrays = {}
    for si, seg in enumerate(d.get("segments", [])):
        for ci, comp in enumerate(seg.get("completions", [])):
            for f in ARRAY_FIELDS:
                if isinstance(comp.get(f), list):
                    key = f"s{si}.c{ci}.{f}"
                    arr = _as_array(f, comp[f])
                    if arr is not None:
                        arrays[key] = arr
                        comp[f] = {"array": key}
        for mi, m in enumerate(seg.get("messages", [])):
            ext = m.get("opencomposer") if isinstance(m, dict) else None
            if isinstance(ext, dict) and isinstance(ext.get("token_ids"), list):
                key = f"s{si}.m{mi}.token_ids"
                arr = _as_array("token_ids", ext["token_ids"])
                if arr is not None:
                    arrays[key] = arr
                    m["opencomposer"] = {**ext, "token_ids": {"array": key}}
    return arrays


def _restore(d: dict, side: Path) -> None:
    refs = []
    for seg in d.get("segments", []):
        for comp in seg.get("completions", []):
            refs += [(comp, f) for f in ARRAY_FIELDS if isinstance(comp.get(f), dict) and "array" in comp[f]]
        for m in seg.get("messages", []):
            ext = m.get("opencomposer") if isinstance(m, dict) else None
            if isinstance(ext, dict) and isinstance(ext.get("token_ids"), dict):
                refs.append((ext, "token_ids"))
    if not refs:
        return
    if not side.is_file():
        raise TrajectoryError(f"{side}: missing (the trajectory's token arrays are stored there)")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        arrays = load_file(str(side))
    except (SafetensorError, OSError) as e:
        raise TrajectoryError(f"{side}: unreadable token arrays ({e})") from None
    for holder, f in refs:
        key = holder[f]["array"]
        if key not in arrays:
            raise TrajectoryError(f"{side}: no array {key!r} (the JSON and its arrays do not belong together)")
        holder[f] = arrays[key].tolist()


def _args(raw: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return raw
