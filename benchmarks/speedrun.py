"""Wall time of each stage of a speedrun on this machine, read from its run folder.

    .venv/bin/python benchmarks/speedrun.py [--preset default] [--run RUN_DIR]
                                            # writes "speedrun stages" in docs/benchmarks.md
                                            # (a preset other than default: its own section)

Without --run it runs `opencomposer speedrun --preset PRESET --fresh` first (the default preset
took 80-98 minutes here, docs/benchmarks.md). A stage's time is its last `stage_end` in events.jsonl; a resumed run's
stages are each counted once, in the invocation that finished them. There is no peer to compare
against here: the numbers say where the time goes.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

from corpus import cpu_summary, write_section

ROOT = Path(__file__).resolve().parents[1]


def stage_times(run: Path) -> tuple[dict[str, float], dict[str, str]]:
    times, status = {}, {}
    for line in (run / "events.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        e = json.loads(line)
        if "stage" not in e:
            continue
        if e["event"] == "stage_skipped" and status.get(e["stage"]) == "stage_end":
            continue  # a later invocation that skipped what an earlier one finished (`--stages`): it stays done
        status[e["stage"]] = e["event"]
        if e["event"] == "stage_end":
            times[e["stage"]] = e["seconds"]
    return times, status


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="default")
    ap.add_argument("--run", type=Path, help="an existing run folder (default: run the preset now)")
    ap.add_argument("--note", default="", help="what the numbers need said beside them (appended)")
    args = ap.parse_args()
    run = args.run
    cmd = f"opencomposer speedrun --preset {args.preset} --fresh"
    if run is None:
        out = ROOT / "runs" / "bench-speedrun"
        before = set(out.glob("*")) if out.exists() else set()
        r = subprocess.run([sys.executable, "-m", "opencomposer.cli", "speedrun", "--preset", args.preset, "--fresh",
                            f"--out_dir={out}"], cwd=ROOT)
        (run,) = set(out.glob("*")) - before
        if r.returncode not in (0, 2):
            return r.returncode
    times, status = stage_times(run)
    cfg = json.loads((run / "config.json").read_text())
    total = sum(times.values())
    rows = ["| stage | seconds | share | status |", "|---|---|---|---|"]
    for name, st in status.items():
        secs = times.get(name)
        rows.append(f"| {name} | {secs:.0f} | {secs / total:.0%} | done |" if secs is not None and st == "stage_end"
                    else f"| {name} | – | – | {'unfinished' if st == 'stage_start' else st.removeprefix('stage_')} |")
    preset = cfg.get("preset") or args.preset
    cmd = f"opencomposer speedrun --preset {preset} --fresh"
    md = "\n".join([
        "## speedrun stages" + ("" if preset == "default" else f" (preset `{preset}`)"), "",
        f"`benchmarks/speedrun.py --preset {cfg.get('preset')}` on this machine ({cpu_summary()}, "
        f"Python {platform.python_version()}); run `{run.name}` (reproduce: `{cmd}`). One run: a whole speedrun "
        "is too long to repeat for a median, so these are single measurements on a noisy 2-core VM.", "",
        *rows, "", f"Total of the stages that ended: {total / 60:.1f} min.", *([args.note, ""] if args.note else [])])
    write_section(ROOT / "docs" / "benchmarks.md", "speedrun" if preset == "default" else f"speedrun-{preset}", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
