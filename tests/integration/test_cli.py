"""The CLI end to end, as a user runs it: sandbox run / fork-demo / doctor, and a small speedrun."""

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


def test_speedrun_small(tmp_path):
    r = cli("speedrun", f"--out_dir={tmp_path}", "--sandbox.latency_samples=3", "--evals.passes=1",
            "--evals.benchmark.sources=[\"colorsys\"]", "--inference.samples=4", "--inference.max_tokens=12",
            "--cpt.steps=2", "--cpt.state_cases=1", "--cpt.eval_tokens=512", "--sft.steps=1", "--sft.seq_len=2048",
            "--kernels.steps=4", "--kernels.backends=[\"torch\", \"nvfp4\"]")
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = list(tmp_path.iterdir())
    summary = json.loads((run / "sandbox" / "summary.json").read_text())
    assert summary["tests_in_sandbox"]["ok"]
    assert summary["fork_demo"]["broken_child_fails"] and summary["fork_demo"]["clean_child_passes"]
    harness = json.loads((run / "harness" / "summary.json").read_text())
    assert harness["fixed"] and harness["stop_reason"] == "done"
    assert harness["tool_errors"] == {"MalformedArguments": 1}  # the oracle's deliberate broken call
    assert (run / "harness" / "trajectory.atif.json").exists()
    report = (run / "report.md").read_text()
    assert "## Sandbox" in report and "create + exec" in report and "## Harness" in report
    events = [(e["event"], e["stage"]) for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())]
    assert events == [("stage_start", "sandbox"), ("stage_end", "sandbox"),
                      ("stage_start", "harness"), ("stage_end", "harness"),
                      ("stage_start", "evals"), ("stage_end", "evals"),
                      ("stage_start", "model"), ("stage_end", "model"),
                      ("stage_start", "inference"), ("stage_end", "inference"),
                      ("stage_start", "cpt"), ("stage_end", "cpt"), ("stage_start", "sft"), ("stage_end", "sft"),
                      ("stage_start", "kernels"), ("stage_end", "kernels")]
    model = json.loads((run / "model" / "summary.json").read_text())
    assert model["writes_code"] and model["parameters"] > 100e6 and "## Model" in report
    evals = json.loads((run / "evals" / "summary.json").read_text())
    assert evals["calibrated"] and evals["tasks"] >= 4 and "## Tasks and evals" in report
    inference = json.loads((run / "inference" / "summary.json").read_text())
    assert inference["max_logprob_drift"] < 1e-3 and inference["version_switch_ok"] and "## Inference" in report
    assert inference["completion_tokens"] > 0 and inference["ttft_ms"] > 0
    cpt = json.loads((run / "cpt" / "summary.json").read_text())
    assert cpt["steps"] == 2 and cpt["perplexity_before"] > 1 and cpt["perplexity_after"] > 1
    assert (run / "cpt" / "model" / "tokenizer.json").exists() and "## Continued pretraining" in report
    sft = json.loads((run / "sft" / "summary.json").read_text())
    assert sft["examples"] >= 2 and sft["assistant_tokens"] > 0 and "## SFT" in report
    kernels = json.loads((run / "kernels" / "summary.json").read_text())
    assert all(kernels["quantisers_exact"].values()) and all(e["within"] for e in kernels["gemm_errors"].values())
    assert set(kernels["training"]) == {"torch", "nvfp4"} and len(kernels["training"]["nvfp4"]["losses"]) == 4
    assert "## Low-precision MoE kernels" in report and (run / "kernels" / "loss.svg").exists()


def test_a_failed_stage_is_marked_and_the_report_card_still_written(tmp_path):
    """The model stage fails (its folder cannot be made: a file is in the way); the next stage still
    runs, the report card is written with the failure marked, and the command says so in one line
    with a non-zero exit."""
    (tmp_path / "afile").write_text("x")
    off = [f"--{s}.enabled=false" for s in ("harness", "evals", "inference", "sft", "kernels")]
    off += ["--cpt.steps=1", "--cpt.state_cases=1", "--cpt.eval_tokens=256"]  # cpt runs after it, and fails too
    r = cli("speedrun", f"--out_dir={tmp_path / 'runs'}", "--sandbox.latency_samples=2",
            f"--model.folder={tmp_path / 'afile' / 'model'}", *off)
    assert r.returncode == 2 and "stage(s) model, cpt failed" in r.stderr and "Traceback" not in r.stderr
    (run,) = list((tmp_path / "runs").iterdir())
    report = (run / "report.md").read_text()
    assert "| model | failed |" in report and "| cpt | failed |" in report and "## Sandbox" in report


def test_user_mistakes_are_one_line(tmp_path):
    for args in (["serve", "--no-such-flag"], ["tasks", "validate", str(tmp_path), "--bogus"],
                 ["eval", "run", "--model", "oracle", "--tasks", str(tmp_path / "missing")],
                 ["pretrain", "--no_such_key=1"], ["sft", f"--model={tmp_path / 'missing'}"]):
        r = cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "error" in r.stderr, (args, r.stderr[-500:])
    r = cli("--debug", "pretrain", "--no_such_key=1")
    assert r.returncode != 0 and "Traceback" in r.stderr  # --debug shows it
