"""The task build of the speedrun's default recipe (16 stdlib sources, renames of at most two
places), one source at a time against sources side by side, in one run:

    .venv/bin/python benchmarks/tasks_build.py [--workers 2] [--rounds 1]   # writes "task-build"

Each build is from scratch into a temporary folder (the fingerprint cache is not used). The two
datasets must come out the same (task ids, order and splits); the script fails otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

from corpus import write_section

ROOT = Path(__file__).resolve().parents[1]


def build(workers: int, out: Path) -> tuple[float, list[tuple[str, str]]]:
    from opencomposer.core.config import load_config
    from opencomposer.speedrun import SpeedrunConfig
    from opencomposer.tasks.default import build_default

    cfg = load_config(SpeedrunConfig, ROOT / "configs" / "speedrun-default.toml").evals.benchmark
    t = time.perf_counter()
    m = build_default(out, dataclasses.replace(cfg, workers=workers))
    return time.perf_counter() - t, [(x["id"], x["split"]) for x in m.tasks]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    times: dict[int, list[float]] = {1: [], args.workers: []}
    tasks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):  # alternate, so the machine's noise falls on both
            for w in times:
                s, tasks[w] = build(w, Path(tmp) / f"r{r}-w{w}")
                times[w].append(s)
                print(f"workers={w}: {s:.0f} s, {len(tasks[w])} tasks", flush=True)
    if tasks[1] != tasks[args.workers]:
        raise SystemExit("the two builds made different datasets")
    one, many = statistics.median(times[1]), statistics.median(times[args.workers])
    md = "\n".join([
        "## Task build (the speedrun default's 16 stdlib sources)", "",
        f"`benchmarks/tasks_build.py --workers {args.workers} --rounds {args.rounds}`; "
        f"{'medians of ' + str(args.rounds) + ' rounds' if args.rounds > 1 else 'one round, not a median'}; "
        "CPU, 2 cores, noisy VM.", "",
        "| sources at once | seconds | tasks |", "|---|---|---|",
        f"| 1 | {one:.0f} | {len(tasks[1])} |", f"| {args.workers} | {many:.0f} | {len(tasks[args.workers])} |", "",
        f"Side by side against one at a time: **{one / many:.2f}x**; the same task ids, order and splits.", ""])
    write_section(ROOT / "docs" / "benchmarks.md", "task-build", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
