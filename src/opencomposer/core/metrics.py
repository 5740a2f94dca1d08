"""JSONL metrics and event logs: append-only, one JSON object a line, flushed on every write.

Readers tolerate a torn last line (a crash mid-write), so a killed run loses at most that line.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class JsonlWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._f = self.path.open("a", encoding="utf-8")
        if self._f.tell() and not _ends_with_newline(self.path):
            self._f.write("\n")  # a line torn by a crash stays torn; what follows starts clean

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True, default=str)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsWriter(JsonlWriter):
    """`log(step, name=value, ...)` -> {"step": ..., "time": ..., "name": value}."""

    def log(self, step: int | None = None, **values: Any) -> None:
        self.write({"time": time.time(), "step": step, **values})


class EventLog(JsonlWriter):
    """`emit("stage_start", stage="sandbox")` -> {"event": ..., "time": ..., ...}."""

    def emit(self, event: str, **fields: Any) -> None:
        self.write({"time": time.time(), "event": event, **fields})


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return
    with p.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a crash
