"""Host-side state of sandboxes, and the reaper that cleans up after owners that died.

Every host process that makes sandboxes is an *owner*, named `<pid>-<start time>` (the start time
makes a recycled pid a different owner). Everything an owner leaves on the host is named after it:

    <state root>/owner-<pid>-<start>/...            copy-on-write layers, upper and work dirs
    /sys/fs/cgroup/<controller>/opencomposer/<pid>-<start>.<sandbox>
    processes whose command line mentions the owner's state folder (bwrap and its children)

Mounts never leak: overlays are mounted inside each sandbox's own mount namespace and vanish with
it. A SIGKILLed owner therefore leaves only folders, cgroups and (without cgroups) possibly
processes, and `reap()` — run once by every new owner — removes all three for dead owners.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from opencomposer.sandbox import cgroups

log = logging.getLogger(__name__)


def default_state_root() -> Path:
    env = os.environ.get("OPENCOMPOSER_STATE")
    return Path(env) if env else Path(f"/tmp/opencomposer-{os.getuid()}")


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 overall: starttime in clock ticks


def owner_id(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}-{_start_time(pid)}"


def owner_alive(owner: str) -> bool:
    pid, _, start = owner.partition("-")
    return pid.isdigit() and _start_time(int(pid)) == start


@dataclass
class ReapReport:
    dirs: int = 0
    cgroups: int = 0
    processes: int = 0

    @property
    def total(self) -> int:
        return self.dirs + self.cgroups + self.processes


def reap(state_root: Path | None = None) -> ReapReport:
    """Remove what dead owners left behind: processes, cgroups, then folders."""
    root = state_root or default_state_root()
    report = ReapReport()
    dead_dirs = []
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith("owner-") and not owner_alive(d.name[len("owner-"):]):
                dead_dirs.append(d)
    # Processes first: a live process could recreate files while we delete them.
    needles = [f"/{d.name}/".encode() for d in dead_dirs]
    if needles:
        report.processes = _kill_matching(needles)
    for group in cgroups.list_groups():
        owner = group.name.split(".", 1)[0]
        if not owner_alive(owner):
            _kill_group_procs(group)
            if cgroups.remove_dir(group, deadline_s=2.0):
                report.cgroups += 1
    for d in dead_dirs:
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            report.dirs += 1
    if report.total:
        log.info("reaped %d folders, %d cgroups, %d processes of dead owners", report.dirs, report.cgroups,
                 report.processes)
    return report


def _kill_matching(needles: list[bytes]) -> int:
    killed = 0
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if any(n in cmd for n in needles):
            try:
                os.kill(int(name), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def _kill_group_procs(group: Path) -> None:
    try:
        pids = [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
