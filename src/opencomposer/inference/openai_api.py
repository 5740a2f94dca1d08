"""The OpenAI API over the engine, independent of the HTTP stack: request validation, sampling
parameters, chat rendering and tool-call parsing (through `tokenizer.chat.ChatRenderer` only),
response and stream-chunk bodies, metrics, and the admin weight update. `inference/server.py`
serves it over FastAPI/uvicorn.

What RL needs is returned under a namespaced extension field of each choice (the harness's
`OpenAIPolicy` reads it):

    choices[i].opencomposer = {"token_ids", "prompt_token_ids", "logprobs", "policy_versions",
                               "routed_experts"}   # routed_experts: [position][layer][k], MoE only
"""

from __future__ import annotations

import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.core.machine import usable_cpus
from opencomposer.inference.engine import (
    Engine,
    EngineBusy,
    EngineError,
    Sequence,
    WeightUpdateError,
)
from opencomposer.inference.sampling import SamplingError, SamplingParams
from opencomposer.inference.weights import checksum, read_update

TOOL_OPEN = "<tool_call>"


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    model: Path | None = None
    """A model folder (config.json, safetensors, tokenizer.json); None: the embedded default."""
    name: str | None = None
    """The served model name (default: the folder's name)."""
    host: str = "127.0.0.1"
    port: int = 8000
    slots: int = 32
    max_len: int | None = None
    threads: int = 0
    """Torch's intra-op threads for the engine (0: torch's default, one per core). Set it when
    another process computes on the same cores (an RL trainer beside its replica)."""
    default_max_tokens: int = 512
    max_waiting: int = 256
    """Sequences queued for a slot at most; past it requests get 429 with Retry-After."""
    max_connections: int = 1024
    """Open connections at most (uvicorn answers 503 past it)."""
    admin_token: str | None = None
    speculative: bool = False
    """MTP speculative decoding (models with MTP heads)."""
    prefix_cache_mb: int = 1024
    """Memory for KV kept across requests (0: no prefix cache)."""
    keep_stale_prefix: bool = False
    """Keep cached KV across weight updates (each response records the version it came from)."""
    prefill_chunk: int = 512
    """Prompt tokens prefilled per step while other requests decode."""
    request_timeout_s: float = 600.0
    body_timeout_s: float = 30.0
    """A request body must arrive within this (slow-loris bodies get 408)."""
    max_body_bytes: int = 16 * 1024 * 1024
    retry_after_s: int = 1
    weights: str | None = None
    """A weight store to follow (a folder or fsspec URL, `inference/weight_store.py`): each new
    version is pulled, verified and swapped in between decode steps; a refused one is reported in
    /health and /metrics while the last good weights keep serving (an RL inference replica)."""
    ready_file: Path | None = None
    """Written (atomically, JSON with the base URL and pid) once the server listens: how a parent
    process learns the port of `port = 0`."""
    shutdown_timeout_s: float = 30.0
    """How long a stop may take: in-flight requests are cut off after it (uvicorn's graceful
    shutdown), and `opencomposer serve` exits hard when its stop has not finished by then, so a
    replica whose driver died never lingers on a stuck request or thread."""


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters could be the start of a marker (not safe to stream yet)."""
    hold = 1 if text.endswith("\ufffd") else 0  # an incomplete UTF-8 sequence
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                hold = max(hold, k)
                break
    return hold


class Frontend:
    """The API's logic over one engine and tokenizer; thread-safe where the engine is."""

    def __init__(self, engine: Engine, tokenizer, name: str, config: ServeConfig | None = None):
        from opencomposer.tokenizer.chat import ChatRenderer

        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.name = name
        self.config = config or ServeConfig()
        self.started = time.time()
        self.counters = {"http_requests": 0, "http_errors": 0, "disconnects": 0, "rejected_busy": 0}
        self.follower = None
        """The `WeightFollower` of `config.weights`, set by the server that starts one."""

    def close(self) -> None:
        """Let go of the engine, tokenizer and weight follower once the server has stopped.
        FastAPI keeps the endpoint functions of every app it builds in module-wide caches
        (`fastapi.dependencies.models`, `lru_cache`s of 4,096 entries, as of 0.165), and those
        functions close over this frontend: without this, every server a process had started kept
        its model, KV cache and prefix cache alive. The speedrun serves each agent eval from its own
        process-local server, and its driver grew ~2-4 GB per eval (measured: +1.7 GB resident per
        SmolLM2 server started and stopped, after gc and malloc_trim)."""
        self.engine = self.tokenizer = self.renderer = self.follower = None

    # -- requests -------------------------------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model not in (None, self.name):
            raise RequestError(404, f"The model `{model}` does not exist (serving `{self.name}`)", "model",
                               "model_not_found")

    def params(self, body: dict, *, legacy: bool = False) -> tuple[SamplingParams, int]:
        def num(key, default, cast):
            v = body.get(key, default)
            if v is None:
                return default
            try:
                return cast(v)
            except (TypeError, ValueError):
                raise RequestError(400, f"{key} must be a number, got {v!r}", key) from None

        stop = body.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(400, "stop must be a string or a list of non-empty strings", "stop")
        if legacy:
            top = num("logprobs", 0, int) if body.get("logprobs") is not None else 0
        else:
            top = num("top_logprobs", 0, int) if body.get("logprobs") else 0
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = self.config.default_max_tokens if max_tokens is None else num("max_tokens", 0, int)
        n = num("n", 1, int)
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise RequestError(400, "seed must be an integer", "seed")
        eos = tuple(t for t in (self.tokenizer.eos_id,) if t is not None)
        try:
            p = SamplingParams(temperature=num("temperature", 1.0, float), top_p=num("top_p", 1.0, float),
                               top_k=num("top_k", 0, int), max_tokens=max_tokens, stop=tuple(stop), seed=seed,
                               top_logprobs=top, stop_token_ids=eos).validate()
        except SamplingError as e:
            raise RequestError(400, str(e)) from None
        return p, n

    def submit(self, prompt: list[int], params: SamplingParams, n: int) -> list[Sequence]:
        room = self.engine.max_len - len(prompt)
        if room <= 0:
            raise RequestError(400, f"This model's maximum context length is {self.engine.max_len} tokens; "
                                    f"the prompt has {len(prompt)} tokens", "messages", "context_length_exceeded")
        if params.max_tokens > room:
            import dataclasses

            params = dataclasses.replace(params, max_tokens=room)
        try:
            return self.engine.submit(prompt, params, n)
        except EngineBusy as e:
            self.counters["rejected_busy"] += 1
            raise RequestError(429, f"server busy: {e}", kind="rate_limit_exceeded",
                               headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except (EngineError, SamplingError) as e:
            raise RequestError(400, str(e)) from None

    def text_of(self, s: Sequence) -> str:
        toks = s.tokens[:-1] if s.finish_reason == "stop" and s.tokens and s.tokens[-1] in s.params.stop_token_ids \
            else s.tokens
        text = self.tokenizer.decode(toks)
        for stop in s.params.stop:
            if stop in text:
                text = text[: text.index(stop)]
        return text

    def extension(self, s: Sequence, body: dict) -> dict:
        ext = {"token_ids": s.tokens, "prompt_token_ids": s.prompt, "logprobs": s.logprobs,
               "policy_versions": s.versions, "cached_tokens": s.cached_tokens}
        if s.prefix_version is not None:
            ext["prefix_version"] = s.prefix_version  # the oldest weights the reused KV came from
        if s.experts is not None and body.get("return_routed_experts", True):
            ext["routed_experts"] = s.experts
        return ext

    def token_logprobs(self, s: Sequence) -> list[dict]:
        def entry(tok: int, lp: float) -> dict:
            t = self.tokenizer.decode([tok])
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

        out = []
        for i, (tok, lp) in enumerate(zip(s.tokens, s.logprobs)):
            e = entry(tok, lp)
            e["top_logprobs"] = [entry(t, v) for t, v in s.top_logprobs[i]] if s.top_logprobs else []
            out.append(e)
        return out

    def chat_request(self, body: dict) -> tuple[list[int], SamplingParams, int, list | None]:
        from opencomposer.tokenizer.chat import RenderError

        self.check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError(400, "messages must be a non-empty list of objects", "messages")
        tools = body.get("tools")
        if tools is not None:
            if not isinstance(tools, list):
                raise RequestError(400, "tools must be a list", "tools")
            for i, t in enumerate(tools):
                fn = t.get("function") if isinstance(t, dict) else None
                if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                        or not isinstance(fn.get("name"), str) or not fn["name"] \
                        or not isinstance(fn.get("parameters", {}), dict):
                    raise RequestError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                                            "'parameters': object}}}}", f"tools[{i}]")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise RequestError(400, f"tool_choice {choice!r} is not supported (auto or none): this engine does not "
                                    "constrain decoding", "tool_choice")
        if choice == "none":
            tools = None
        try:
            prompt = self.renderer.encode(messages, tools or None, add_generation_prompt=True).ids
        except (RenderError, KeyError, TypeError, AttributeError) as e:
            raise RequestError(400, f"cannot render messages: {e}", "messages") from None
        params, n = self.params(body)
        return prompt, params, n, tools

    def chat_choice(self, i: int, s: Sequence, body: dict, tools) -> dict:
        text = self.text_of(s)
        content, calls = self.renderer.parse(text) if tools else (text, [])
        for k, c in enumerate(calls):
            c["id"] = f"call_{s.id}_{k}"
        finish = "tool_calls" if calls else ("length" if s.finish_reason == "length" else "stop")
        msg: dict[str, Any] = {"role": "assistant", "content": content if (content.strip() or not calls) else None}
        if calls:
            msg["tool_calls"] = calls
        return {"index": i, "message": msg, "finish_reason": finish,
                "logprobs": {"content": self.token_logprobs(s)} if body.get("logprobs") else None,
                "opencomposer": self.extension(s, body)}

    def usage(self, prompt: list[int], seqs: list[Sequence]) -> dict:
        """OpenAI's usage block; `cached_tokens` counts prompt tokens served from the prefix cache
        (the n samples of one request share one prefill, so it is the group's)."""
        c = sum(len(s.tokens) for s in seqs)
        cached = seqs[0].cached_tokens if seqs else 0
        return {"prompt_tokens": len(prompt), "completion_tokens": c, "total_tokens": len(prompt) + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def metrics_text(self) -> str:
        st = self.engine.stats
        lines = []

        def metric(name: str, kind: str, value: float, help_: str) -> None:
            lines.extend([f"# HELP opencomposer_{name} {help_}", f"# TYPE opencomposer_{name} {kind}",
                          f"opencomposer_{name} {value}"])

        metric("requests_total", "counter", st["requests"], "generation requests accepted")
        metric("prompt_tokens_total", "counter", st["prompt_tokens"], "prompt tokens prefilled")
        metric("generated_tokens_total", "counter", st["generated_tokens"], "tokens sampled")
        metric("decode_steps_total", "counter", st["decode_steps"], "batched decode steps")
        metric("decode_seconds_total", "counter", round(st["decode_seconds"], 6), "time in decode steps")
        metric("decode_shared_prefix_rows_total", "counter", st["decode_shared_rows"],
               "rows of decode steps that read a prefix shared with other rows once for all of them")
        metric("aborted_total", "counter", st["aborted"], "sequences aborted")
        metric("weight_updates_total", "counter", st["weight_updates"], "in-flight weight updates applied")
        metric("spec_drafted_total", "counter", st["drafted"], "MTP draft tokens proposed")
        metric("spec_accepted_total", "counter", st["accepted"], "MTP draft tokens accepted")
        metric("policy_version", "gauge", self.engine.version, "the served weights' version")
        if self.follower is not None:
            metric("weights_rejected_total", "counter", self.follower.rejected,
                   "weight versions refused (corrupt, partial or out of order)")
        metric("prefill_seconds_total", "counter", round(st["prefill_seconds"], 6), "time in prefill forwards")
        metric("prompt_tokens_cached_total", "counter", st["cached_prompt_tokens"],
               "prompt tokens served from the prefix cache instead of prefilled")
        seen = st["prompt_tokens"] + st["cached_prompt_tokens"]
        metric("prefix_cache_hit_rate", "gauge", round(st["cached_prompt_tokens"] / seen, 6) if seen else 0.0,
               "share of prompt tokens served from the prefix cache")
        pc = self.engine.prefix
        if pc is not None:
            metric("prefix_cache_tokens", "gauge", pc.tokens, "tokens held by the prefix cache")
            metric("prefix_cache_bytes", "gauge", pc.nbytes, "bytes held by the prefix cache")
            metric("prefix_cache_budget_bytes", "gauge", pc.budget, "the prefix cache's memory budget")
            metric("prefix_cache_evictions_total", "counter", pc.stats["evictions"], "prefix-cache nodes evicted")
            metric("prefix_cache_evicted_tokens_total", "counter", pc.stats["evicted_tokens"], "tokens evicted")
            metric("prefix_cache_refused_total", "counter", pc.stats["refused"],
                   "insertions refused (larger than the budget, or everything left in use)")
        load = self.engine.load()
        metric("running", "gauge", load["running"], "sequences decoding")
        metric("waiting", "gauge", load["waiting"], "sequences queued")
        for k, v in self.counters.items():
            metric(f"{k}_total", "counter", v, k.replace("_", " "))
        return "\n".join(lines) + "\n"

    def _admin(self, auth: str | None) -> None:
        token = self.config.admin_token
        if not token:
            raise RequestError(403, "the admin endpoint is disabled (start the server with --admin-token)",
                               kind="permission_error")
        if not auth or not secrets.compare_digest(auth, f"Bearer {token}"):
            raise RequestError(401, "missing or wrong admin bearer token", kind="authentication_error")

    def admin_threads(self, body: dict, auth: str | None) -> dict:
        """Set the engine's torch threads from its next step on (bounded by the CPUs this process may use)."""
        self._admin(auth)
        n = body.get("threads")
        cpus = usable_cpus()
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= cpus:
            raise RequestError(400, f"body must be {{'threads': int}} with 1 <= threads <= {cpus} (this process's "
                                    "CPUs)", "threads")
        self.engine.set_threads(n)
        return {"threads": n, "applied": self.engine.threads}

    def admin_weights(self, body: dict, auth: str | None) -> dict:
        self._admin(auth)
        path, version = body.get("path"), body.get("version")
        if not isinstance(path, str) or not isinstance(version, int) or isinstance(version, bool):
            raise RequestError(400, "body must be {'path': str, 'version': int, 'checksum'?: sha256 hex}")
        want = body.get("checksum")
        if want is not None and checksum(path) != want:
            raise RequestError(400, f"checksum mismatch for {path}: the files are not the announced version",
                               "checksum")
        t0 = time.perf_counter()
        try:
            tensors = read_update(path, self.engine.model)
            self.engine.update_weights(tensors, version, wait=self.config.request_timeout_s)
        except TimeoutError:
            if self.engine.withdraw_update(version):
                raise RequestError(504, f"weight version {version} was not swapped in within "
                                        f"{self.config.request_timeout_s:.0f} s and was withdrawn; still serving "
                                        f"version {self.engine.version}", kind="timeout") from None
        except WeightUpdateError as e:
            raise RequestError(400, f"weight update refused, still serving version {self.engine.version}: {e}") \
                from None
        return {"version": self.engine.version, "tensors": len(tensors), "seconds": time.perf_counter() - t0,
                "swap_seconds": self.engine.stats.get("last_swap_seconds")}


    def completions_request(self, body: dict) -> tuple[list[int], SamplingParams, int]:
        self.check_model(body)
        if body.get("stream"):
            raise RequestError(400, "stream is not supported on /v1/completions (use /v1/chat/completions)",
                               "stream")
        if body.get("echo"):
            raise RequestError(400, "echo is not supported", "echo")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):  # not bool, an int to Python
            ids = prompt
        else:
            raise RequestError(400, "prompt must be a non-empty string or a list of token ids (one prompt)", "prompt")
        params, n = self.params(body, legacy=True)
        return ids, params, n

    def completions_response(self, body: dict, ids: list[int], seqs: list[Sequence]) -> dict:
        choices = []
        for i, s in enumerate(seqs):
            text = self.text_of(s)
            lp = None
            if body.get("logprobs") is not None:
                toks = [self.tokenizer.decode([t]) for t in s.tokens]
                offsets, pos = [], 0
                for t in toks:
                    offsets.append(pos)
                    pos += len(t)
                lp = {"tokens": toks, "token_logprobs": s.logprobs, "text_offset": offsets,
                      "top_logprobs": [{self.tokenizer.decode([t]): v for t, v in top} for top in s.top_logprobs]
                      if s.top_logprobs else None}
            choices.append({"index": i, "text": text, "logprobs": lp,
                            "finish_reason": "length" if s.finish_reason == "length" else "stop",
                            "opencomposer": self.extension(s, body)})
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                "created": int(time.time()), "model": self.name, "choices": choices, "usage": self.usage(ids, seqs)}

    def chat_response(self, body: dict, rid: str, created: int, prompt: list[int], seqs: list[Sequence],
                      tools) -> dict:
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.name,
                "choices": [self.chat_choice(i, s, body, tools) for i, s in enumerate(seqs)],
                "usage": self.usage(prompt, seqs)}

    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.name, "object": "model", "created": int(self.started), "owned_by": "opencomposer",
             "max_model_len": self.engine.max_len, "policy_version": self.engine.version}]}

    def health(self) -> dict:
        load = self.engine.load()
        out = {"status": "ok" if load["alive"] else "stopped", "model": self.name,
               "policy_version": self.engine.version, "running": load["running"], "waiting": load["waiting"],
               "threads": self.engine.threads}
        if self.follower is not None:
            out["weights"] = {"store": self.follower.url, "rejected": self.follower.rejected,
                              "refusals": self.follower.refusals[-20:]}
        return out


class ChatStream:
    """The chunks of one streamed chat request, advanced whenever its sequences progress."""

    def __init__(self, fe: Frontend, body: dict, rid: str, created: int, prompt: list[int], seqs: list[Sequence],
                 tools):
        self.fe, self.body, self.rid, self.created, self.prompt, self.seqs, self.tools = \
            fe, body, rid, created, prompt, seqs, tools
        self.markers = tuple(s for s in seqs[0].params.stop) + ((TOOL_OPEN,) if tools else ())
        self.sent = [0] * len(seqs)        # characters of visible text already streamed
        self.seen = [0] * len(seqs)        # tokens already looked at
        self.finished = [False] * len(seqs)

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.fe.name,
                "choices": choices, **extra}

    def first(self) -> dict:
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                           for i in range(len(self.seqs))])

    @property
    def done(self) -> bool:
        return all(self.finished)

    def advance(self) -> list[dict]:
        """Chunks for whatever the sequences produced since the last call."""
        fe, out = self.fe, []
        for i, s in enumerate(self.seqs):
            if self.finished[i] or (len(s.tokens) == self.seen[i] and not s.done.is_set()):
                continue
            self.seen[i] = len(s.tokens)
            done = s.done.is_set()
            text = fe.text_of(s) if done else fe.tokenizer.decode(s.tokens)
            visible = text.split(TOOL_OPEN, 1)[0] if self.tools else text
            if not done:
                for stop in s.params.stop:
                    visible = visible.split(stop, 1)[0]
                visible = visible[: len(visible) - held_back(visible, self.markers)]
            if len(visible) > self.sent[i]:
                out.append(self.chunk([{"index": i, "delta": {"content": visible[self.sent[i]:]},
                                        "finish_reason": None}]))
                self.sent[i] = len(visible)
            if done:
                self.finished[i] = True
                if s.error:
                    raise RequestError(500, f"engine error: {s.error}", kind="server_error")
                final = fe.chat_choice(i, s, self.body, self.tools)
                delta = {}
                if final["message"].get("tool_calls"):
                    delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(final["message"]["tool_calls"])]
                out.append(self.chunk([{"index": i, "delta": delta, "finish_reason": final["finish_reason"],
                                        "logprobs": final["logprobs"], "opencomposer": final["opencomposer"]}]))
        if self.done and (self.body.get("stream_options") or {}).get("include_usage"):
            out.append(self.chunk([], usage=fe.usage(self.prompt, self.seqs)))
        return out
