"""The in-sandbox tool server, and the process runner it shares with the host.

This file is run *inside* a sandbox as a script (`python -S -I toolserver.py INIT_JSON`), so it
imports nothing but the standard library and nothing from `opencomposer`. The host imports the
same file for `run_process` and the protocol constants, so output capping, truncation markers,
timeouts and kill semantics are one implementation wherever a command runs. Composer 2 keeps "a
shared tool library invoked over RPC" in every environment (report §5); this is ours, and the
harness's tools are built on its methods. The protocol is documented in docs/sandbox.md.

Protocol (version 1): newline-delimited JSON over stdin/stdout.
  request   {"id": 7, "method": "read_file", "params": {...}}
  response  {"id": 7, "result": {...}}  or  {"id": 7, "error": {"type": "PathError", "message": "..."}}
The first line the server writes is {"id": 0, "result": {"ready": true, "protocol": 1, ...}}.
Bytes travel as base64 ("*_b64" fields). File names that are not UTF-8 travel as strings with
surrogate escapes (JSON "\\udcXX"), which `os.fsencode` turns back into the original bytes.
Requests run concurrently (one thread each); responses may come back in any order.
"""

from __future__ import annotations

import base64
import json
import os
import resource
import selectors
import signal
import stat
import subprocess
import sys
import threading
import time

PROTOCOL_VERSION = 1
TRUNCATION_MARKER = "\n[... {omitted} bytes truncated ...]\n"
#: After the main process exits, how long to wait for processes it left holding its output pipes.
DRAIN_GRACE_S = 0.5
#: Output beyond max(this many times the cap, RUNAWAY_OUTPUT_MIN) is not worth reading: the
#: command is killed with killed_by="output_limit".
RUNAWAY_OUTPUT_FACTOR = 64
RUNAWAY_OUTPUT_MIN = 64 << 20

RLIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "address_space_bytes": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "file_size_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
    "core_bytes": resource.RLIMIT_CORE,
}

_SIGNAL_REASONS = {signal.SIGXCPU: "cpu_time", signal.SIGXFSZ: "file_size"}


# ----------------------------------------------------------------------------------------------
# Process running: shared by the server (inside) and the one-shot exec path (host side)


class CappedBuffer:
    """Keeps the first and last `limit // 2` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        self.limit = max(0, limit)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        half = self.limit // 2
        room = half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            keep = self.limit - half
            if len(self.tail) > 2 * keep + 65536:  # trim rarely, not on every chunk
                del self.tail[: len(self.tail) - keep]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        keep = self.limit - self.limit // 2
        tail = bytes(self.tail[-keep:]) if keep else b""
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        omitted = self.total - len(self.head) - len(tail)
        return (
            bytes(self.head).decode("utf-8", "replace")
            + TRUNCATION_MARKER.format(omitted=omitted)
            + tail.decode("utf-8", "replace")
        )


def exit_reason(returncode: int) -> tuple[int, str | None]:
    """(shell-style exit code, reason) from a Popen returncode (negative = killed by a signal)."""
    if returncode < 0:
        sig = -returncode
        return 128 + sig, _SIGNAL_REASONS.get(sig, f"signal:{_signame(sig)}")
    if returncode > 128 and (returncode - 128) in (signal.SIGKILL, signal.SIGXCPU, signal.SIGXFSZ, signal.SIGSEGV):
        sig = returncode - 128
        return returncode, _SIGNAL_REASONS.get(sig, f"signal:{_signame(sig)}")
    return returncode, None


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def run_process(
    argv: list[str],
    *,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout_s: float = 60.0,
    output_limit: int = 1 << 20,
    kill=None,
    popen_kwargs: dict | None = None,
    on_spawn=None,
) -> dict:
    """Run argv, capping output and enforcing a wall-clock deadline. Never raises for the command's
    own failures: a missing program, a timeout or a runaway output are all in the result.

    `kill(proc)` ends the whole process tree; it defaults to SIGKILL of the process group.
    """
    kill = kill or _kill_group
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            **(popen_kwargs or {}),
        )
    except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
        return _result(127, "", f"{e}\n", False, False, time.monotonic() - start, "spawn_failed")
    if on_spawn is not None:
        on_spawn(proc)
    out, err = CappedBuffer(output_limit), CappedBuffer(output_limit)
    bufs = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    deadline = start + timeout_s
    runaway = max(output_limit * RUNAWAY_OUTPUT_FACTOR, RUNAWAY_OUTPUT_MIN)
    killed_by = None
    exited_at = killed_at = None
    open_reads = len(bufs)
    try:
        while open_reads:
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_GRACE_S:
                kill(proc)  # leftovers of a finished command still hold its pipes
                break
            if killed_by is None and now > deadline:
                killed_by = "timeout"
            if killed_by is None and out.total + err.total > runaway:
                killed_by = "output_limit"
            if killed_by is not None and killed_at is None:
                kill(proc)
                killed_at = now
            if killed_at is not None and now - killed_at > 2.0:
                break  # something that escaped the kill holds the pipe; stop reading
            wait = 0.05 if exited_at is not None or killed_at is not None else min(0.25, max(0.0, deadline - now))
            for key, _ in sel.select(wait):
                fd = key.fd
                if fd in bufs:
                    try:
                        chunk = os.read(fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if chunk:
                        bufs[fd].add(chunk)
                    else:
                        sel.unregister(fd)
                        open_reads -= 1
                else:  # stdin writable
                    try:
                        n = os.write(fd, pending[:65536])
                        pending = pending[n:]
                    except (BrokenPipeError, BlockingIOError) as e:
                        if isinstance(e, BrokenPipeError):
                            pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()) if killed_by is None else 2.0)
        except subprocess.TimeoutExpired:
            killed_by = killed_by or "timeout"
            kill(proc)
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
    finally:
        sel.close()
        for f in (proc.stdout, proc.stderr, proc.stdin):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
    code, reason = exit_reason(proc.returncode if proc.returncode is not None else -signal.SIGKILL)
    return _result(code, out.text(), err.text(), out.truncated, err.truncated, time.monotonic() - start,
                   killed_by or reason, out.total, err.total)


def _result(code, stdout, stderr, out_trunc, err_trunc, duration, killed_by, out_total=None, err_total=None) -> dict:
    return {
        "exit_code": code,
        "stdout": stdout,
        "stderr": stderr,
        "stdout_truncated": out_trunc,
        "stderr_truncated": err_trunc,
        "stdout_bytes": len(stdout) if out_total is None else out_total,
        "stderr_bytes": len(stderr) if err_total is None else err_total,
        "duration_s": duration,
        "killed_by": killed_by,
    }


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def apply_rlimits(limits: dict, pid: int = 0) -> None:
    """Lower rlimits (soft = hard). Raising is impossible without CAP_SYS_RESOURCE, so each value
    is clamped to the current hard limit."""
    for name, value in limits.items():
        if value is None:
            continue
        which = RLIMITS[name]
        _, hard = resource.prlimit(pid, which)
        value = int(value)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.prlimit(pid, which, (value, value))


# ----------------------------------------------------------------------------------------------
# The server (inside the sandbox)


class ToolError(Exception):
    """An error reported to the client as {"type": ..., "message": ...}."""

    type = "ToolError"


class PathError(ToolError):
    type = "PathError"


class NotFound(ToolError):
    type = "NotFound"


class InvalidArgument(ToolError):
    type = "InvalidArgument"


class Server:
    SHELL_STATE_SKIP = {"OC_STATE_FILE", "OC_COMMAND", "OC_START_DIR", "SHLVL", "_", "PWD", "OLDPWD"}

    def __init__(self, init: dict):
        self.root = os.path.realpath(init["root"])
        self.base_env = dict(init.get("env") or {})
        self.child_rlimits = {k: v for k, v in (init.get("rlimits") or {}).items() if k == "cpu_s"}
        self.output_limit = int(init.get("output_limit", 1 << 20))
        self.max_read = int(init.get("max_read_bytes", 64 << 20))
        self.shells: dict[str, dict] = {}
        self.jobs: dict[str, dict] = {}
        self.children: set[int] = set()  # pids of exec'd commands still being waited for
        self._lock = threading.Lock()
        self._out_lock = threading.Lock()
        self._seq = 0

    # -- paths ---------------------------------------------------------------------------------
    def resolve(self, path, *, must_exist: bool = True) -> str:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidArgument(f"path must be a non-empty string without NUL bytes, got {path!r}")
        joined = os.path.normpath(path if os.path.isabs(path) else os.path.join(self.root, path))
        real = os.path.realpath(joined)
        for candidate, what in ((joined, "path"), (real, "path (after resolving symlinks)")):
            if candidate != self.root and not candidate.startswith(self.root + os.sep):
                raise PathError(f"{what} {path!r} is outside the workspace {self.root}")
        if must_exist and not os.path.lexists(real):
            raise NotFound(f"no such file or directory: {path!r}")
        return real

    # -- methods -------------------------------------------------------------------------------
    def m_ping(self, p):
        return {"pong": True, "pid": os.getpid()}

    def m_exec(self, p):
        argv = p.get("argv")
        cmd = p.get("cmd")
        if (argv is None) == (cmd is None):
            raise InvalidArgument("exec needs exactly one of 'argv' (list) or 'cmd' (shell string)")
        if argv is not None and (not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)):
            raise InvalidArgument("argv must be a non-empty list of strings")
        timeout_s = float(p.get("timeout_s", 60.0))
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be positive, got {timeout_s}")
        env = dict(self.base_env)
        session = p.get("session")
        state_file = None
        if session is not None:
            shell = self.shells.setdefault(session, {"cwd": self.root, "env": {}})
            env.update(shell["env"])
        env.update(p.get("env") or {})
        cwd = self.resolve(p["cwd"]) if p.get("cwd") else None
        if session is not None:
            if cmd is None:
                raise InvalidArgument("a shell session runs 'cmd' strings, not argv")
            with self._lock:
                self._seq += 1
                state_file = f"/tmp/.oc-shell-{os.getpid()}-{self._seq}"
            env.update(OC_STATE_FILE=state_file, OC_COMMAND=cmd, OC_START_DIR=cwd or shell["cwd"])
            argv = ["/bin/bash", "-c", _SHELL_WRAPPER]
            cwd = None
        elif cmd is not None:
            argv = ["/bin/bash", "-c", cmd] if os.path.exists("/bin/bash") else ["/bin/sh", "-c", cmd]
        marker = f"{os.getpid()}-{id(p)}-{time.monotonic_ns()}"
        env["OC_EXEC_ID"] = marker
        stdin = base64.b64decode(p["stdin_b64"]) if p.get("stdin_b64") else None
        spawned: list[int] = []

        def track(proc):
            spawned.append(proc.pid)
            self.children.add(proc.pid)

        try:
            result = run_process(
                argv,
                stdin=stdin,
                env=env,
                cwd=cwd or self.root,
                timeout_s=timeout_s,
                output_limit=int(p.get("output_limit", self.output_limit)),
                kill=lambda proc: self.kill_tree(proc.pid, marker),
                popen_kwargs={"preexec_fn": self._child_limits} if self.child_rlimits else None,
                on_spawn=track,
            )
        finally:
            self.children.difference_update(spawned)
        if state_file is not None:
            self._update_shell(session, state_file)
            result["cwd"] = self.shells[session]["cwd"]
        return result

    def _child_limits(self) -> None:
        apply_rlimits(self.child_rlimits)

    def _update_shell(self, session: str, state_file: str) -> None:
        try:
            with open(state_file, "rb") as f:
                parts = f.read().split(b"\0")
            os.unlink(state_file)
        except OSError:
            return  # the command replaced the shell (exec) or was killed: state unchanged
        if not parts or not parts[0]:
            return
        shell = self.shells[session]
        shell["cwd"] = os.fsdecode(parts[0])
        env = {}
        for item in parts[1:]:
            if b"=" in item:
                k, v = item.split(b"=", 1)
                k, v = os.fsdecode(k), os.fsdecode(v)
                if k not in self.SHELL_STATE_SKIP and k != "OC_EXEC_ID" and self.base_env.get(k) != v:
                    env[k] = v
        shell["env"] = env

    def kill_tree(self, pid: int, marker: str | None) -> None:
        """SIGKILL the process group, then every process that still carries the exec's marker in
        its environment (children that moved to their own session or process group)."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not marker:
            return
        needle = f"OC_EXEC_ID={marker}".encode()
        for _ in range(3):
            found = False
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) == os.getpid():
                    continue
                try:
                    with open(f"/proc/{name}/environ", "rb") as f:
                        if needle in f.read().split(b"\0"):
                            os.kill(int(name), signal.SIGKILL)
                            found = True
                except OSError:
                    continue
            if not found:
                break

    def m_read_file(self, p):
        path = self.resolve(p.get("path"))
        if os.path.isdir(path):
            raise InvalidArgument(f"{p['path']!r} is a directory")
        offset = int(p.get("offset", 0))
        length = p.get("length")
        length = self.max_read if length is None else min(int(length), self.max_read)
        if offset < 0 or length < 0:
            raise InvalidArgument("offset and length must be non-negative")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(offset)
            data = f.read(length)
        return {"data_b64": base64.b64encode(data).decode(), "size": size,
                "truncated": offset + len(data) < size}

    def m_write_file(self, p):
        path = self.resolve(p.get("path"), must_exist=False)
        data = base64.b64decode(p.get("data_b64", ""))
        if os.path.isdir(path):
            raise InvalidArgument(f"{p['path']!r} is a directory")
        if p.get("make_parents", True):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if p.get("append") else os.O_TRUNC)
        mode = p.get("mode")
        fd = os.open(path, flags, 0o644 if mode is None else int(mode))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        if mode is not None:
            os.chmod(path, int(mode))
        return {"bytes": len(data)}

    def m_list_dir(self, p):
        path = self.resolve(p.get("path") or ".")
        if not os.path.isdir(path):
            raise InvalidArgument(f"{p.get('path')!r} is not a directory")
        entries = []
        with os.scandir(path) as it:
            for e in it:
                try:
                    s = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                kind = "dir" if stat.S_ISDIR(s.st_mode) else "symlink" if stat.S_ISLNK(s.st_mode) else \
                    "file" if stat.S_ISREG(s.st_mode) else "other"
                entries.append({"name": e.name, "type": kind, "size": s.st_size, "mode": stat.S_IMODE(s.st_mode)})
        entries.sort(key=lambda x: x["name"])
        return {"entries": entries}

    def m_stat(self, p):
        path = self.resolve(p.get("path"))
        s = os.lstat(path)
        kind = "dir" if stat.S_ISDIR(s.st_mode) else "symlink" if stat.S_ISLNK(s.st_mode) else \
            "file" if stat.S_ISREG(s.st_mode) else "other"
        return {"type": kind, "size": s.st_size, "mode": stat.S_IMODE(s.st_mode), "mtime": s.st_mtime}

    def m_delete(self, p):
        path = self.resolve(p.get("path"))
        if path == self.root:
            raise PathError("refusing to delete the workspace root")
        if os.path.isdir(path) and not os.path.islink(path):
            if not p.get("recursive"):
                raise InvalidArgument(f"{p['path']!r} is a directory (pass recursive=true)")
            import shutil

            shutil.rmtree(path)
        else:
            os.unlink(path)
        return {}

    def m_bg_start(self, p):
        cmd = p.get("cmd")
        if not isinstance(cmd, str) or not cmd:
            raise InvalidArgument("bg_start needs a non-empty 'cmd' string")
        with self._lock:
            self._seq += 1
            job = f"job{self._seq}"
        log = f"/tmp/.oc-{job}.log"
        env = dict(self.base_env)
        env.update(p.get("env") or {})
        env["OC_EXEC_ID"] = f"{os.getpid()}-{job}"
        cwd = self.resolve(p["cwd"]) if p.get("cwd") else self.root
        with open(log, "wb") as out:
            proc = subprocess.Popen(["/bin/bash", "-c", cmd], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True,
                                    preexec_fn=self._child_limits if self.child_rlimits else None)
        self.jobs[job] = {"proc": proc, "log": log, "marker": env["OC_EXEC_ID"], "started": time.time()}
        return {"job": job, "pid": proc.pid}

    def _job(self, p):
        job = self.jobs.get(p.get("job"))
        if job is None:
            raise NotFound(f"no background job {p.get('job')!r}")
        return job

    def m_bg_poll(self, p):
        job = self._job(p)
        code = job["proc"].poll()
        tail = int(p.get("tail_bytes", 64 << 10))
        with open(job["log"], "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - tail))
            data = f.read()
        return {"running": code is None, "exit_code": None if code is None else exit_reason(code)[0],
                "output": data.decode("utf-8", "replace"), "output_bytes": size}

    def m_bg_kill(self, p):
        job = self._job(p)
        self.kill_tree(job["proc"].pid, job["marker"])
        try:
            job["proc"].wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return {"exit_code": exit_reason(job["proc"].returncode)[0] if job["proc"].returncode is not None else None}

    # -- loop ----------------------------------------------------------------------------------
    def reply(self, msg: dict) -> None:
        line = json.dumps(msg).encode() + b"\n"
        with self._out_lock:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    def handle(self, req_id, method: str, params: dict) -> None:
        fn = getattr(self, f"m_{method}", None) if isinstance(method, str) else None
        try:
            if fn is None:
                raise InvalidArgument(f"unknown method {method!r}")
            if not isinstance(params, dict):
                raise InvalidArgument("params must be an object")
            result = fn(params)
            self.reply({"id": req_id, "result": result})
        except ToolError as e:
            self.reply({"id": req_id, "error": {"type": e.type, "message": str(e)}})
        except (OSError, ValueError, KeyError, TypeError) as e:
            kind = "NotFound" if isinstance(e, FileNotFoundError) else type(e).__name__
            self.reply({"id": req_id, "error": {"type": kind, "message": str(e)}})
        except Exception as e:  # noqa: BLE001 - the server must answer, whatever happened
            self.reply({"id": req_id, "error": {"type": "InternalError", "message": f"{type(e).__name__}: {e}"}})

    def reap_orphans(self) -> None:
        """As the sandbox's pid 1 the server inherits orphans (daemons, double forks); reap their
        zombies. Only pids that are not our own Popen children: those are waited for by their owners."""
        while True:
            time.sleep(0.5)
            mine = {job["proc"].pid for job in list(self.jobs.values())} | set(self.children)
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in mine:
                    continue
                try:
                    with open(f"/proc/{name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if fields[0] == "Z" and int(fields[1]) == os.getpid():
                    try:
                        os.waitpid(int(name), os.WNOHANG)
                    except ChildProcessError:
                        pass

    def serve(self) -> None:
        if os.getpid() == 1:
            threading.Thread(target=self.reap_orphans, daemon=True).start()
        self.reply({"id": 0, "result": {"ready": True, "protocol": PROTOCOL_VERSION, "pid": os.getpid(),
                                         "root": self.root}})
        stdin = sys.stdin.buffer
        while True:
            line = stdin.readline()
            if not line:
                break
            try:
                req = json.loads(line)
                req_id, method, params = req["id"], req["method"], req.get("params", {})
            except (ValueError, KeyError, TypeError) as e:
                self.reply({"id": None, "error": {"type": "InvalidRequest", "message": f"bad request line: {e}"}})
                continue
            if method == "shutdown":
                self.reply({"id": req_id, "result": {}})
                break
            threading.Thread(target=self.handle, args=(req_id, method, params), daemon=True).start()
        for job in self.jobs.values():
            self.kill_tree(job["proc"].pid, job["marker"])


_SHELL_WRAPPER = r"""
__oc_dump() { __oc_rc=$?; { printf '%s\0' "$PWD"; env -0; } > "$OC_STATE_FILE" 2>/dev/null; return $__oc_rc; }
trap __oc_dump EXIT
cd -- "$OC_START_DIR" 2>/dev/null || true
eval "$OC_COMMAND"
"""


def main() -> None:
    init = json.loads(sys.argv[1])
    apply_rlimits({k: v for k, v in (init.get("rlimits") or {}).items() if k != "cpu_s"})
    os.chdir(init["root"])
    Server(init).serve()


if __name__ == "__main__":
    main()
