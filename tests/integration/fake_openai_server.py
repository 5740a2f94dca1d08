"""FakeOpenAIServer: a real HTTP server (stdlib) that speaks enough of the OpenAI chat API to test
the harness's client end to end — it is a fake model, not a fake client: requests go over TCP
through the official `openai` package. Replies come from a script; every request is recorded."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAIServer:
    def __init__(self, turns: list[dict], *, model: str = "fake-model", max_model_len: int | None = None):
        self.turns = list(turns)
        self.model = model
        self.max_model_len = max_model_len
        """Listed in GET /models as vLLM and our server do, when set."""
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/").endswith("/models"):
                    entry = {"id": owner.model, "object": "model", "created": 0, "owned_by": "test"}
                    if owner.max_model_len:
                        entry["max_model_len"] = owner.max_model_len
                    self._send(200, {"object": "list", "data": [entry]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with owner._lock:
                    owner.requests.append(body)
                    turn = owner.turns.pop(0) if owner.turns else {"content": "done"}
                if turn.get("delay_s"):  # a slow model: the test interrupts the client meanwhile
                    time.sleep(turn["delay_s"])
                if turn.get("http_error"):
                    self._send(turn["http_error"], {"error": {"message": "scripted failure", "type": "server_error"}})
                    return
                calls = [{"id": f"call_{i}", "type": "function",
                          "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                                       else json.dumps(c["arguments"])}}
                         for i, c in enumerate(turn.get("tool_calls", []))]
                n = turn.get("completion_tokens", 5)
                choice = {"index": 0, "finish_reason": "tool_calls" if calls else "stop",
                          "message": {"role": "assistant", "content": turn.get("content"),
                                      **({"tool_calls": calls} if calls else {})},
                          "logprobs": {"content": [{"token": f"t{i}", "logprob": -0.5, "bytes": None,
                                                    "top_logprobs": []} for i in range(n)]},
                          "opencomposer": {"token_ids": list(range(100, 100 + n)), "policy_versions": [3] * n}}
                prompt_tokens = turn.get("prompt_tokens", sum(len(json.dumps(m)) for m in body["messages"]) // 4)
                self._send(200, {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0,
                                 "model": owner.model, "choices": [choice],
                                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                           "total_tokens": prompt_tokens + n}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> "FakeOpenAIServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
