"""Shared by the benchmark scripts: a real ~50 MB / ~4,000-file tree, and the docs/benchmarks.md writer."""

from __future__ import annotations

import shutil
import statistics
import sysconfig
import time
from pathlib import Path


def make_tree(dest: Path, target_files: int = 4000, max_file: int = 1 << 20) -> tuple[int, int]:
    """About 50 MB in about 4,000 real files: this Python's standard library (files under 1 MiB),
    topped up with files from its site-packages."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])

    def files(root: Path, skip_site: bool) -> list[Path]:
        return sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                      and not (skip_site and "site-packages" in p.parts) and p.stat().st_size < max_file)

    chosen = [(stdlib, p) for p in files(stdlib, True)]
    chosen += [(purelib, p) for p in files(purelib, False)][: max(0, target_files - len(chosen))]
    size = 0
    for root, p in chosen:
        out = dest / root.name / p.relative_to(root)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, out)
        size += p.stat().st_size
    return len(chosen), size


def timed(fn, n: int = 5) -> float:
    """Median seconds of n calls after one warm-up call."""
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def write_section(path: Path, name: str, md: str) -> None:
    """Replace the section between markers for `name` in docs/benchmarks.md (other sections stay)."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nMeasured side by side in one run; noisy 2-core VM.\n"
    block = f"{start}\n{md}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def cpu_summary() -> str:
    """The CPU's model name and its widest vector extensions: the same code measures very
    differently with and without AVX-512 (oneDNN ran about 2x MKL on an AVX-512 host and level
    with it on an AVX2-only one), so the table says which it ran on."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown CPU")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({', '.join(ext) or 'no AVX2'})"
