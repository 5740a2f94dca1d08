"""`opencomposer sandbox doctor`: which isolation features this machine has, and which are enforced.

Each check *runs* the feature inside a real sandbox and observes the effect (a capability set, a
refused syscall, an unreachable address), rather than trusting configuration.
"""

from __future__ import annotations

import platform
import tempfile
from dataclasses import asdict, dataclass

from opencomposer.sandbox import cgroups, isolation, seccomp
from opencomposer.sandbox.base import Limits, SandboxConfig
from opencomposer.sandbox.local import Workspace


@dataclass(frozen=True)
class Check:
    feature: str
    enforced: bool
    detail: str


def run_checks() -> list[Check]:
    checks: list[Check] = []
    try:
        bw = isolation.bwrap_path()
        checks.append(Check("bubblewrap", True, f"{bw} ({isolation.bwrap_version()})"))
    except isolation.IsolationUnavailable as e:
        return [Check("bubblewrap", False, str(e))]
    ok, why = isolation.userns_supported()
    checks.append(Check("namespaces (user, mount, pid, net, ipc, uts, cgroup)", ok, why))
    if not ok:
        return checks
    ov, why = isolation.overlay_supported()
    checks.append(Check("copy-on-write layers (overlayfs)", ov, why if ov else f"{why}; falling back to full copies"))
    sup = cgroups.detect()
    for c in ("memory", "pids", "cpu"):
        where = sup.where(c)
        checks.append(Check(f"cgroup {c} limit", where is not None,
                            f"cgroup {where}" if where else "no writable controller: not enforced"))
    try:
        seccomp.build_filter()
        sec_ok, sec_why = True, f"{len(seccomp.DENIED)} syscalls denied ({platform.machine()})"
    except seccomp.SeccompUnsupported as e:
        sec_ok, sec_why = False, str(e)
    with tempfile.TemporaryDirectory(prefix="oc-doctor-") as d:
        cfg = SandboxConfig(limits=Limits(memory_mb=256, pids=64), seccomp=sec_ok)
        with Workspace(d, cfg) as ws, ws.sandbox() as sb:
            probe = sb.exec(
                "grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; "
                "python3 -S -c \"import socket; s=socket.socket(); s.settimeout(1);\n"
                "try:\n  s.connect(('1.1.1.1', 53)); print('NET=open')\n"
                "except OSError as e: print('NET=closed', e.errno)\"; "
                "echo RL=$(ulimit -t),$(ulimit -n); "
                "test -e /root/.bashrc -o -e /home && echo HOST_HOME=visible || echo HOST_HOME=hidden",
                timeout_s=20,
            )
            tree = sb.exec("setsid sleep 60 & (sleep 60 &) ; sleep 60", timeout_s=0.5)
            left = sb.cgroup.pids() if sb.cgroup.dirs else None
    out = probe.stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if line.count(":") == 1 and "\t" in line)
    cap = fields.get("CapEff", "").strip()
    checks.append(Check("all capabilities dropped", cap == "0000000000000000", f"CapEff={cap or '?'}"))
    nnp = fields.get("NoNewPrivs", "").strip()
    checks.append(Check("no new privileges", nnp == "1", f"NoNewPrivs={nnp or '?'}"))
    mode = fields.get("Seccomp", "").strip()
    checks.append(Check("seccomp filter", mode == "2", f"mode {mode or '?'}; {sec_why}"))
    checks.append(Check("network: loopback only", "NET=closed" in out,
                        next((ln for ln in out.splitlines() if ln.startswith("NET=")), "no probe output")))
    checks.append(Check("host home folders hidden", "HOST_HOME=hidden" in out, "only /usr, /etc, Python are bound"))
    want = f"RL={cfg.limits.cpu_s},{cfg.limits.open_files}"
    got = next((ln for ln in out.splitlines() if ln.startswith("RL=")), "RL=?")
    checks.append(Check("rlimits (cpu, address space, file size, open files, nproc)", got == want,
                        f"observed {got[3:]} (cpu_s,open_files), expected {want[3:]}"))
    killed = tree.killed_by == "timeout" and (left is None or not left)
    checks.append(Check("wall-clock timeout kills the whole process tree", killed,
                        f"killed_by={tree.killed_by}; processes left in the cgroup: "
                        f"{'unknown (no cgroup)' if left is None else len(left)}"))
    return checks


def as_dicts(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
