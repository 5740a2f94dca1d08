"""OpenAIPolicy: the harness's client for any OpenAI-compatible chat server, on the official client.

It works unchanged against our inference server, vLLM, SGLang and hosted APIs. What RL needs beyond
text is taken from the response when present:

- our server: `choices[i].opencomposer = {"token_ids", "prompt_token_ids", "logprobs", "policy_versions",
  "routed_experts"}` (a namespaced extension field). Once a server has answered with it, assistant
  turns are sent back with their sampled ids (`opencomposer.token_ids`), so the server renders
  them as sampled and every prompt extends the previous prompt plus completion;
- vLLM: `choices[i].token_ids` when the request asks `return_token_ids` (set `vllm_token_ids=True`);
- any server: `choices[i].logprobs.content[*].logprob` when `logprobs=True`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opencomposer.harness.policy import Completion, PolicyError, ToolCall, Usage, new_call_id


@dataclass(frozen=True, kw_only=True, slots=True)
class OpenAIPolicyConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "default"
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (local servers accept any value)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    """Sent as `top_k` (our server, vLLM, SGLang); None leaves it to the server (no top-k)."""
    max_tokens: int = 4096
    timeout_s: float = 600.0
    max_retries: int = 2
    logprobs: bool = True
    vllm_token_ids: bool = False
    parallel_tool_calls: bool = True
    price_per_mtok_in: float = 0.0
    price_per_mtok_out: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    """Reproducible sampling: request i of this policy is sent with `seed + i` (our server and vLLM
    honour `seed`), so an episode replayed with the same seed draws the same tokens from the same
    logits. None: the server's own randomness."""


class OpenAIPolicy:
    def __init__(self, config: OpenAIPolicyConfig | None = None, **overrides: Any):
        import dataclasses

        import openai

        self.config = dataclasses.replace(config or OpenAIPolicyConfig(), **overrides)
        self.name = self.config.model
        self._extension_server = False
        self._requests = 0
        self._context_length: int | None | bool = False  # False: not asked yet
        self._client = openai.OpenAI(
            base_url=self.config.base_url,
            api_key=os.environ.get(self.config.api_key_env) or "EMPTY",
            timeout=self.config.timeout_s,
            max_retries=self.config.max_retries,
        )

    def complete(self, messages: Sequence[dict], tools: Sequence[dict]) -> Completion:
        return self.complete_n(messages, tools, 1)[0]

    def context_length(self) -> int | None:
        """The served model's context length, from `GET /models` (`max_model_len`, as our server
        and vLLM report it), asked once; None where the server does not say (hosted APIs)."""
        if self._context_length is False:
            import openai

            self._context_length = None
            try:
                for m in self._client.with_options(timeout=min(30.0, self.config.timeout_s)).models.list().data:
                    n = (m.model_extra or {}).get("max_model_len")
                    if m.id == self.config.model and isinstance(n, int) and n > 0:
                        self._context_length = n
            except openai.APIError:
                pass
        return self._context_length

    def complete_n(self, messages: Sequence[dict], tools: Sequence[dict], n: int) -> list[Completion]:
        """`n` samples of one prompt in one request (every choice, each with its own ids)."""
        import openai

        cfg = self.config
        kwargs: dict[str, Any] = dict(model=cfg.model, messages=self._outgoing(messages), temperature=cfg.temperature,
                                      top_p=cfg.top_p, max_tokens=cfg.max_tokens)
        if n != 1:
            kwargs["n"] = n
        if tools:
            kwargs["tools"] = list(tools)
            kwargs["parallel_tool_calls"] = cfg.parallel_tool_calls
        if cfg.logprobs:
            kwargs["logprobs"] = True
        extra = dict(cfg.extra_body)
        if cfg.top_k is not None:
            extra["top_k"] = cfg.top_k
        if cfg.vllm_token_ids:
            extra["return_token_ids"] = True
        if cfg.seed is not None:
            extra["seed"] = cfg.seed + self._requests
        self._requests += 1
        if extra:
            kwargs["extra_body"] = extra
        t = time.perf_counter()
        try:
            resp = self._client.chat.completions.create(**kwargs)
        except openai.APIError as e:
            raise PolicyError(f"{cfg.base_url} ({cfg.model}): {type(e).__name__}: {e}") from e
        latency = time.perf_counter() - t
        if not resp.choices:
            raise PolicyError(f"{cfg.base_url}: response without choices")
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": extra.get("top_k", 0),
                    "max_tokens": cfg.max_tokens, **{k: extra[k] for k in ("seed", "min_p") if k in extra}}
        return [self._parse(resp, choice, latency, sampling) for choice in sorted(resp.choices, key=lambda c: c.index)]

    def _outgoing(self, messages: Sequence[dict]) -> list[dict]:
        """Messages as sent: our `opencomposer` field on assistant turns (their sampled ids) goes
        only to a server that has shown it speaks the extension."""
        if self._extension_server:
            return list(messages)
        return [{k: v for k, v in m.items() if k != "opencomposer"} if "opencomposer" in m else m for m in messages]

    def _parse(self, resp: Any, choice: Any, latency: float, sampling: dict) -> Completion:
        msg = choice.message
        calls = tuple(
            ToolCall(tc.id or new_call_id(), tc.function.name, tc.function.arguments or "")
            for tc in (msg.tool_calls or [])
        )
        n = max(1, len(resp.choices))
        completion_tokens = getattr(resp.usage, "completion_tokens", 0) or 0
        logprobs = None
        if getattr(choice, "logprobs", None) is not None and getattr(choice.logprobs, "content", None):
            logprobs = [t.logprob for t in choice.logprobs.content]
        extra = (choice.model_extra or {}) if hasattr(choice, "model_extra") else {}
        ours = extra.get("opencomposer") or {}
        if ours:
            self._extension_server = True
        token_ids = ours.get("token_ids") or extra.get("token_ids")
        prompt_ids = ours.get("prompt_token_ids") or (getattr(resp, "model_extra", None) or {}).get("prompt_token_ids")
        if ours.get("logprobs") is not None:
            logprobs = ours["logprobs"]
        own = len(token_ids) if token_ids is not None else completion_tokens // n
        usage = Usage(getattr(resp.usage, "prompt_tokens", 0) or 0, own)
        cost = (usage.prompt_tokens / n * self.config.price_per_mtok_in
                + usage.completion_tokens * self.config.price_per_mtok_out) / 1e6
        return Completion(
            content=msg.content,
            tool_calls=calls,
            finish_reason=choice.finish_reason or ("tool_calls" if calls else "stop"),
            usage=usage,
            model=resp.model or self.config.model,
            latency_s=latency,
            cost_usd=cost,
            token_ids=token_ids,
            logprobs=logprobs,
            policy_versions=ours.get("policy_versions"),
            routed_experts=ours.get("routed_experts"),
            prompt_token_ids=prompt_ids,
            sampling=sampling,
        )


def resolve_model(model: str | None, model_name: str | None = None) -> tuple[str, str]:
    """`--model` is a base URL or a model name; returns (base_url, model). Without a name, the
    server's first listed model is used (asked with a short deadline)."""
    import openai

    if model and model.startswith(("http://", "https://")):
        base_url, name = model.rstrip("/"), model_name
    else:
        base_url = os.environ.get("OPENAI_BASE_URL", OpenAIPolicyConfig.base_url)
        name = model_name or model
    if name is None:
        client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY") or "EMPTY", timeout=10,
                               max_retries=0)
        try:
            models = client.models.list().data
        except openai.APIError as e:
            raise PolicyError(f"no model given and {base_url}/models is not answering: {e}") from e
        if not models:
            raise PolicyError(f"{base_url} lists no models; pass --model-name")
        name = models[0].id
    return base_url, name
