"""The OpenAI-compatible HTTP server over the engine: an ASGI app (FastAPI) served by uvicorn.

    opencomposer serve [-c serve.toml] [--model DIR] [--host H] [--port P] [--admin-token T] [--a.b=value]

Endpoints: POST /v1/chat/completions (tools, tool_choice auto|none, stream, n, logprobs,
top_logprobs, seed, stop), POST /v1/completions, GET /v1/models, GET /health, GET /metrics
(Prometheus text), POST /admin/weights (bearer token: load a new weight version in flight), POST /admin/threads
(bearer token: the engine's torch threads from its next step on), and
the OpenAPI schema at /openapi.json. The API's logic is `inference/openai_api.py`; this module is
transport only: async handlers, SSE streaming, limits.

Under load and bad input (the issue this answers: a thread-per-connection server with an unbounded
queue showed overload only as timeouts and resets):
- admission is bounded: past `max_waiting` queued sequences a request gets 429 with Retry-After,
  past `max_connections` open connections uvicorn answers 503; `/health` keeps answering;
- bodies over `max_body_bytes` get 413, bodies slower than `body_timeout_s` 408, invalid UTF-8 or
  JSON nested too deeply 400 — OpenAI-shaped errors, never a 500 for a client's mistake;
- a client that disconnects, streaming or not, has its sequences aborted and their slots freed;
- every wait has a deadline (`request_timeout_s`: 504), every queue a bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from opencomposer.inference.engine import Engine, EngineConfig, EngineError, Sequence
from opencomposer.inference.openai_api import ChatStream, Frontend, RequestError, ServeConfig

log = logging.getLogger(__name__)

__all__ = ["RequestError", "Server", "ServeConfig", "load_served", "make_server"]

_BODY_SCHEMA = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "additionalProperties": True}}}}}
CHAT_SCHEMA = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["messages"], "additionalProperties": True, "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object", "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "content": {"type": ["string", "null"]}}, "required": ["role"]}},
        "tools": {"type": "array", "items": {"type": "object"}},
        "max_tokens": {"type": "integer"}, "temperature": {"type": "number"}, "top_p": {"type": "number"},
        "n": {"type": "integer"}, "stream": {"type": "boolean"}, "seed": {"type": "integer"},
        "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer"},
        "stop": {"type": ["string", "array"]}}}}}}}
COMPLETIONS_SCHEMA = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["prompt"], "additionalProperties": True, "properties": {
        "model": {"type": "string"}, "prompt": {"type": ["string", "array"]},
        "max_tokens": {"type": "integer"}, "temperature": {"type": "number"}, "n": {"type": "integer"},
        "logprobs": {"type": ["integer", "null"]}, "seed": {"type": "integer"}}}}}}}


class _ClientGone(Exception):
    pass


class _CountRequests:
    def __init__(self, app, counters: dict):
        self.app, self.counters = app, counters

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.counters["http_requests"] += 1
        await self.app(scope, receive, send)


def build_app(fe: Frontend):
    """The ASGI app for one frontend (and its engine)."""
    cfg = fe.config
    app = FastAPI(title="opencomposer", version="0.1.0",
                  description="OpenAI-compatible chat and completions over the opencomposer engine; each "
                              "choice carries `opencomposer` {token_ids, prompt_token_ids, logprobs, "
                              "policy_versions, routed_experts}.")

    def error(e: RequestError) -> JSONResponse:
        fe.counters["http_errors"] += 1
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        kind = {404: "not_found", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        msg = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error(RequestError(e.status_code, msg, kind=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error(RequestError(400, f"invalid request: {e.errors()[:3]}"))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("request failed")
        return error(RequestError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    # A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide client disconnects.
    app.add_middleware(_CountRequests, counters=fe.counters)

    async def read_body(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise RequestError(400, "bad Content-Length")
            if int(length) > cfg.max_body_bytes:
                raise RequestError(413, f"request body of {length} bytes exceeds {cfg.max_body_bytes}")

        async def collect() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cfg.max_body_bytes:
                    raise RequestError(413, f"request body exceeds {cfg.max_body_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            raw = await asyncio.wait_for(collect(), cfg.body_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {cfg.body_timeout_s:.0f} s",
                               kind="timeout") from None
        try:
            body = json.loads(raw.decode("utf-8") if raw else "{}")
        except UnicodeDecodeError as e:
            raise RequestError(400, f"request body is not UTF-8 ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise RequestError(400, f"request body is not JSON ({e})") from None
        except RecursionError:
            raise RequestError(400, "request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        return body

    def alive() -> None:
        if not fe.engine.load()["alive"]:
            raise RequestError(503, "the engine is not running", kind="server_error",
                               headers={"Retry-After": str(cfg.retry_after_s)})

    def progress_event(seqs: list[Sequence]) -> asyncio.Event:
        loop, ev = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # the loop closed (server stopping)
                pass

        for s in seqs:
            s.watchers.append(wake)
            if s.done.is_set():
                ev.set()
        return ev

    async def finish(request: Request, seqs: list[Sequence]) -> None:
        """Wait for `seqs` to end; abort them if the client leaves or the deadline passes."""
        ev = progress_event(seqs)
        deadline = time.monotonic() + cfg.request_timeout_s
        while not all(s.done.is_set() for s in seqs):
            try:
                await asyncio.wait_for(ev.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
            ev.clear()
            if await request.is_disconnected():
                fe.engine.abort(seqs)
                fe.counters["disconnects"] += 1
                raise _ClientGone()
            if time.monotonic() > deadline:
                fe.engine.abort(seqs)
                raise RequestError(504, f"generation did not finish within {cfg.request_timeout_s:.0f} s",
                                   kind="timeout")
        for s in seqs:
            if s.error:
                raise RequestError(500, f"engine error: {s.error}", kind="server_error")

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health():
        return fe.health()

    @app.get("/v1/models")
    async def models():
        return fe.models()

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(fe.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions", openapi_extra=CHAT_SCHEMA)
    async def chat(request: Request):
        body = await read_body(request)
        alive()
        prompt, params, n, tools = fe.chat_request(body)
        seqs = fe.submit(prompt, params, n)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if body.get("stream"):
            return StreamingResponse(stream(request, ChatStream(fe, body, rid, created, prompt, seqs, tools)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            await finish(request, seqs)
        except _ClientGone:
            return JSONResponse({}, status_code=499)  # nobody is listening
        return fe.chat_response(body, rid, created, prompt, seqs, tools)

    async def stream(request: Request, st: ChatStream):
        ev = progress_event(st.seqs)
        deadline = time.monotonic() + cfg.request_timeout_s
        complete = False
        try:
            yield f"data: {json.dumps(st.first())}\n\n"
            while True:
                for chunk in st.advance():
                    yield f"data: {json.dumps(chunk)}\n\n"
                if st.done:
                    break
                if time.monotonic() > deadline:
                    raise RequestError(504, "generation timed out", kind="timeout")
                try:
                    await asyncio.wait_for(ev.wait(), 0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        break
                ev.clear()
            if st.done:
                yield "data: [DONE]\n\n"
                complete = True
        except RequestError as e:
            yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind}})}\n\n"
        finally:
            if not complete and not st.done:
                fe.engine.abort(st.seqs)  # the client left (or the deadline passed): free the slots
                fe.counters["disconnects"] += 1

    @app.post("/v1/completions", openapi_extra=COMPLETIONS_SCHEMA)
    async def completions(request: Request):
        body = await read_body(request)
        alive()
        ids, params, n = fe.completions_request(body)
        seqs = fe.submit(ids, params, n)
        try:
            await finish(request, seqs)
        except _ClientGone:
            return JSONResponse({}, status_code=499)
        return fe.completions_response(body, ids, seqs)

    @app.post("/admin/threads", openapi_extra=_BODY_SCHEMA)
    async def admin_threads(request: Request):
        body = await read_body(request)
        return fe.admin_threads(body, request.headers.get("authorization"))

    @app.post("/admin/weights", openapi_extra=_BODY_SCHEMA)
    async def admin_weights(request: Request):
        body = await read_body(request)
        # Reading tensors and waiting for the swap block: off the event loop.
        return await run_in_threadpool(fe.admin_weights, body, request.headers.get("authorization"))

    return app


class Server:
    """The served model: the engine's loop plus uvicorn in a background thread (`with Server(...)`
    in tests and scripts; `serve_forever()` for the CLI)."""

    def __init__(self, engine: Engine, tokenizer, name: str, config: ServeConfig | None = None):
        self.frontend = Frontend(engine, tokenizer, name, config)
        self.engine, self.tokenizer, self.name, self.config = engine, tokenizer, name, self.frontend.config
        self.app = build_app(self.frontend)
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    @property
    def counters(self) -> dict:
        return self.frontend.counters

    def start(self, timeout_s: float = 30.0) -> "Server":
        import uvicorn

        cfg = uvicorn.Config(self.app, host=self.config.host, port=self.config.port, log_level="warning",
                             access_log=False, limit_concurrency=self.config.max_connections,
                             timeout_keep_alive=5, lifespan="off",
                             timeout_graceful_shutdown=self.config.shutdown_timeout_s)
        self._uvicorn = uvicorn.Server(cfg)
        self._uvicorn.install_signal_handlers = lambda: None  # not the main thread; the CLI handles signals
        if self.config.weights and self.frontend.follower is None:
            from opencomposer.inference.weight_store import WeightFollower

            self.frontend.follower = WeightFollower(self.config.weights, self.engine)
        self.engine.start()
        if self.frontend.follower is not None:  # on the store's newest weights before the first request
            self.frontend.follower.start()
        self._thread = threading.Thread(target=self._uvicorn.run, name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.engine.stop()
                raise OSError(f"the HTTP server did not start on {self.config.host}:{self.config.port} "
                              "(is the port in use?)")
            time.sleep(0.01)
        if self.config.ready_file is not None:
            import os

            from opencomposer.core.rundir import write_atomic

            write_atomic(Path(self.config.ready_file), json.dumps({"url": self.url, "pid": os.getpid()}) + "\n")
        return self

    @property
    def address(self) -> tuple[str, int]:
        sock = self._uvicorn.servers[0].sockets[0]
        return sock.getsockname()[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}/v1"

    def serve_forever(self) -> None:
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self) -> None:
        if self.frontend.follower is not None:
            self.frontend.follower.stop()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(15)
        self.engine.stop()
        self.frontend.close()  # the app's endpoints outlive it in FastAPI's caches (Frontend.close)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def exit_after(seconds: float, what: str) -> threading.Thread:
    """Arm a hard exit: unless the process has ended `seconds` from now, say so on stderr and end
    it with `os._exit(1)`. For a stop that must not hang (a replica whose driver died): a request
    stuck in the engine, a thread that never returns, or the interpreter joining a non-daemon
    thread at exit would otherwise keep it alive. The watcher is a daemon thread, so it keeps
    running while the interpreter waits on the others."""
    import os
    import sys

    def watch() -> None:
        time.sleep(seconds)
        print(f"error: {what} did not finish within {seconds:.0f} s; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    t = threading.Thread(target=watch, name="exit-after", daemon=True)
    t.start()
    return t


def load_served(folder: Path, *, slots: int = 32, max_len: int | None = None, speculative: bool = False,
                max_waiting: int = 256, **engine_options) -> tuple[Engine, Any]:
    """A model folder -> (engine, tokenizer). The folder must carry its tokenizer.json;
    `engine_options` are further EngineConfig fields (prefix_cache_mb, prefill_chunk, ...)."""
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
        engine = Engine(model, config=EngineConfig(slots=slots, max_len=max_len, speculative=speculative,
                                                   max_waiting=max_waiting, **engine_options),
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
    engine, tok = load_served(Path(folder), slots=cfg.slots, max_len=cfg.max_len, speculative=cfg.speculative,
                              max_waiting=cfg.max_waiting, prefix_cache_mb=cfg.prefix_cache_mb,
                              keep_stale_prefix=cfg.keep_stale_prefix, prefill_chunk=cfg.prefill_chunk)
    return Server(engine, tok, cfg.name or Path(folder).name, cfg)
