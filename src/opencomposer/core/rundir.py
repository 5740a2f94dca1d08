"""Run folders: the one place that names the files a run writes.

A run folder holds everything a stage produced, so that the report card can be made from it alone:

    runs/20261130-071800-speedrun/
      config.json        resolved config of the run
      events.jsonl       what happened, in order (stage start/end, errors)
      metrics.jsonl      numbers, one JSON object a line
      log.txt            the human log
      <stage>/           a stage's own files (e.g. sandbox/summary.json)
      report.md          the report card
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.core.config import dump_json


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def create(cls, base: str | Path = "runs", name: str = "run") -> "RunDir":
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(base)
        for i in range(1000):
            root = base / (f"{stamp}-{name}" if i == 0 else f"{stamp}-{name}-{i}")
            try:
                root.mkdir(parents=True, exist_ok=False)
                return cls(root)
            except FileExistsError:
                continue
        raise RuntimeError(f"could not create a fresh run folder under {base}")

    @classmethod
    def open(cls, root: str | Path) -> "RunDir":
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(f"run folder not found: {root}")
        return cls(root)

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def log(self) -> Path:
        return self.root / "log.txt"

    @property
    def report(self) -> Path:
        return self.root / "report.md"

    def stage(self, name: str) -> Path:
        """The folder a stage writes its own files into (created on first use)."""
        p = self.root / name
        p.mkdir(exist_ok=True)
        return p

    def write_config(self, cfg: Any) -> None:
        write_atomic(self.config, dump_json(cfg) + "\n")

    def write_json(self, relpath: str, obj: Any) -> Path:
        p = self.root / relpath
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(p, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
        return p

    def read_json(self, relpath: str) -> Any:
        return json.loads((self.root / relpath).read_text())


def write_atomic(path: Path, text: str) -> None:
    """Write via a temp file and rename, so a crash never leaves a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
