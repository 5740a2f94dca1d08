from __future__ import annotations

import json

from opencomposer.core.metrics import EventLog, MetricsWriter, read_jsonl
from opencomposer.core.rundir import RunDir


def test_rundir_names_and_uniqueness(tmp_path):
    a = RunDir.create(tmp_path, "x")
    b = RunDir.create(tmp_path, "x")
    assert a.root != b.root and a.root.is_dir() and b.root.is_dir()
    a.write_json("stage/summary.json", {"k": 1})
    assert a.read_json("stage/summary.json") == {"k": 1}
    assert a.stage("s").is_dir()


def test_metrics_survive_a_torn_line(tmp_path):
    p = tmp_path / "m.jsonl"
    with MetricsWriter(p) as m:
        m.log(1, loss=2.5)
        m.log(2, loss=2.0)
    with p.open("a") as f:
        f.write('{"step": 3, "loss": ')  # a crash mid-write
    rows = list(read_jsonl(p))
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["loss"] == 2.0
    with EventLog(tmp_path / "e.jsonl") as e:
        e.emit("stage_start", stage="s")
    assert json.loads((tmp_path / "e.jsonl").read_text())["event"] == "stage_start"
