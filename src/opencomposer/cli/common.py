"""Helpers every command module shares: config overrides, the data folder, gating freshly made tasks, training progress."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _overrides(ns: argparse.Namespace, extra: list[str]) -> list[str]:
    bad = [x for x in extra if not (x.startswith("--") and "=" in x and len(x.split("=", 1)[0]) > 2)]
    if bad:
        print(f"error: unknown argument(s) {' '.join(bad)}: not a flag of this command (see --help), and config "
              "overrides look like --a.b=value", file=sys.stderr)
        raise SystemExit(2)
    return extra


def _data_dir() -> Path:
    import os

    return Path(os.environ.get("OPENCOMPOSER_DATA", "data"))


def _keep_gated(made: list[Path], what: str) -> int:
    """Gate freshly made task folders, drop the rejected (saying why), report how many remain."""
    from opencomposer.tasks import gates

    kept, rejected = gates.keep_valid(made)
    for p, failed in rejected:
        print(f"rejected {p.name}: {gates.describe(failed)}", file=sys.stderr)
    print(f"{len(kept)} {what}")
    return 0 if kept else 1


def _train_progress(total: int, label: str):
    from rich.console import Console
    from rich.progress import Progress

    bar = Progress(console=Console(stderr=True))
    task = bar.add_task(label, total=total)

    def update(step: int, rec: dict) -> None:
        bar.update(task, completed=step, description=f"{label} {rec['phase']} loss {rec['loss']:.3f}")
    return bar, update
