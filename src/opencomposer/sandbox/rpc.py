"""Host side of the tool-server protocol (sandbox/toolserver.py has the server and the spec).

One reader thread per connection routes responses to waiting callers by request id, so calls from
many threads (parallel tool calls) share one pipe. Every call has a deadline; when the server dies,
every pending and future call fails with `SandboxDied` carrying the tail of the server's stderr.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections import deque
from typing import Any

from opencomposer.sandbox.base import SandboxDied, SandboxError, ToolCallError


class RpcTimeout(SandboxError):
    pass


class _Pending:
    __slots__ = ("event", "response")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.response: dict | None = None


class RpcClient:
    def __init__(self, proc: subprocess.Popen, *, ready_timeout_s: float, name: str = "sandbox"):
        self.proc = proc
        self.name = name
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        hello = _Pending()  # held here: the reader may answer (and drop) it before __init__ looks again
        self._pending: dict[int, _Pending] = {0: hello}
        self._next = 1
        self._dead: str | None = None
        self._stderr_tail: deque[str] = deque(maxlen=40)
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name=f"rpc-{name}")
        self._reader.start()
        self._err_reader = threading.Thread(target=self._stderr_loop, daemon=True, name=f"rpc-err-{name}")
        self._err_reader.start()
        self.hello = self._wait(0, hello, ready_timeout_s, "start")

    def _read_loop(self) -> None:
        stdout = self.proc.stdout
        try:
            for line in stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    self._stderr_tail.append(f"(bad line from server: {line[:200]!r})")
                    continue
                with self._lock:
                    waiter = self._pending.pop(msg.get("id"), None) if isinstance(msg.get("id"), int) else None
                if waiter is not None:
                    waiter.response = msg
                    waiter.event.set()
        except (OSError, ValueError):
            pass
        self._fail_all("the sandbox's tool server exited")

    def _stderr_loop(self) -> None:
        try:
            for line in self.proc.stderr:
                self._stderr_tail.append(line.decode("utf-8", "replace").rstrip())
        except (OSError, ValueError):
            pass

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._dead = self._dead or why
            pending, self._pending = self._pending, {}
        for w in pending.values():
            w.event.set()

    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    def _died(self) -> SandboxDied:
        self._err_reader.join(timeout=0.5)
        tail = "\n".join(self._stderr_tail)
        code = self.proc.poll()
        return SandboxDied(f"{self.name}: {self._dead or 'tool server gone'} (exit {code})" + (f"\n{tail}" if tail else ""))

    def call(self, method: str, params: dict[str, Any] | None = None, *, timeout_s: float = 60.0) -> dict:
        with self._lock:
            if self._dead is not None:
                raise self._died()
            req_id = self._next
            self._next += 1
            waiter = self._pending[req_id] = _Pending()
        line = json.dumps({"id": req_id, "method": method, "params": params or {}}).encode() + b"\n"
        try:
            with self._write_lock:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._fail_all("the sandbox's tool server is not reading")
            raise self._died() from None
        return self._wait(req_id, waiter, timeout_s, method)

    def _wait(self, req_id: int, waiter: _Pending, timeout_s: float, method: str) -> dict:
        if not waiter.event.wait(timeout_s):
            with self._lock:
                self._pending.pop(req_id, None)
            raise RpcTimeout(f"{self.name}: no answer to {method!r} within {timeout_s:.1f}s")
        msg = waiter.response
        if msg is None:
            raise self._died()
        if "error" in msg:
            err = msg["error"] or {}
            raise ToolCallError(str(err.get("type", "Error")), str(err.get("message", "")))
        return msg.get("result") or {}

    def close(self, timeout_s: float = 2.0) -> None:
        """Ask the server to stop; it kills its background jobs and exits (and the sandbox with it)."""
        if self.alive:
            try:
                self.call("shutdown", timeout_s=timeout_s)
            except SandboxError:
                pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
        self._fail_all("closed")
