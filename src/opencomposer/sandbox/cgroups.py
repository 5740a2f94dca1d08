"""Per-sandbox cgroups: memory, pids and CPU limits plus accounting, on cgroup v1 or v2.

Which controllers exist depends on the machine. Our build machines use the hybrid layout: cgroup v2
is mounted but delegates only `hugetlb`, while the v1 `memory`, `pids`, `cpu` and `cpuacct`
hierarchies are writable (shared/reference/machine.md §1). So: detect per controller, prefer v2
where it has the controller, fall back to v1, and report plainly what is not enforced.

Every sandbox gets `<hierarchy>/opencomposer/<owner>.<sandbox>`, where `<owner>` names the host
process that made it; the reaper removes groups whose owner is dead (sandbox/reaper.py).
Processes join before they exec (the launcher writes its own pid into `cgroup.procs`), so nothing
the sandbox forks can start outside the group.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "opencomposer"
CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")


@dataclass(frozen=True)
class CgroupSupport:
    """Where each controller can be used: a v1 hierarchy path, the v2 root, or None."""

    v1: dict[str, Path] = field(default_factory=dict)
    v2_root: Path | None = None
    v2_controllers: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()

    def where(self, controller: str) -> str | None:
        if controller in self.v2_controllers:
            return "v2"
        if controller in self.v1:
            return "v1"
        return None

    @property
    def any(self) -> bool:
        return bool(self.v1) or bool(self.v2_controllers)


_support: CgroupSupport | None = None


def detect(root: Path = CGROUP_ROOT, refresh: bool = False) -> CgroupSupport:
    """Find writable v1 hierarchies and delegated v2 controllers (cached per process)."""
    global _support
    if _support is not None and not refresh and root == CGROUP_ROOT:
        return _support
    v1: dict[str, Path] = {}
    v2_root: Path | None = None
    v2c: set[str] = set()
    notes: list[str] = []
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        mounts = []
    for line in mounts:
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt, fstype, opts = Path(parts[1]), parts[2], parts[3].split(",")
        if fstype == "cgroup":
            for c in CONTROLLERS:
                if c in opts and c not in v1:
                    v1[c] = mnt
        elif fstype == "cgroup2" and v2_root is None:
            v2_root = mnt
    if v2_root is not None:
        try:
            v2c = set((v2_root / "cgroup.controllers").read_text().split())
        except OSError:
            v2c = set()
        if "cpu" in v2c:
            v2c.add("cpuacct")  # v2's cpu.stat carries usage
    usable_v1 = {}
    for c, path in v1.items():
        if c in v2c:
            continue
        if _writable(path):
            usable_v1[c] = path
        else:
            notes.append(f"cgroup v1 {c} at {path} is not writable")
    usable_v2 = {c for c in v2c if c in CONTROLLERS} if v2_root is not None and _writable(v2_root) else set()
    for c in ("memory", "pids", "cpu"):
        if c not in usable_v1 and c not in usable_v2:
            notes.append(f"no writable {c} controller (v1 or v2): {c} limits are not enforced")
    sup = CgroupSupport(v1=usable_v1, v2_root=v2_root if usable_v2 else None,
                        v2_controllers=frozenset(usable_v2), notes=tuple(notes))
    if root == CGROUP_ROOT:
        _support = sup
    return sup


def _writable(path: Path) -> bool:
    probe = path / PARENT
    try:
        probe.mkdir(exist_ok=True)
        return os.access(probe, os.W_OK)
    except OSError:
        return False


class SandboxCgroup:
    """The cgroups of one sandbox. `join_paths` are the `cgroup.procs` files a launcher writes to."""

    def __init__(self, name: str, *, memory_mb: int | None, pids: int | None, cpus: float | None,
                 support: CgroupSupport | None = None):
        self.name = name
        self.support = support or detect()
        self.dirs: dict[str, Path] = {}
        self.enforced: dict[str, bool] = {}
        self._make(memory_mb, pids, cpus)

    def _dir(self, controller: str) -> Path | None:
        where = self.support.where(controller)
        if where == "v1":
            return self.support.v1[controller] / PARENT / self.name
        if where == "v2":
            return self.support.v2_root / PARENT / self.name
        return None

    def _make(self, memory_mb: int | None, pids: int | None, cpus: float | None) -> None:
        for c in CONTROLLERS:
            d = self._dir(c)
            if d is None or d in self.dirs.values():
                if d is not None:
                    self.dirs[c] = d
                continue
            if self.support.where(c) == "v2":
                _enable_v2(self.support.v2_root, self.support.v2_controllers)
            d.mkdir(parents=True, exist_ok=True)
            self.dirs[c] = d
        v2 = {c: self.support.where(c) == "v2" for c in CONTROLLERS}
        if memory_mb is not None and "memory" in self.dirs:
            b = str(memory_mb << 20)
            if v2["memory"]:
                self.enforced["memory"] = _write(self.dirs["memory"] / "memory.max", b)
                _write(self.dirs["memory"] / "memory.swap.max", "0")
            else:
                self.enforced["memory"] = _write(self.dirs["memory"] / "memory.limit_in_bytes", b)
                _write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", b)  # absent without swap accounting
        if pids is not None and "pids" in self.dirs:
            self.enforced["pids"] = _write(self.dirs["pids"] / "pids.max", str(pids))
        if cpus is not None and "cpu" in self.dirs:
            period = 100_000
            quota = max(1000, int(cpus * period))
            if v2["cpu"]:
                self.enforced["cpu"] = _write(self.dirs["cpu"] / "cpu.max", f"{quota} {period}")
            else:
                ok = _write(self.dirs["cpu"] / "cpu.cfs_period_us", str(period))
                self.enforced["cpu"] = ok and _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(quota))

    @property
    def join_paths(self) -> list[str]:
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in set(self.dirs.values()):
            try:
                out |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return out

    def oom_kills(self) -> int:
        d = self.dirs.get("memory")
        if d is None:
            return 0
        name = "memory.events" if self.support.where("memory") == "v2" else "memory.oom_control"
        return _kv(d / name).get("oom_kill", 0)

    def stats(self) -> dict[str, float | int | None]:
        """cpu_s (user+system), peak_memory_mb, oom_kills, pids_denied (fork attempts refused)."""
        s: dict[str, float | int | None] = {"cpu_s": None, "peak_memory_mb": None, "oom_kills": None,
                                             "pids_denied": None}
        if "cpuacct" in self.dirs:
            d = self.dirs["cpuacct"]
            if self.support.where("cpuacct") == "v2":
                kv = _kv(d / "cpu.stat")
                if "usage_usec" in kv:
                    s["cpu_s"] = kv["usage_usec"] / 1e6
            else:
                v = _read(d / "cpuacct.usage")
                s["cpu_s"] = int(v) / 1e9 if v else None
        if "memory" in self.dirs:
            d = self.dirs["memory"]
            if self.support.where("memory") == "v2":
                peak = _read(d / "memory.peak")
                s["oom_kills"] = _kv(d / "memory.events").get("oom_kill")
            else:
                peak = _read(d / "memory.max_usage_in_bytes")
                s["oom_kills"] = _kv(d / "memory.oom_control").get("oom_kill")
            s["peak_memory_mb"] = int(peak) / 2**20 if peak else None
        if "pids" in self.dirs:
            s["pids_denied"] = _kv(self.dirs["pids"] / "pids.events").get("max")
        return s

    def kill_all(self, deadline_s: float = 5.0) -> None:
        """SIGKILL every process in the group until it is empty (or the deadline passes)."""
        end = time.monotonic() + deadline_s
        pause = 0.0005
        while time.monotonic() < end:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        log.warning("cgroup %s still has processes after %.1fs", self.name, deadline_s)

    def remove(self) -> None:
        self.kill_all()
        for d in set(self.dirs.values()):
            remove_dir(d)
        self.dirs.clear()


def remove_dir(d: Path, deadline_s: float = 5.0) -> bool:
    end = time.monotonic() + deadline_s
    pause = 0.0005
    while True:
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > end:
                log.warning("could not remove cgroup %s", d)
                return False
            time.sleep(pause)  # the last processes are still exiting
            pause = min(pause * 2, 0.05)


def list_groups(support: CgroupSupport | None = None) -> list[Path]:
    """Every sandbox cgroup directory of every owner (for the reaper)."""
    support = support or detect()
    parents = {p / PARENT for p in support.v1.values()}
    if support.v2_root is not None:
        parents.add(support.v2_root / PARENT)
    out = []
    for parent in parents:
        try:
            out += [d for d in parent.iterdir() if d.is_dir()]
        except OSError:
            continue
    return out


def _enable_v2(root: Path, controllers: frozenset[str]) -> None:
    want = " ".join(f"+{c}" for c in sorted(controllers) if c in ("memory", "pids", "cpu"))
    for d in (root, root / PARENT):
        _write(d / "cgroup.subtree_control", want)


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _kv(path: Path) -> dict[str, int]:
    out = {}
    for line in (_read(path) or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out
