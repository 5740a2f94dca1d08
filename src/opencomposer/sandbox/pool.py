"""SandboxPool: admission by concurrency and live machine pressure, queueing with deadlines, and
per-sandbox accounting.

Composer 2's scheduler places environments "with awareness of live readings of hardware pressure
(CPU, memory, disk)" (report §5). The pool does the same on one machine: a sandbox is admitted
when a slot is free *and* load, available memory and free disk are within bounds; otherwise the
request waits, in arrival order, until its deadline, and then fails with the reason it was held.

    pool = SandboxPool(PoolConfig(max_concurrent=8))
    with pool.acquire(workspace, deadline_s=60) as sb:
        sb.exec("make test")
    pool.accounting()   # one record per finished sandbox: wall, CPU seconds, peak memory, ...
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from opencomposer.sandbox.base import SandboxError, Snapshot
from opencomposer.sandbox.local import LocalSandbox, Workspace


class AdmissionTimeout(SandboxError):
    """No sandbox could be admitted before the request's deadline."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PoolConfig:
    max_concurrent: int = 64
    """Live sandboxes at most (a sandbox without a running command costs only its folders)."""
    max_load_per_cpu: float | None = 8.0
    """Admit only while the 1-minute load average per CPU is below this."""
    min_available_memory_mb: int | None = 512
    """Admit only while MemAvailable is above this."""
    min_free_disk_mb: int | None = 1024
    """Admit only while the state folder's filesystem has this much free."""
    default_deadline_s: float = 600.0
    pressure_deadline_s: float = 60.0
    """A request held by machine pressure alone while this pool has no live sandbox fails after
    this long, whatever its deadline: nothing the pool will release can relieve it (a full disk
    left 16 rollouts of a CI run each waiting out its 600 s deadline)."""
    poll_s: float = 0.05


@dataclass
class SandboxRecord:
    id: str
    workspace: str
    queued_s: float
    wall_s: float = 0.0
    cpu_s: float | None = None
    peak_memory_mb: float | None = None
    oom_kills: int | None = None
    spawned: int = 0


@dataclass
class Pressure:
    load_per_cpu: float
    available_memory_mb: float
    free_disk_mb: float
    reasons: list[str] = field(default_factory=list)


def read_pressure(cfg: PoolConfig, disk_path: Path) -> Pressure:
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    avail = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) / 1024
                break
    except OSError:
        avail = float("inf")
    try:
        free = shutil.disk_usage(disk_path).free / 2**20
    except OSError:
        free = float("inf")
    p = Pressure(load, avail, free)
    if cfg.max_load_per_cpu is not None and load >= cfg.max_load_per_cpu:
        p.reasons.append(f"load {load:.2f}/cpu >= {cfg.max_load_per_cpu}")
    if cfg.min_available_memory_mb is not None and avail < cfg.min_available_memory_mb:
        p.reasons.append(f"available memory {avail:.0f} MiB < {cfg.min_available_memory_mb}")
    if cfg.min_free_disk_mb is not None and free < cfg.min_free_disk_mb:
        p.reasons.append(f"free disk {free:.0f} MiB < {cfg.min_free_disk_mb}")
    return p


class SandboxPool:
    def __init__(self, config: PoolConfig | None = None):
        self.config = config or PoolConfig()
        if self.config.max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self._cond = threading.Condition()
        self._live: dict[LocalSandbox, SandboxRecord] = {}
        self._queue: deque[object] = deque()
        self._records: list[SandboxRecord] = []
        self._closed = False
        self._stuck: tuple[float, str] | None = None
        """(since when, why): machine pressure alone has held the queue's head with nothing live."""

    def _admissible(self, ticket: object, disk: Path) -> tuple[bool, str, bool]:
        """(admitted, why not, whether only machine pressure that this pool cannot relieve holds it)."""
        if self._queue and self._queue[0] is not ticket:
            return False, "queued behind earlier requests", False
        if len(self._live) >= self.config.max_concurrent:
            return False, f"{len(self._live)} live sandboxes (max {self.config.max_concurrent})", False
        p = read_pressure(self.config, disk)
        if p.reasons:
            return False, "; ".join(p.reasons), not self._live
        return True, "", False

    def open(self, workspace: Workspace, snapshot: Snapshot | None = None, *,
             deadline_s: float | None = None) -> LocalSandbox:
        """Admit and create a sandbox (the caller closes it, or uses `acquire`)."""
        deadline_s = self.config.default_deadline_s if deadline_s is None else deadline_s
        start = time.monotonic()
        end = start + deadline_s
        ticket = object()
        with self._cond:
            if self._closed:
                raise SandboxError("pool is closed")
            self._queue.append(ticket)
            try:
                while True:
                    ok, why, stuck = self._admissible(ticket, workspace.root)
                    now = time.monotonic()
                    if self._queue[0] is ticket:  # the head measures pressure for everyone queued
                        self._stuck = (self._stuck or (now, why)) if stuck else None
                    if ok:
                        break
                    if self._stuck is not None and now - self._stuck[0] >= self.config.pressure_deadline_s:
                        # every queued request gives up together, not one deadline after another
                        raise AdmissionTimeout(f"no sandbox admitted: {self._stuck[1]} for {now - self._stuck[0]:.0f}s "
                                               "with no sandbox of this pool live to release (PoolConfig sets the "
                                               "bounds)")
                    left = end - now
                    if left <= 0:
                        raise AdmissionTimeout(f"no sandbox admitted within {deadline_s:.1f}s: {why}")
                    self._cond.wait(min(left, self.config.poll_s))
                    if self._closed:
                        raise SandboxError("pool is closed")
            finally:
                self._queue.remove(ticket)
                if not self._queue:
                    self._stuck = None  # the next request measures afresh
                self._cond.notify_all()
            sb = workspace.sandbox(snapshot)
            self._live[sb] = SandboxRecord(sb.id, str(workspace.source), queued_s=time.monotonic() - start)
        return sb

    def release(self, sb: LocalSandbox) -> SandboxRecord:
        """Close a sandbox from `open` and record what it used."""
        stats = sb.stats()
        with self._cond:
            rec = self._live.get(sb)
        if rec is None:
            raise SandboxError(f"{sb.id} was not opened by this pool")
        rec.wall_s = stats["age_s"]
        rec.cpu_s, rec.peak_memory_mb, rec.oom_kills = stats["cpu_s"], stats["peak_memory_mb"], stats["oom_kills"]
        rec.spawned = stats["spawned"]
        try:
            sb.close()
        finally:
            with self._cond:
                self._live.pop(sb, None)
                self._records.append(rec)
                self._cond.notify_all()
        return rec

    @contextmanager
    def acquire(self, workspace: Workspace, snapshot: Snapshot | None = None, *,
                deadline_s: float | None = None) -> Iterator[LocalSandbox]:
        sb = self.open(workspace, snapshot, deadline_s=deadline_s)
        try:
            yield sb
        finally:
            self.release(sb)

    @property
    def live(self) -> int:
        with self._cond:
            return len(self._live)

    def accounting(self) -> list[SandboxRecord]:
        with self._cond:
            return list(self._records)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            live = list(self._live)
            self._cond.notify_all()
        for sb in live:
            self.release(sb)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
