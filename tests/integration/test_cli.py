"""The CLI end to end, as a user runs it: sandbox run / fork-demo / doctor, a speedrun with a failing stage
(the whole smoke recipe is test_speedrun.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

BIN = [sys.executable, "-m", "opencomposer.cli"]


def cli(*args, cwd=None, timeout=300):
    return subprocess.run([*BIN, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def test_sandbox_run(repo):
    r = cli("sandbox", "run", "--workspace", str(repo), "--", "sh", "-c", "ls; echo hi > new; exit 3")
    assert r.returncode == 3 and "test_calc.py" in r.stdout
    assert not (repo / "new").exists()
    r = cli("sandbox", "run", "--workspace", str(repo), "--timeout", "0.5", "--", "sleep", "10")
    assert r.returncode == 137 and "killed by timeout" in r.stderr
    r = cli("sandbox", "run", "--workspace", str(repo / "missing"), "--", "true")
    assert r.returncode == 2 and "workspace directory not found" in r.stderr
    r = cli("sandbox", "run", "--workspace", str(repo), "--limits.memory_mb=64", "--", "python3", "-c",
            "bytearray(300 << 20)")
    assert r.returncode != 0
    r = cli("sandbox", "run", "--workspace", str(repo), "--limits.nope=1", "--", "true")
    assert r.returncode != 0 and "unknown key" in r.stderr


def test_fork_demo(repo):
    r = cli("sandbox", "fork-demo", "--workspace", str(repo))
    assert r.returncode == 0, r.stderr
    assert "child 2" in r.stdout and "restored from snapshot" in r.stdout


def test_doctor_json():
    r = cli("sandbox", "doctor", "--json")
    checks = json.loads(r.stdout)
    names = {c["feature"]: c["enforced"] for c in checks}
    assert names["all capabilities dropped"] and names["network: loopback only"]
    assert r.returncode == (0 if all(names.values()) else 1)


def test_a_failed_stage_is_marked_and_the_report_card_still_written(tmp_path):
    """The model stage fails (its folder cannot be made: a file is in the way); the next stage still
    runs, the report card is written with the failure marked, and the command says so in one line
    with a non-zero exit."""
    (tmp_path / "afile").write_text("x")
    # cpt runs after it, and fails too: its base model is the one the model stage could not make
    r = cli("speedrun", "--preset", "smoke", f"--out_dir={tmp_path / 'runs'}", '--stages=["sandbox", "model", "cpt"]',
            f"--model.folder={tmp_path / 'afile' / 'model'}")
    assert r.returncode == 2 and "stage(s) model, cpt failed" in r.stderr and "Traceback" not in r.stderr
    (run,) = list((tmp_path / "runs").iterdir())
    report = (run / "report.md").read_text()
    assert "| model | **failed** |" in report and "| cpt | **failed** |" in report and "### Sandbox" in report
    assert "| agent_base | skipped |" in report
    assert (run / "report.html").exists()


def test_user_mistakes_are_one_line(tmp_path):
    for args in (["serve", "--no-such-flag"], ["tasks", "validate", str(tmp_path), "--bogus"],
                 ["eval", "run", "--model", "oracle", "--tasks", str(tmp_path / "missing")],
                 ["pretrain", "--no_such_key=1"], ["sft", f"--model={tmp_path / 'missing'}"]):
        r = cli(*args, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "error" in r.stderr, (args, r.stderr[-500:])
    assert not (tmp_path / "runs").exists()  # a start that fails leaves no run folder behind
    r = cli("--debug", "pretrain", "--no_such_key=1")
    assert r.returncode != 0 and "Traceback" in r.stderr  # --debug shows it
