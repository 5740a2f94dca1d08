"""What a restarted RL run resumes from: the trainer's state after its last step that moved a weight
(`step.pt`: model, optimiser, policy version and the groups taken), and the groups taken by the
steps after it that moved none (`trained.json`).

A step that moved no weight (every group skipped, or all at advantage 0) leaves model and optimiser
as `step.pt` holds them, so only the groups it took are written: a few bytes against 1.6 GB for the
embedded default, whose save took 2-7 s on the 2-core EPYC, and with `solved_groups = "skip"` most
steps of the default speedrun move nothing (23 of 32 in the run of docs/rl.md, "Only split groups
train"). `step.pt` is written first and `trained.json` after it, both whole (tmp + rename):
`trained.json` counts only while its version is `step.pt`'s, so a run killed between the two writes
resumes from `step.pt` alone, which lists every group taken up to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from opencomposer.core.rundir import write_atomic

STATE = "step.pt"
TAKEN = "trained.json"


def save_progress(out: Path, trainer, version: int, trained: set[int], moved: bool) -> None:
    """After a step: the trainer's state where the step moved a weight (or none is saved yet), and
    the groups taken in any case."""
    out = Path(out)
    if moved or not (out / STATE).exists():
        trainer.save(out / STATE, version, sorted(trained))
    write_atomic(out / TAKEN, json.dumps({"version": version, "trained_groups": sorted(trained)}) + "\n")


def load_progress(out: Path, trainer) -> tuple[int, set[int]]:
    """The trainer loaded as its last saved step left it; the policy version and every group taken
    (0 and none for a new run)."""
    out = Path(out)
    if not (out / STATE).exists():
        return 0, set()
    version, trained = trainer.load(out / STATE)
    taken = set(trained)
    if (out / TAKEN).exists():
        later = json.loads((out / TAKEN).read_text())
        if later["version"] == version:  # steps after the state that moved no weight
            taken |= set(later["trained_groups"])
    return version, taken
