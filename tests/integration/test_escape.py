"""The escape battery: hostile programs run in a sandbox, and each test checks from the host that
nothing got out. Every probe asserts containment (the host is unchanged, the secret unread, the
process alive), not merely that a command failed."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from opencomposer.sandbox.base import Limits, SandboxConfig
from opencomposer.sandbox.local import Workspace

LIMITS = Limits(memory_mb=256, pids=64, cpus=1.0, cpu_s=20, file_size_mb=16, tmp_mb=32, nproc=256)


@pytest.fixture
def secret(tmp_path):
    p = tmp_path / "host-secret.txt"
    p.write_text("TOPSECRET-host-value\n")
    return p


@pytest.fixture
def ws(repo):
    with Workspace(repo, SandboxConfig(limits=LIMITS)) as w:
        yield w


@pytest.fixture(params=["one-shot", "server"])
def sb(ws, request):
    """Each probe runs in both exec paths: a one-shot bwrap, and through the tool server."""
    with ws.sandbox() as s:
        if request.param == "server":
            s.start_server()
        yield s


def run(sb, cmd, timeout=30):
    return sb.exec(cmd, timeout_s=timeout)


# -- the host filesystem -------------------------------------------------------------------------


def test_host_files_outside_the_workspace_are_invisible(sb, secret):
    r = run(sb, f"cat {secret}; ls {secret.parent}")
    assert "TOPSECRET" not in r.stdout and r.exit_code != 0


def test_host_home_and_checkout_are_invisible(sb):
    checkout = Path(__file__).resolve().parents[2]
    r = run(sb, f"ls -a /root /home {checkout} 2>&1; cat /root/.bash_history 2>&1")
    # Only the Python installation and the venv are bound; the checkout's sources are not.
    assert ".bashrc" not in r.stdout and "pyproject.toml" not in r.stdout and "src" not in r.stdout.split()


def test_shadow_files_are_masked(sb):
    r = run(sb, "cat /etc/shadow | wc -c")
    assert r.stdout.strip() == "0"


@pytest.mark.parametrize("target", ["/etc/opencomposer-escape", "/usr/bin/opencomposer-escape",
                                    "/usr/lib/opencomposer-escape"])
def test_system_folders_are_read_only(sb, target):
    r = run(sb, f"echo pwned > {target}")
    assert r.exit_code != 0 and not os.path.exists(target)


def test_dotdot_out_of_the_workspace_stays_inside(sb, repo):
    run(sb, "echo pwned > /workspace/../escaped; echo pwned > ../escaped2")
    assert not (repo.parent / "escaped").exists() and not (repo.parent / "escaped2").exists()
    assert not os.path.exists("/escaped") and not os.path.exists("/escaped2")


def test_symlink_to_host_path_does_not_reach_the_host(sb, secret):
    run(sb, f"ln -s {secret} link && echo pwned > link; ln -s {secret.parent} dir && echo x > dir/new")
    assert secret.read_text() == "TOPSECRET-host-value\n"
    assert not (secret.parent / "new").exists()


def test_overlay_lower_dir_from_mountinfo_is_not_writable(sb, repo):
    r = run(sb, "cat /proc/self/mountinfo")
    # Whatever host paths the mount table names, writing to them must not reach the host.
    run(sb, f"echo pwned > {repo}/README.md; echo pwned > {repo}/planted")
    assert (repo / "README.md").read_text() == "calc\n" and not (repo / "planted").exists()
    assert r.exit_code == 0


def test_tmp_is_private(sb, tmp_path):
    marker = tmp_path / "host-tmp-marker"
    marker.write_text("x")
    r = run(sb, "echo sandbox > /tmp/sbfile; ls /tmp")
    assert "host-tmp-marker" not in r.stdout and not os.path.exists("/tmp/sbfile")


# -- processes -------------------------------------------------------------------------------------


@pytest.fixture
def host_proc():
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def test_cannot_see_or_kill_host_processes(sb, host_proc):
    r = run(sb, f"kill -9 {host_proc.pid}; ls /proc | grep -c '^[0-9]'")
    time.sleep(0.1)
    assert host_proc.poll() is None
    assert int(r.stdout.strip().splitlines()[-1]) < 10  # only the sandbox's own few processes


def test_cannot_trace_processes(sb):
    code = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
            "r = libc.ptrace(0, 0, 0, 0); print(r, ctypes.get_errno())")
    r = run(sb, f"python3 -c '{code}'")
    assert r.stdout.split() == ["-1", "1"]  # PTRACE_TRACEME -> EPERM from the seccomp filter


def test_proc_does_not_expose_the_host(sb):
    r = run(sb, "cat /proc/1/cmdline | tr '\\0' ' '; echo; cat /proc/1/environ 2>&1 | head -c 200")
    assert "process_api" not in r.stdout and "firecracker" not in r.stdout
    assert "OPENCOMPOSER_STATE" not in r.stdout


def test_proc_sys_is_read_only(sb):
    r = run(sb, "echo 1 > /proc/sys/kernel/sysrq; echo 1 > /proc/sysrq-trigger")
    assert r.exit_code != 0


def test_fork_bomb_is_contained(sb):
    baseline = len(sb.cgroup.pids())  # outer bwrap, bwrap's init and the tool server, if running
    t = time.monotonic()
    r = run(sb, "bomb() { bomb | bomb & }; bomb; sleep 3", timeout=8)
    assert time.monotonic() - t < 30
    time.sleep(0.2)
    if "pids" in sb.cgroup.dirs:
        assert sb.cgroup.stats()["pids_denied"] > 0  # the pids limit refused forks
        # Afterwards only what ran before the bomb remains.
        for _ in range(50):
            if len(sb.cgroup.pids()) <= baseline:
                break
            time.sleep(0.05)
        assert len(sb.cgroup.pids()) <= baseline
    assert "fork" in r.stderr  # the bomb saw its forks refused
    assert subprocess.run(["true"]).returncode == 0  # the host still forks fine


def test_memory_bomb_is_killed(sb):
    r = run(sb, "python3 -c 'x = bytearray(1 << 30); print(len(x))'")
    assert r.exit_code != 0 and "1073741824" not in r.stdout
    assert r.killed_by in ("memory", "signal:SIGKILL") or "MemoryError" in r.stderr


def test_big_file_is_stopped_at_the_file_size_limit(sb, repo):
    r = run(sb, "head -c 64M /dev/zero > big.bin")
    assert r.killed_by == "file_size" and r.exit_code == 128 + 25  # SIGXFSZ
    size = int(run(sb, "stat -c %s big.bin").stdout.strip())
    assert size <= LIMITS.file_size_mb << 20
    assert not (repo / "big.bin").exists()


def test_tmp_fill_is_bounded(sb):
    r = run(sb, "for i in 1 2 3 4; do head -c 15M /dev/zero > /tmp/fill$i || exit 9; done")
    assert r.exit_code == 9 and "No space left" in r.stderr


def test_endless_output_is_capped(sb):
    r = run(sb, "yes pwned", timeout=10)
    assert r.killed_by in ("output_limit", "timeout") and r.stdout_truncated
    assert len(r.stdout) <= sb.config.output_limit_bytes + 100


def test_sleeping_past_the_timeout_kills_every_descendant(sb):
    t = time.monotonic()
    r = run(sb, "setsid sleep 300 & (nohup sleep 300 &) ; sleep 300", timeout=0.5)
    assert r.killed_by == "timeout" and time.monotonic() - t < 10
    ps = run(sb, "ps -eo stat=,comm= | awk '$1 !~ /^Z/ && $2 == \"sleep\"' | wc -l")  # zombies are dead
    assert ps.stdout.strip() == "0"


def test_cpu_time_limit(ws):
    cfg = SandboxConfig(limits=Limits(cpu_s=1, memory_mb=256, pids=64))
    with Workspace(ws.source, cfg) as w, w.sandbox() as s:
        r = s.exec("python3 -c 'while True: pass'", timeout_s=30)
        assert r.killed_by in ("cpu_time", "signal:SIGKILL") and r.duration_s < 20


# -- privileges -----------------------------------------------------------------------------------


def test_no_capabilities_and_no_new_privileges(sb):
    r = run(sb, "grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")
    f = dict(line.split(":\t") for line in r.stdout.splitlines())
    assert f["CapEff"] == f["CapPrm"] == f["CapBnd"] == "0000000000000000"
    assert f["NoNewPrivs"] == "1" and f["Seccomp"] == "2"


def test_setuid_binaries_do_not_grant_root(sb):
    r = run(sb, "cp /bin/bash ./rootbash && chmod 4755 ./rootbash; ./rootbash -p -c 'id -u'; su -c id root 2>&1")
    assert r.stdout.splitlines()[0] == "1000"
    assert "uid=0" not in r.stdout


@pytest.mark.parametrize("cmd", [
    "mount -t tmpfs none /workspace/pkg",
    "unshare -U true",
    "unshare -r true",
    "chroot / true",
    "hostname pwned",
    "python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); sys.exit(0 if l.syscall(321,0,0,0)>=0 else 1)'",
    "python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); sys.exit(0 if l.syscall(250,0,0,0)>=0 else 1)'",
])
def test_privileged_operations_fail(sb, cmd):
    before = socket.gethostname()
    r = run(sb, cmd)
    assert r.exit_code != 0, (cmd, r.stdout, r.stderr)
    assert socket.gethostname() == before


def test_no_devices_or_host_sockets(sb):
    r = run(sb, "ls /dev; for p in /var/run/docker.sock /run/containerd /sys/fs/cgroup /dev/kvm; do "
                "test -e $p && echo PRESENT:$p; done; true")
    devs = set(r.stdout.split())
    assert not devs & {"vda", "sda", "kvm", "mem", "loop0"}
    assert "PRESENT" not in r.stdout


# -- network --------------------------------------------------------------------------------------


@pytest.fixture
def host_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    hits = []

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
                hits.append(1)
                c.close()
            except OSError:
                continue

    stop = threading.Event()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], hits
    stop.set()
    t.join(2)
    srv.close()


def test_host_loopback_is_unreachable(sb, host_server):
    port, hits = host_server
    code = (f"import socket; s=socket.socket(); s.settimeout(2)\n"
            f"try:\n  s.connect(('127.0.0.1', {port})); print('CONNECTED')\nexcept OSError as e: print('refused', e.errno)")
    r = run(sb, f"python3 -c \"{code}\"")
    assert "CONNECTED" not in r.stdout and not hits


def test_outside_network_is_unreachable(sb):
    code = ("import socket; s=socket.socket(); s.settimeout(2)\n"
            "try:\n  s.connect(('1.1.1.1', 80)); print('CONNECTED')\nexcept OSError as e: print('blocked', e.errno)")
    r = run(sb, f"python3 -c \"{code}\"; cat /sys/class/net/*/operstate 2>/dev/null; ls /sys/class/net 2>&1")
    assert "CONNECTED" not in r.stdout and "blocked" in r.stdout


def test_loopback_inside_works(sb):
    code = ("import socket; a=socket.socket(); a.bind(('127.0.0.1',0)); a.listen(1); "
            "b=socket.create_connection(a.getsockname()); print('ok')")
    assert run(sb, f"python3 -c \"{code}\"").stdout.strip() == "ok"


# -- sandboxes from each other ----------------------------------------------------------------


def test_sandboxes_cannot_see_each_other(ws):
    with ws.sandbox() as a, ws.sandbox() as b:
        b.start_server()
        b.call("bg_start", cmd="sleep 300 # marker-b")
        b.exec("echo b-secret > secret-b")
        r = a.exec("cat secret-b; ps -eo args")
        assert "b-secret" not in r.stdout and "marker-b" not in r.stdout
