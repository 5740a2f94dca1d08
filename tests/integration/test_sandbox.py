"""The Sandbox API against real sandboxes: exec, files, sessions, background jobs, snapshot, fork,
restore, both layer strategies, and bad input."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from opencomposer.sandbox.base import (
    Sandbox,
    SandboxConfig,
    SandboxError,
    ToolCallError,
    WorkspaceError,
)
from opencomposer.sandbox.local import Workspace


def test_protocol_and_exec_basics(sandbox, repo):
    assert isinstance(sandbox, Sandbox)
    r = sandbox.exec("python -m pytest -q -p no:cacheprovider test_calc.py")
    assert r.ok, r.stdout + r.stderr
    assert "1 passed" in r.stdout
    r = sandbox.exec(["python", "-c", "import os,sys; print(os.getcwd(), sys.stdin.read())"], stdin="in")
    assert r.stdout.strip() == "/workspace in"
    r = sandbox.exec("echo $FOO; pwd", env={"FOO": "bar"}, cwd="pkg")
    assert r.stdout.split() == ["bar", "/workspace/pkg"]
    assert sandbox.exec("exit 7").exit_code == 7


def test_writes_stay_in_the_sandbox(sandbox, repo):
    sandbox.exec("echo changed > README.md && rm pkg/calc.py && touch new.txt")
    assert (repo / "README.md").read_text() == "calc\n"
    assert (repo / "pkg" / "calc.py").exists() and not (repo / "new.txt").exists()
    assert sandbox.read_file("README.md") == b"changed\n"
    names = {e.name for e in sandbox.list_dir(".")}
    assert "new.txt" in names and ".git" in names


def test_files_api(sandbox):
    sandbox.write_file("a/b/c.bin", bytes(range(256)))
    assert sandbox.read_file("a/b/c.bin") == bytes(range(256))
    assert sandbox.read_file("a/b/c.bin", offset=250) == bytes(range(250, 256))
    info = {e.name: e for e in sandbox.list_dir("a/b")}
    assert info["c.bin"].type == "file" and info["c.bin"].size == 256
    sandbox.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sandbox.exec("./run.sh").stdout == "ran\n"
    sandbox.delete("a", recursive=True)
    with pytest.raises(ToolCallError) as e:
        sandbox.read_file("a/b/c.bin")
    assert e.value.type == "NotFound"


def test_one_shot_and_server_exec_agree(sandbox):
    assert not sandbox.server_running
    one = sandbox.exec("echo $HOME; id -u; ulimit -n")
    sandbox.start_server()
    assert sandbox.server_running
    two = sandbox.exec("echo $HOME; id -u; ulimit -n")
    assert one.stdout == two.stdout == "/tmp\n1000\n1024\n"


def test_persistent_shell_session(sandbox):
    sandbox.exec("cd pkg && export GREETING=hi && MYVAR=local", session="main")
    r = sandbox.exec("pwd; echo $GREETING", session="main")
    assert r.stdout.split() == ["/workspace/pkg", "hi"] and r.cwd == "/workspace/pkg"
    other = sandbox.exec("pwd; echo ${GREETING:-unset}", session="other")
    assert other.stdout.split() == ["/workspace", "unset"]


def test_background_jobs(sandbox):
    job = sandbox.call("bg_start", cmd="for i in 1 2 3; do echo tick $i; sleep 0.1; done")["job"]
    for _ in range(100):
        st = sandbox.call("bg_poll", job=job)
        if not st["running"]:
            break
        time.sleep(0.05)
    assert st["exit_code"] == 0 and st["output"].split().count("tick") == 3
    long = sandbox.call("bg_start", cmd="sleep 100")["job"]
    assert sandbox.call("bg_poll", job=long)["running"]
    sandbox.call("bg_kill", job=long)
    assert not sandbox.call("bg_poll", job=long)["running"]


def test_timeout_and_output_cap(workspace):
    cfg = SandboxConfig(output_limit_bytes=2000)
    with Workspace(workspace.source, cfg) as ws, ws.sandbox() as sb:
        t = time.monotonic()
        r = sb.exec("sleep 30", timeout_s=0.5)
        assert r.killed_by == "timeout" and time.monotonic() - t < 10
        r = sb.exec("head -c 100000 /dev/zero | tr '\\0' 'a'")
        assert r.stdout_truncated and "bytes truncated" in r.stdout and len(r.stdout) < 2100
        sb.start_server()
        r = sb.exec("sleep 30", timeout_s=0.5)
        assert r.killed_by == "timeout"


def test_snapshot_fork_and_restore(sandbox):
    sandbox.exec("echo v1 > state.txt")
    snap = sandbox.snapshot()
    sandbox.exec("echo v2 > state.txt && rm README.md")
    kids = sandbox.fork(3)
    try:
        for i, k in enumerate(kids):
            assert k.read_file("state.txt") == b"v2\n"
            k.exec(f"echo kid{i} > state.txt")
        assert [k.read_file("state.txt") for k in kids] == [b"kid0\n", b"kid1\n", b"kid2\n"]
        assert sandbox.read_file("state.txt") == b"v2\n"
        assert sandbox.exec("test -e README.md").exit_code == 1  # the deletion (a whiteout) carried over
        assert kids[0].exec("test -e README.md").exit_code == 1
    finally:
        for k in kids:
            k.close()
    # The same snapshot restores any number of times.
    for _ in range(2):
        with sandbox.workspace.sandbox(snap) as again:
            assert again.read_file("state.txt") == b"v1\n"
            assert again.exec("test -e README.md").exit_code == 0
    sandbox.restore(snap)
    assert sandbox.read_file("state.txt") == b"v1\n"


def test_snapshot_while_processes_run(sandbox):
    job = sandbox.call("bg_start", cmd="sleep 30")["job"]
    sandbox.write_file("x", "1")
    snap = sandbox.snapshot()
    assert sandbox.call("bg_poll", job=job)["running"]  # the sandbox kept running
    with sandbox.workspace.sandbox(snap) as child:
        assert child.read_file("x") == b"1"


def test_copy_fallback_has_the_same_semantics(repo):
    with Workspace(repo, SandboxConfig(layers="copy")) as ws, ws.sandbox() as sb:
        assert ws.mode == "copy"
        sb.exec("echo a > f && rm README.md")
        (kid,) = sb.fork(1)
        with kid:
            kid.exec("echo b > f")
            assert kid.read_file("f") == b"b\n" and sb.read_file("f") == b"a\n"
            assert kid.exec("test -e README.md").exit_code == 1
        assert (repo / "README.md").exists()


def test_fork_of_fork_of_fork(sandbox):
    cur = sandbox
    opened = []
    for depth in range(5):
        cur.exec(f"echo {depth} >> chain")
        (cur,) = cur.fork(1)
        opened.append(cur)
    assert cur.read_file("chain") == b"0\n1\n2\n3\n4\n"
    for s in opened:
        s.close()


def test_bad_input(tmp_path, sandbox):
    with pytest.raises(WorkspaceError, match="not found"):
        Workspace(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(WorkspaceError, match="not a directory"):
        Workspace(tmp_path / "file")
    r = sandbox.exec("definitely-not-a-command")
    assert r.exit_code == 127 and "not found" in r.stderr
    with pytest.raises(ValueError):
        sandbox.exec("")
    with pytest.raises(ValueError):
        sandbox.exec("true", timeout_s=0)
    with pytest.raises(ToolCallError) as e:
        sandbox.read_file("pkg")
    assert e.value.type == "InvalidArgument"
    with pytest.raises(ToolCallError):
        sandbox.call("no_such_method")

    with pytest.raises(ToolCallError, match="NotFound"):
        sandbox.exec("true", cwd="no/such/dir")  # tool server running (read_file above started it)
    with Workspace(sandbox.workspace.source) as ws, ws.sandbox() as fresh:
        with pytest.raises(ToolCallError, match="NotFound"):
            fresh.exec("true", cwd="no/such/dir")  # one-shot path


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "pkg/../../x", "/workspace/../etc/hosts"])
def test_paths_outside_the_workspace_are_refused(sandbox, path):
    with pytest.raises(ToolCallError) as e:
        sandbox.read_file(path)
    assert e.value.type == "PathError"
    with pytest.raises(ToolCallError):
        sandbox.write_file(path, "x")


def test_symlinks_out_of_the_workspace_are_refused(sandbox):
    sandbox.exec("ln -s /etc/passwd link && ln -s /tmp tmplink && ln -s pkg/calc.py inside")
    for p in ("link", "tmplink/evil"):
        with pytest.raises(ToolCallError) as e:
            sandbox.write_file(p, "x") if p.startswith("tmp") else sandbox.read_file(p)
        assert e.value.type == "PathError"
    assert b"def add" in sandbox.read_file("inside")


def test_non_utf8_file_names(sandbox):
    sandbox.exec(["python", "-c", "open(b'caf\\xe9.txt', 'wb').write(b'latin')"])
    names = [e.name for e in sandbox.list_dir(".")]
    odd = [n for n in names if n.startswith("caf")]
    assert len(odd) == 1 and os.fsencode(odd[0]) == b"caf\xe9.txt"
    assert sandbox.read_file(odd[0]) == b"latin"


def test_closed_sandbox_refuses_work(workspace):
    sb = workspace.sandbox()
    sb.close()
    sb.close()  # idempotent
    with pytest.raises(SandboxError, match="closed"):
        sb.exec("true")


def test_commands_cannot_kill_the_tool_server(sandbox):
    sandbox.start_server()
    r = sandbox.exec("kill -9 1 $PPID; echo survived")  # the server is the sandbox's init (pid 1)
    assert "survived" in r.stdout and sandbox.server_running


def _server_host_pid(sandbox) -> int:
    for pid in sandbox.cgroup.pids():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"python" in Path(argv[0].decode()).name.encode() and any(a.endswith(b"toolserver.py") for a in argv):
            return pid
    raise AssertionError("no tool server process found")


def test_sandbox_recovers_when_its_server_is_killed(sandbox):
    sandbox.start_server()
    sandbox.call("bg_start", cmd="sleep 300")
    if not sandbox.cgroup.dirs:
        pytest.skip("needs a cgroup to find the server's host pid")
    sandbox.write_file("kept", "yes")
    os.kill(_server_host_pid(sandbox), signal.SIGKILL)
    for _ in range(100):
        if not sandbox.server_running:
            break
        time.sleep(0.05)
    assert not sandbox.server_running
    # Killing init killed every process in the sandbox (the background sleep too)...
    time.sleep(0.2)
    assert not any(b"sleep" in Path(f"/proc/{p}/cmdline").read_bytes() for p in sandbox.cgroup.pids())
    # ...the files are intact, and the next call starts a fresh server.
    assert sandbox.exec("cat kept", session="s").stdout == "yes"
    assert sandbox.stats()["server_restarts"] == 1
    sandbox.write_file("after", "ok")  # files survive; a fresh server starts
    assert sandbox.exec("cat after").stdout == "ok" and sandbox.stats()["server_restarts"] == 1
