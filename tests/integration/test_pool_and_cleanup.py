"""SandboxPool admission and accounting; and the crash test: SIGKILL the owner mid-run, then the
next start leaves the host clean (no processes, cgroups or folders of the dead owner)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from opencomposer.sandbox import cgroups
from opencomposer.sandbox.pool import AdmissionTimeout, PoolConfig, SandboxPool, read_pressure


def test_pool_limits_concurrency_and_accounts(workspace):
    pool = SandboxPool(PoolConfig(max_concurrent=2, max_load_per_cpu=None))
    peak = []
    lock = threading.Lock()
    live = [0]

    def work(i):
        with pool.acquire(workspace, deadline_s=60) as sb:
            with lock:
                live[0] += 1
                peak.append(live[0])
            sb.exec("python3 -c 'sum(range(20_000_000))'")  # ~0.3 s: well over the 0.05 s asserted below
            with lock:
                live[0] -= 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert max(peak) <= 2 and len(peak) == 6
    recs = pool.accounting()
    assert len(recs) == 6 and pool.live == 0
    if "cpuacct" in cgroups.detect().v1 or cgroups.detect().v2_controllers:
        assert all(r.cpu_s and r.cpu_s > 0.05 for r in recs)  # each ran a real CPU-bound command
        assert all(r.peak_memory_mb and r.peak_memory_mb > 1 for r in recs)
    assert any(r.queued_s > 0.01 for r in recs)  # some had to wait for a slot


def test_pool_deadline_and_pressure(workspace):
    pool = SandboxPool(PoolConfig(max_concurrent=1, max_load_per_cpu=None))
    with pool.acquire(workspace):
        t = time.monotonic()
        with pytest.raises(AdmissionTimeout, match="1 live sandboxes"):
            pool.open(workspace, deadline_s=0.3)
        assert time.monotonic() - t < 5
    # Pressure that can never be met (more free memory than the machine has) holds admission.
    starved = SandboxPool(PoolConfig(min_available_memory_mb=10**9, max_load_per_cpu=None))
    with pytest.raises(AdmissionTimeout, match="available memory"):
        starved.open(workspace, deadline_s=0.2)
    # With no sandbox of its own live, the pool cannot relieve pressure: it gives up well before
    # the request's own deadline, and says why.
    hopeless = SandboxPool(PoolConfig(min_free_disk_mb=10**12, max_load_per_cpu=None, pressure_deadline_s=2.0))
    errors: list[str] = []

    def refused():
        try:
            hopeless.open(workspace, deadline_s=600)
        except AdmissionTimeout as e:
            errors.append(str(e))

    t = time.monotonic()
    queued = [threading.Thread(target=refused) for _ in range(5)]
    for th in queued:
        th.start()
    for th in queued:
        th.join(60)
    assert len(errors) == 5 and all("free disk" in e and "no sandbox of this pool live" in e for e in errors)
    assert time.monotonic() - t < 7  # together after ~2 s, not five deadlines one after another (10 s)
    p = read_pressure(PoolConfig(), workspace.root)
    assert p.available_memory_mb > 0 and p.free_disk_mb > 0


CRASHER = textwrap.dedent("""
    import sys, threading
    from opencomposer.sandbox.local import Workspace
    ws = Workspace(sys.argv[1])
    a = ws.sandbox(); a.start_server(); a.call("bg_start", cmd="sleep 300")
    a.exec("echo x > f"); snap = a.snapshot()
    b = ws.sandbox(snap)
    threading.Thread(target=lambda: b.exec("sleep 300", timeout_s=600), daemon=True).start()
    import time; time.sleep(1.0)
    print("READY", flush=True)
    time.sleep(600)
""")


def _owner_processes(needle: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if needle.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    out.append(int(name))
            except OSError:
                pass
    return out


def test_sigkilled_owner_leaves_nothing_after_next_start(repo, _state_dir):
    proc = subprocess.Popen([sys.executable, "-c", CRASHER, str(repo)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OPENCOMPOSER_STATE": str(_state_dir)})
    try:
        assert proc.stdout.readline().strip() == "READY"
        from opencomposer.sandbox import reaper

        owner = reaper.owner_id(proc.pid)
        owner_dir = _state_dir / f"owner-{owner}"
        assert owner_dir.is_dir()
        groups = [g for g in cgroups.list_groups() if g.name.startswith(owner + ".")]
        assert (not cgroups.detect().any) or groups
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The next start (a new owner process) reaps.
    r = subprocess.run([sys.executable, "-c",
                        "import sys; from opencomposer.sandbox.local import Workspace; Workspace(sys.argv[1]).close()",
                        str(repo)], env={**os.environ, "OPENCOMPOSER_STATE": str(_state_dir)}, timeout=60)
    assert r.returncode == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _owner_processes(f"owner-{owner}"):
        time.sleep(0.05)
    assert _owner_processes(f"owner-{owner}") == []
    assert not owner_dir.exists()
    assert [g for g in cgroups.list_groups() if g.name.startswith(owner + ".")] == []
