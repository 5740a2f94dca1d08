"""The OpenAI-compatible HTTP server over the engine.

    opencomposer serve [--model DIR] [--host H] [--port P] [--admin-token T]

Endpoints: POST /v1/chat/completions (tools, tool_choice auto|none, stream, n, logprobs,
top_logprobs, seed, stop), POST /v1/completions, GET /v1/models, GET /health, GET /metrics
(Prometheus text), POST /admin/weights (bearer token: load a new weight version in flight).

Conversations become tokens only through `tokenizer.chat.ChatRenderer`, and tool calls are parsed
by the same renderer — nothing about the chat format lives here. What RL needs is returned under a
namespaced extension field of each choice (the harness's `OpenAIPolicy` reads it):

    choices[i].opencomposer = {"token_ids", "prompt_token_ids", "logprobs", "policy_versions",
                               "routed_experts"}   # routed_experts: [position][layer][k], MoE only

Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "param", "code"}}`): 400 for bad
requests, 401/403 for the admin endpoint, 404 for unknown models and paths, 413 for bodies over
the limit, 504 when a generation misses its deadline. A client that disconnects mid-stream has its
sequences aborted and their slots freed.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opencomposer.inference.engine import Engine, EngineConfig, EngineError, Sequence, WeightUpdateError, checksum, \
    read_update
from opencomposer.inference.sampling import SamplingError, SamplingParams

log = logging.getLogger(__name__)

TOOL_OPEN = "<tool_call>"


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


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
    default_max_tokens: int = 512
    admin_token: str | None = None
    speculative: bool = False
    """MTP speculative decoding (models with MTP heads)."""
    request_timeout_s: float = 600.0
    max_body_bytes: int = 16 * 1024 * 1024


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters could be the start of a marker (not safe to stream yet)."""
    hold = 1 if text.endswith("\ufffd") else 0  # an incomplete UTF-8 sequence
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                hold = max(hold, k)
                break
    return hold


class Server:
    def __init__(self, engine: Engine, tokenizer, name: str, config: ServeConfig | None = None):
        from opencomposer.tokenizer.chat import ChatRenderer

        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.name = name
        self.config = config or ServeConfig()
        self.started = time.time()
        self.counters = {"http_requests": 0, "http_errors": 0, "disconnects": 0}
        self._lock = threading.Lock()
        self.httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> "Server":
        server = self

        class Handler(_Handler):
            owner = server

        self.httpd = ThreadingHTTPServer((self.config.host, self.config.port), Handler)
        self.httpd.daemon_threads = True
        self.engine.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        self.engine.stop()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

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
        except (EngineError, SamplingError) as e:
            raise RequestError(400, str(e)) from None

    def wait(self, seqs: list[Sequence]) -> None:
        deadline = time.monotonic() + self.config.request_timeout_s
        for s in seqs:
            if not s.done.wait(max(0.0, deadline - time.monotonic())):
                self.engine.abort(seqs)
                raise RequestError(504, f"generation did not finish within {self.config.request_timeout_s:.0f} s",
                                   kind="timeout")
        for s in seqs:
            if s.error:
                raise RequestError(500, f"engine error: {s.error}", kind="server_error")

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
               "policy_versions": s.versions}
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
        c = sum(len(s.tokens) for s in seqs)
        return {"prompt_tokens": len(prompt), "completion_tokens": c, "total_tokens": len(prompt) + c}

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
        metric("aborted_total", "counter", st["aborted"], "sequences aborted")
        metric("weight_updates_total", "counter", st["weight_updates"], "in-flight weight updates applied")
        metric("spec_drafted_total", "counter", st["drafted"], "MTP draft tokens proposed")
        metric("spec_accepted_total", "counter", st["accepted"], "MTP draft tokens accepted")
        metric("policy_version", "gauge", self.engine.version, "the served weights' version")
        metric("running", "gauge", len(self.engine._running), "sequences decoding")
        metric("waiting", "gauge", sum(len(g.seqs) for g in self.engine._waiting), "sequences queued")
        for k, v in self.counters.items():
            metric(f"{k}_total", "counter", v, k.replace("_", " "))
        return "\n".join(lines) + "\n"

    def admin_weights(self, body: dict, auth: str | None) -> dict:
        token = self.config.admin_token
        if not token:
            raise RequestError(403, "the admin endpoint is disabled (start the server with --admin-token)",
                               kind="permission_error")
        if not auth or not secrets.compare_digest(auth, f"Bearer {token}"):
            raise RequestError(401, "missing or wrong admin bearer token", kind="authentication_error")
        path, version = body.get("path"), body.get("version")
        if not isinstance(path, str) or not isinstance(version, int):
            raise RequestError(400, "body must be {'path': str, 'version': int, 'checksum'?: sha256 hex}")
        want = body.get("checksum")
        if want is not None and checksum(path) != want:
            raise RequestError(400, f"checksum mismatch for {path}: the files are not the announced version",
                               "checksum")
        t0 = time.perf_counter()
        try:
            tensors = read_update(path, self.engine.model)
            self.engine.update_weights(tensors, version, wait=self.config.request_timeout_s)
        except WeightUpdateError as e:
            raise RequestError(400, f"weight update refused, still serving version {self.engine.version}: {e}") \
                from None
        return {"version": self.engine.version, "tensors": len(tensors), "seconds": time.perf_counter() - t0,
                "swap_seconds": self.engine.stats.get("last_swap_seconds")}


class _Handler(BaseHTTPRequestHandler):
    owner: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # route to logging, not stderr
        log.debug("%s %s", self.address_string(), fmt % args)

    # -- plumbing -------------------------------------------------------------------------------------
    def _send_json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: int, text: str, ctype: str = "text/plain; version=0.0.4") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: RequestError) -> None:
        with self.owner._lock:
            self.owner.counters["http_errors"] += 1
        self._send_json(e.status, {"error": {"message": e.message, "type": e.kind, "param": e.param,
                                             "code": e.status}})

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise RequestError(400, "bad Content-Length") from None
        if length > self.owner.config.max_body_bytes:
            self.close_connection = True
            raise RequestError(413, f"request body of {length} bytes exceeds {self.owner.config.max_body_bytes}")
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise RequestError(400, f"request body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        return body

    # -- routes -----------------------------------------------------------------------------------------
    def do_GET(self):
        o = self.owner
        with o._lock:
            o.counters["http_requests"] += 1
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in ("/health", "/v1/health"):
            self._send_json(200, {"status": "ok", "model": o.name, "policy_version": o.engine.version})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": o.name, "object": "model", "created": int(o.started), "owned_by": "opencomposer",
                 "max_model_len": o.engine.max_len, "policy_version": o.engine.version}]})
        elif path == "/metrics":
            self._send_text(200, o.metrics_text())
        else:
            self._error(RequestError(404, f"no route GET {path}", kind="not_found"))

    def do_POST(self):
        o = self.owner
        with o._lock:
            o.counters["http_requests"] += 1
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            body = self._body()
            if path == "/v1/chat/completions":
                self._chat(body)
            elif path == "/v1/completions":
                self._completions(body)
            elif path == "/admin/weights":
                self._send_json(200, o.admin_weights(body, self.headers.get("Authorization")))
            else:
                raise RequestError(404, f"no route POST {path}", kind="not_found")
        except RequestError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            with o._lock:
                o.counters["disconnects"] += 1
        except Exception as e:  # noqa: BLE001 - a bug must not kill the server thread silently
            log.exception("request failed")
            self._error(RequestError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    def _chat(self, body: dict) -> None:
        o = self.owner
        prompt, params, n, tools = o.chat_request(body)
        seqs = o.submit(prompt, params, n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.get("stream"):
            return self._stream(body, rid, created, prompt, seqs, tools)
        o.wait(seqs)
        self._send_json(200, {"id": rid, "object": "chat.completion", "created": created, "model": o.name,
                              "choices": [o.chat_choice(i, s, body, tools) for i, s in enumerate(seqs)],
                              "usage": o.usage(prompt, seqs)})

    def _stream(self, body, rid, created, prompt, seqs: list[Sequence], tools) -> None:
        o = self.owner
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(choices: list[dict], **extra) -> None:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": o.name,
                     "choices": choices, **extra}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        markers = tuple(s for s in seqs[0].params.stop) + ((TOOL_OPEN,) if tools else ())
        sent = [0] * len(seqs)        # characters of visible text already streamed
        seen = [0] * len(seqs)        # tokens already looked at
        finished = [False] * len(seqs)
        deadline = time.monotonic() + o.config.request_timeout_s
        try:
            send([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                  for i in range(len(seqs))])
            while not all(finished):
                if time.monotonic() > deadline:
                    o.engine.abort(seqs)
                    raise RequestError(504, "generation timed out", kind="timeout")
                progressed = False
                for i, s in enumerate(seqs):
                    if finished[i] or (len(s.tokens) == seen[i] and not s.done.is_set()):
                        continue
                    progressed = True
                    seen[i] = len(s.tokens)
                    done = s.done.is_set()
                    text = o.text_of(s) if done else o.tokenizer.decode(s.tokens)
                    visible = text.split(TOOL_OPEN, 1)[0] if tools else text
                    if not done:
                        for stop in s.params.stop:
                            visible = visible.split(stop, 1)[0]
                        visible = visible[: len(visible) - _held_back(visible, markers)]
                    if len(visible) > sent[i]:
                        send([{"index": i, "delta": {"content": visible[sent[i]:]}, "finish_reason": None}])
                        sent[i] = len(visible)
                    if done:
                        finished[i] = True
                        if s.error:
                            raise RequestError(500, f"engine error: {s.error}", kind="server_error")
                        final = o.chat_choice(i, s, body, tools)
                        delta = {}
                        if final["message"].get("tool_calls"):
                            delta["tool_calls"] = [{"index": k, **c} for k, c in
                                                   enumerate(final["message"]["tool_calls"])]
                        send([{"index": i, "delta": delta, "finish_reason": final["finish_reason"],
                               "logprobs": final["logprobs"], "opencomposer": final["opencomposer"]}])
                if not progressed:
                    pending = next(s for i, s in enumerate(seqs) if not finished[i])
                    try:
                        pending.events.get(timeout=0.05)
                    except Exception:  # noqa: BLE001 - queue.Empty: poll again
                        pass
            if (body.get("stream_options") or {}).get("include_usage"):
                send([], usage=o.usage(prompt, seqs))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            o.engine.abort(seqs)  # the client left: free the slots
            with o._lock:
                o.counters["disconnects"] += 1
        except RequestError as e:
            self.wfile.write(f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind}})}\n\n".encode())

    def _completions(self, body: dict) -> None:
        o = self.owner
        o.check_model(body)
        if body.get("stream"):
            raise RequestError(400, "stream is not supported on /v1/completions (use /v1/chat/completions)",
                               "stream")
        if body.get("echo"):
            raise RequestError(400, "echo is not supported", "echo")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            ids = o.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise RequestError(400, "prompt must be a non-empty string or a list of token ids (one prompt)", "prompt")
        params, n = o.params(body, legacy=True)
        seqs = o.submit(ids, params, n)
        o.wait(seqs)
        choices = []
        for i, s in enumerate(seqs):
            text = o.text_of(s)
            lp = None
            if body.get("logprobs") is not None:
                toks = [o.tokenizer.decode([t]) for t in s.tokens]
                offsets, pos = [], 0
                for t in toks:
                    offsets.append(pos)
                    pos += len(t)
                lp = {"tokens": toks, "token_logprobs": s.logprobs, "text_offset": offsets,
                      "top_logprobs": [{o.tokenizer.decode([t]): v for t, v in top} for top in s.top_logprobs]
                      if s.top_logprobs else None}
            choices.append({"index": i, "text": text, "logprobs": lp,
                            "finish_reason": "length" if s.finish_reason == "length" else "stop",
                            "opencomposer": o.extension(s, body)})
        self._send_json(200, {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                              "created": int(time.time()), "model": o.name, "choices": choices,
                              "usage": o.usage(ids, seqs)})


def load_served(folder: Path, *, slots: int = 32, max_len: int | None = None, speculative: bool = False,
                ) -> tuple[Engine, Any]:
    """A model folder -> (engine, tokenizer). The folder must carry its tokenizer.json."""
    from opencomposer.model.errors import ModelLoadError
    from opencomposer.model.hf import load_model
    from opencomposer.tokenizer.bpe import Tokenizer

    model = load_model(folder)
    tok = Tokenizer.load(folder)
    if tok.vocab_size > model.config.vocab_size:
        raise ModelLoadError(f"{folder}: tokenizer has {tok.vocab_size} tokens, the model's vocabulary "
                             f"{model.config.vocab_size}")
    eos = tuple(t for t in (tok.eos_id,) if t is not None)
    try:
        engine = Engine(model, config=EngineConfig(slots=slots, max_len=max_len, speculative=speculative),
                        eos_ids=eos, decode=tok.decode)
    except EngineError as e:
        raise ModelLoadError(f"{folder}: {e}") from None
    return engine, tok


def make_server(cfg: ServeConfig, default_folder: Path) -> Server:
    folder = cfg.model
    if folder is None:
        folder = default_folder
        if not (folder / "config.json").exists():
            from opencomposer.model.interop import import_default

            import_default(folder)
    engine, tok = load_served(Path(folder), slots=cfg.slots, max_len=cfg.max_len, speculative=cfg.speculative)
    return Server(engine, tok, cfg.name or Path(folder).name, cfg)
