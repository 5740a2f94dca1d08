"""The `Policy` seam: messages + tool schemas -> one assistant completion.

Messages are OpenAI chat-format dicts (`role`, `content`, `tool_calls`, `tool_call_id`), so the same
conversation goes to our inference server, to vLLM or SGLang, or to a hosted API. A completion
keeps what the trainer needs when the server provides it: sampled token ids, their logprobs, the
policy version of every token and the experts each token was routed to (report §3.1, §4).

`ScriptedPolicy` replays a fixed list of turns: tests, oracle runs and trajectory replays use it.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from opencomposer.core.errors import UserError


class PolicyError(RuntimeError, UserError):
    """The policy could not produce a completion (server down, bad response, script exhausted)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The raw JSON text the model produced (it may be malformed: the harness reports that)."""

    def to_message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Completion:
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = "stop"
    usage: Usage = field(default_factory=Usage)
    model: str = ""
    latency_s: float = 0.0
    cost_usd: float = 0.0
    token_ids: list[int] | None = None
    """The sampled ids, exactly as the sampler produced them (with the end-of-turn id if it stopped on one)."""
    logprobs: list[float] | None = None
    policy_versions: list[int] | None = None
    routed_experts: Any = None
    """Per token, per MoE layer, the expert indices the sampler used (for router replay)."""
    prompt_token_ids: list[int] | None = None
    """The ids the sampler was conditioned on (the server's rendering of the messages)."""
    sampling: dict | None = None
    """The sampling parameters the logprobs were taken under: temperature, top_p, top_k, max_tokens."""

    def to_message(self) -> dict:
        msg: dict = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [tc.to_message() for tc in self.tool_calls]
        if self.token_ids is not None:
            # Our server renders this turn from these ids, not from the re-serialised text, so the
            # next prompt extends this one token for token (tokenizer/chat.py; other servers never
            # see the field: OpenAIPolicy sends it only to servers that return it).
            msg["opencomposer"] = {"token_ids": list(self.token_ids)}
        return msg

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tool_calls"] = [asdict(tc) for tc in self.tool_calls]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Completion":
        d = dict(d)
        d["tool_calls"] = tuple(ToolCall(**tc) for tc in d.get("tool_calls", ()))
        d["usage"] = Usage(**d.get("usage", {}))
        return cls(**d)


@runtime_checkable
class Policy(Protocol):
    name: str

    def complete(self, messages: Sequence[dict], tools: Sequence[dict]) -> Completion: ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:16]}"


class ScriptedPolicy:
    """Replays turns. Each turn is a Completion, or a dict {"content": ..., "tool_calls": [{"name":
    ..., "arguments": {...} or "raw json"}]}. Thread-safe; raises PolicyError when exhausted, unless
    `final` is given (then it answers with that text forever)."""

    def __init__(self, turns: Sequence[Completion | dict], *, name: str = "scripted", final: str | None = None):
        self.name = name
        self._turns = [t if isinstance(t, Completion) else self._parse(t) for t in turns]
        self._i = 0
        self._final = final
        self._lock = threading.Lock()
        self.seen: list[list[dict]] = []

    @staticmethod
    def _parse(turn: dict) -> Completion:
        calls = []
        for c in turn.get("tool_calls", ()):
            args = c.get("arguments", {})
            calls.append(ToolCall(c.get("id") or new_call_id(), c["name"],
                                  args if isinstance(args, str) else json.dumps(args)))
        return Completion(content=turn.get("content"), tool_calls=tuple(calls),
                          finish_reason="tool_calls" if calls else "stop")

    @classmethod
    def from_trajectory(cls, traj) -> "ScriptedPolicy":
        """Replay a recorded trajectory's completions, in order."""
        return cls([Completion.from_dict(c) for seg in traj.segments for c in seg.completions],
                   name=f"replay:{traj.policy}")

    def complete(self, messages: Sequence[dict], tools: Sequence[dict]) -> Completion:
        with self._lock:
            self.seen.append([dict(m) for m in messages])
            if self._i < len(self._turns):
                turn = self._turns[self._i]
                self._i += 1
                return turn
        if self._final is not None:
            return Completion(content=self._final)
        raise PolicyError(f"{self.name}: script exhausted after {len(self._turns)} turns")
