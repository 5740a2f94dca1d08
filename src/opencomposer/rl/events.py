"""The RL run's append-only event log: every sample's lifecycle, every step, every fault.

A sample moves queued -> rolling_out -> grading -> grouped -> trained, or ends `failed` with a
reason (report §6.2: "slot-based sample lifecycle state management" by a central reconciler). Run
events (a step trained, weights published, a replica restarted, a weight version rejected) have no
sample. Each line is one JSON object, written and fsynced before the state change is acted on, so
a restarted run reads what happened from here: nothing trained twice, no finished group lost.
A torn last line (the process died while writing it) is ignored.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

STATES = ("queued", "rolling_out", "grading", "grouped", "trained", "failed")


class EventLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run

    def record(self, kind: str, sample: str | None = None, **fields) -> dict:
        """Append one event; `kind` is a sample state (with `sample`) or a run event."""
        if sample is not None and kind not in STATES:
            raise ValueError(f"unknown sample state {kind!r}; states: {STATES}")
        event = {"t": round(time.time(), 3), "kind": kind, **({"sample": sample} if sample else {}), **fields}
        line = json.dumps(event, default=str) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())
        return event

    def close(self) -> None:
        with self._lock:
            self._fh.close()

    def read(self) -> list[dict]:
        return read_events(self.path)


def read_events(path: str | Path) -> list[dict]:
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn write at a crash
    return out


def sample_states(events: list[dict]) -> dict[str, dict]:
    """The last event of every sample."""
    last: dict[str, dict] = {}
    for e in events:
        if "sample" in e:
            last[e["sample"]] = e
    return last
