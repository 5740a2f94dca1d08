"""This process's memory: how much it holds, and giving freed heap back to the system.

The speedrun runs every stage in one process. glibc's malloc keeps memory that tensors freed in
its heap (the main arena grows with brk and only its top is returned; large blocks freed in the
middle stay resident), so each training stage left the next one less room: the default speedrun
was OOM-killed in its last RL step at 24 GB resident, where the same step resumed in a fresh
process peaked at 17.5 GB. `trim()` (glibc's `malloc_trim`) after each stage and RL step returns
those free pages. Elsewhere (another libc, another OS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

_libc = None


def trim() -> bool:
    """Return free heap pages to the OS (glibc); True when it released something."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(_libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def usage() -> dict[str, float]:
    """Resident and peak resident memory of this process in GB (peak: Linux's ru_maxrss in KiB)."""
    out = {"peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3)}
    try:
        with open("/proc/self/statm") as f:
            out["rss_gb"] = round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30, 3)
    except OSError:
        pass
    return out
